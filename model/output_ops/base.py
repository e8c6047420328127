"""What an operation on the attention output is: a module built per layer from a ``model`` option."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn


def layer_kind(value: Any, layer: int) -> str:
    """Layer ``layer``'s kind of an option that is a kind or a list of kinds repeating over the layers."""
    return value[layer % len(value)] if isinstance(value, (list, tuple)) else value


class OutputOp(nn.Module):
    """y (B, H, T, hd) -> y of the same shape, from the attention input x (B, T, C) and the
    queries' own values v (B, H, T, hd) (a GQA layer's value heads repeated to the query heads)."""

    key: ClassVar[str]  # its model option (a GPTConfig field)
    kinds: ClassVar[tuple[str, ...]]  # the option's values; the first is "none" (no module)

    @classmethod
    def check(cls, config) -> None:
        """The option is one of ``kinds`` or a non-empty list of them no longer than the layers."""
        value, allowed = getattr(config, cls.key), ", ".join(map(repr, cls.kinds))
        if isinstance(value, (list, tuple)):
            if not (1 <= len(value) <= config.n_layer and all(v in cls.kinds for v in value)):
                raise ValueError(f"model.{cls.key} must be one of {allowed} or a list of 1 to "
                                 f"model.n_layer={config.n_layer} of them (layer l uses entry l % length), "
                                 f"got {list(value)!r}")
        elif value not in cls.kinds:
            raise ValueError(f"model.{cls.key} must be one of {allowed} or a per-layer list of them, got {value!r}")

    @classmethod
    def build(cls, config, layer: int) -> "OutputOp | None":
        kind = layer_kind(getattr(config, cls.key), layer)
        return None if kind == cls.kinds[0] else cls(config, kind)

    def init_weights(self, layer: int) -> None:
        """Called after the model's GPT-2 init (which sets every Linear to N(0, 0.02))."""

    def forward(self, y: Tensor, x: Tensor, v: Tensor) -> Tensor:
        raise NotImplementedError
