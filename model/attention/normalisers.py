"""The normaliser slot (``model.normaliser``): how each row's logits become attention weights,
applied by ``attend`` around the backend, so that no backend knows the normalisers.

- ``softmax``: the backend's own softmax.
- ``sink_learned`` / ``sink_zero``: softmax with a sink (sinks.py), one logit per head in every
  denominator, learned per layer or 0 (off-by-one). On a backend that returns its rows'
  log-sum-exp (``lse``: flex, math) one post-operation on (out, lse); on SDPA's backends (no
  differentiable LSE) one more key around their kernel call (``kernel_call``/``run``).
- ``stick_breaking``: stick_breaking.py's weights, on a backend that materialises the weights
  (``records``: math) and so takes them as a function of its logits.

``model.sinks=learned|zero`` is the old spelling of ``sink_learned|sink_zero`` (model/config.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model.attention.features import KEY_PIECES
from model.attention.sinks import extra_key, sink_weight
from model.attention.stick_breaking import stick_breaking_probabilities


def cannot(backend: Any, name: str, also: str = "") -> str:
    """The refusal of a backend that cannot run normaliser ``name`` (the error a strict one raises)."""
    return (f"model.attention={backend.name} cannot compute model.normaliser={name}; "
            f"use model.attention=auto{also} or math")


class Softmax:
    """The backend's softmax as it is."""

    sink: str | None = None  # the kind of sink logit each layer holds (model/gpt.py): learned, zero or None

    def __init__(self, name: str) -> None:
        self.name = name

    def refusal(self, backend: Any, dtype: torch.dtype | None = None) -> str | None:
        """Why ``backend`` cannot run this normaliser in compute ``dtype`` (None: any), or None."""
        return None

    def attend(self, backend: Any, q: Tensor, k: Tensor, v: Tensor, state: Any, dropout: float,
               sink: Tensor | None, **extras: Any) -> Any:
        """The backend's output (and weights, on a recording backend); ``sink``: the layer's (H,) sink
        logits, None without; ``extras``: the scheme's score terms, passed on."""
        return backend(q, k, v, state, dropout, **extras)


class StickBreaking(Softmax):
    """Stick-breaking weights in place of the softmax, on a backend that takes a weights function."""

    def refusal(self, backend: Any, dtype: torch.dtype | None = None) -> str | None:
        return None if backend.records else cannot(backend, self.name)

    def attend(self, backend, q, k, v, state, dropout, sink, **extras):
        return backend(q, k, v, state, dropout, weights=stick_breaking_probabilities, **extras)


class Sink(Softmax):
    """Softmax with a sink: the LSE rescale, or one more key on SDPA's kernel call."""

    def __init__(self, name: str, sink: str) -> None:
        super().__init__(name)
        self.sink = sink

    def refusal(self, backend: Any, dtype: torch.dtype | None = None) -> str | None:
        if backend.lse:
            return None
        if not hasattr(backend, "kernel_call"):
            return cannot(backend, self.name, ", flex")
        if dtype is not None and dtype not in KEY_PIECES:  # the key's logit goes in exact pieces: fp16 has none
            return (f"model.attention={backend.name} cannot join the sink of model.normaliser={self.name} in "
                    f"{str(dtype).removeprefix('torch.')} (no exact pieces of its logit); use model.attention=auto, "
                    f"flex or math")
        return None

    def attend(self, backend, q, k, v, state, dropout, sink, **extras):
        if backend.lse:
            *result, lse = backend(q, k, v, state, dropout, lse=True, **extras)
            weight = sink_weight(lse, sink)  # (B, H, Tq, 1), float32 (float64 for float64 compute)
            out = (result[0] * weight.to(result[0].dtype)).to(v.dtype)
            return (out, result[1] * weight.to(result[1].dtype)) if backend.records else out
        Tq, width = q.shape[2], v.shape[-1]
        return backend.run(extra_key(backend.kernel_call(q, k, v, state, dropout), sink))[..., -Tq:, :width]


NORMALISERS: dict[str, Softmax] = {n.name: n for n in (
    Softmax("softmax"), Sink("sink_learned", "learned"), Sink("sink_zero", "zero"), StickBreaking("stick_breaking"))}
