"""Typed model configuration (litgpt style): a small dataclass, not a dict."""

from __future__ import annotations

from dataclasses import InitVar, dataclass
from typing import Any

from model.attention import BACKENDS, CHOICES, NORMALISERS, SINKS
from model.differential import ATTENTION_KINDS, QUERIES_PER_HEAD
from model.output_ops import OUTPUTS
from model.temperature import KEYS_SEEN, TEMPERATURE_LAYERS, TEMPERATURES

NORMS = ("layernorm", "rmsnorm")  # the values of model.norm
MLPS = ("gelu", "swiglu")  # the values of model.mlp


def require(ok: bool, key: str, value: Any, allowed: str, error: type[ValueError] = ValueError) -> None:
    """A bad option fails early, naming its key, the value and what is allowed (the harness
    shows this ValueError as a one-line config error; pelab/config.py raises its ConfigError)."""
    if not ok:
        raise error(f"{key} must be {allowed}, got {value!r}")


def is_window(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_windows(config: GPTConfig) -> None:
    """``model.window`` and ``model.window_pattern``: positive integers (null = full), one of
    the two; a pattern repeats over the layers and may not be longer than them."""
    require(config.window is None or is_window(config.window), "model.window", config.window,
            "null (full attention) or an integer >= 1 (keys i-W+1..i)")
    pattern = config.window_pattern
    if pattern is not None:
        require(isinstance(pattern, (list, tuple)) and all(w is None or is_window(w) for w in pattern),
                "model.window_pattern", pattern, "null or a list of integers >= 1 and nulls (null = full attention)")
        require(config.window is None, "model.window and model.window_pattern", (config.window, list(pattern)),
                "one of the two (window sets every layer, window_pattern each)")
        require(1 <= len(pattern) <= config.n_layer, "model.window_pattern", list(pattern),
                f"1 to model.n_layer={config.n_layer} entries (layer l uses entry l % length: a shorter "
                f"pattern repeats)")
    require(config.attn_temperature not in KEYS_SEEN or not config.windowed
            or config.attn_temperature_layers == "global", "model.attn_temperature", config.attn_temperature,
            "none or llama4 with windows (log_length, logn and ssmax count every earlier key), or "
            "model.attn_temperature_layers=global (the full-attention layers only)")


def sink_normaliser(sinks: Any, normaliser: Any) -> Any:
    """``model.normaliser`` with ``model.sinks``, its old spelling, folded in: learned or zero with
    softmax is sink_learned or sink_zero; none (or null) leaves the normaliser as it is."""
    require(sinks is None or sinks in SINKS, "model.sinks", sinks, "one of " + ", ".join(map(repr, SINKS)))
    if sinks in (None, "none") or normaliser == f"sink_{sinks}":
        return normaliser
    require(normaliser == "softmax", "model.sinks", sinks,
            f"none with model.normaliser={normaliser} (sinks join a softmax denominator)")
    return f"sink_{sinks}"


def fold_sinks(values: dict) -> dict:
    """``model`` options (a saved or composed config) with the old ``sinks`` key folded into ``normaliser``."""
    values = dict(values)
    values["normaliser"] = sink_normaliser(values.pop("sinks", None), values.get("normaliser", "softmax"))
    return values


def check_normaliser(config: GPTConfig) -> None:
    """``model.normaliser``: one of NORMALISERS, which a named strict backend must compute (``auto``
    and the fallbacks find one that does: math computes every one)."""
    require(config.normaliser in NORMALISERS, "model.normaliser", config.normaliser,
            "one of " + ", ".join(map(repr, NORMALISERS)))
    backend = BACKENDS.get(config.attention)
    require(backend is None or not backend.strict or NORMALISERS[config.normaliser].refusal(backend) is None,
            "model.attention", config.attention, f"auto or math with model.normaliser={config.normaliser}")


@dataclass
class GPTConfig:
    vocab_size: int
    block_size: int = 256  # training context length L
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # biases in Linear and LayerNorm (GPT-2 had them)
    # Round the embedding table up to a multiple of this: 50257 -> 50304 makes matmuls faster.
    pad_vocab_multiple: int = 1
    # Attention backend (model/attention/): auto or a name of model.attention.BACKENDS.
    attention: str = "auto"
    # Attention temperature (model/temperature.py): none, log_length, logn, llama4 or ssmax, and their options.
    attn_temperature: str = "none"
    attn_temperature_length: int | None = None  # log_length's and logn's L, ssmax's initial-s L; None = block_size
    attn_temperature_floor: int = 8192  # llama4's floor_scale
    attn_temperature_scale: float = 0.1  # llama4's attn_scale
    # The layers log_length, logn and ssmax scale: all, or global (the full-attention ones of window_pattern: SWAN-GPT)
    attn_temperature_layers: str = "all"
    # Block options (docs/design.md, "The block's options"); the defaults are GPT-2's block.
    norm: str = "layernorm"  # layernorm | rmsnorm (never a bias)
    mlp: str = "gelu"  # gelu | swiglu
    qk_norm: bool = False  # RMSNorm of every head of q and k, before the rotation (Qwen 3)
    n_kv_head: int | None = None  # key/value heads: GQA, 1 = MQA; None = n_head
    # Sliding windows (docs/design.md, "Sliding windows"): query i sees keys i-W+1..i; None = full.
    window: int | None = None  # every layer's window
    window_pattern: list[int | None] | None = None  # layer l: window_pattern[l % len]; exclusive with window
    # The attention weights (model/attention/normalisers.py): softmax; softmax with a sink per head
    # (docs/design.md, "Attention sinks"), sink_learned (a logit per head and layer) or sink_zero
    # (off-by-one); or stick_breaking (docs/design.md, "Stick-breaking attention"; math only).
    normaliser: str = "softmax"
    # Operations on each head's attention output (model/output_ops/): a kind, or a list of kinds per
    # layer repeating as window_pattern. Gated attention: none | headwise | elementwise.
    output_gate: str | list[str] = "none"
    xsa: str | list[str] = "none"  # exclusive self-attention: none | plain | gated (modded-nanogpt's)
    # standard | differential: differential attention V2, two query heads per head (model/differential.py)
    attention_kind: str = "standard"
    # The old spelling of the sink normalisers: learned or zero is normaliser=sink_learned|sink_zero.
    sinks: InitVar[str | None] = None

    def __post_init__(self, sinks: str | None = None) -> None:
        self.normaliser = sink_normaliser(sinks, self.normaliser)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "pad_vocab_multiple"):
            require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "a positive integer")
        require(self.n_embd % self.n_head == 0, "model.n_embd", self.n_embd,
                f"divisible by model.n_head={self.n_head}")
        # rotary schemes rotate pairs of head dims
        require(self.head_dim % 2 == 0, "model.n_embd / model.n_head", self.head_dim, "even")
        require(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "in [0, 1)")
        require(self.attention in CHOICES, "model.attention", self.attention,
                "one of " + ", ".join(map(repr, CHOICES)))
        require(self.attn_temperature in TEMPERATURES, "model.attn_temperature",
                self.attn_temperature, "one of " + ", ".join(map(repr, TEMPERATURES)))
        require(self.attn_temperature_length is None or self.attn_temperature_length >= 2,
                "model.attn_temperature_length", self.attn_temperature_length, "null or an integer >= 2 (ln L > 0)")
        require(self.attn_temperature_floor >= 1, "model.attn_temperature_floor", self.attn_temperature_floor,
                "a positive integer")
        require(self.norm in NORMS, "model.norm", self.norm, "one of " + ", ".join(map(repr, NORMS)))
        require(self.mlp in MLPS, "model.mlp", self.mlp, "one of " + ", ".join(map(repr, MLPS)))
        require(self.n_kv_head is None or (self.n_kv_head >= 1 and self.n_head % self.n_kv_head == 0),
                "model.n_kv_head", self.n_kv_head, f"null or a divisor of model.n_head={self.n_head}")
        require(self.attn_temperature_scale >= 0, "model.attn_temperature_scale", self.attn_temperature_scale, ">= 0")
        require(self.attn_temperature not in KEYS_SEEN or self.attn_temperature_length is not None
                or self.block_size >= 2, "model.block_size", self.block_size, f">= 2 with {self.attn_temperature}")
        require(self.attn_temperature_layers in TEMPERATURE_LAYERS, "model.attn_temperature_layers",
                self.attn_temperature_layers, "one of " + ", ".join(map(repr, TEMPERATURE_LAYERS)))
        if self.attn_temperature_layers == "global":
            require(self.attn_temperature in KEYS_SEEN, "model.attn_temperature_layers",
                    self.attn_temperature_layers, f"all with model.attn_temperature={self.attn_temperature} "
                    f"(global picks the layers log_length, logn and ssmax scale)")
            require(self.windowed and not all(w is not None for w in self.layer_windows),
                    "model.attn_temperature_layers", self.attn_temperature_layers,
                    f"all when the layers are not both windowed and full (layer windows "
                    f"{list(self.layer_windows)}: set model.window_pattern with null entries, e.g. [64, 64, 64, null])")
        check_windows(self)
        check_normaliser(self)
        for op in OUTPUTS:
            op.check(self)
        require(self.attention_kind in ATTENTION_KINDS, "model.attention_kind", self.attention_kind,
                "one of " + ", ".join(map(repr, ATTENTION_KINDS)))
        backend = BACKENDS.get(self.attention)  # one that refuses rather than falls back must run the dropout
        require(not (backend is not None and backend.strict and not backend.dropout and self.dropout > 0),
                "model.attention", self.attention,
                f"not {self.attention} when model.dropout > 0 ({self.attention} has no attention dropout)")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full causal attention)."""
        if self.window_pattern:
            return tuple(self.window_pattern[i % len(self.window_pattern)] for i in range(self.n_layer))
        return (self.window,) * self.n_layer

    @property
    def temperature_layers(self) -> tuple[bool, ...]:
        """Whether layer i's queries take the attention temperature (model/temperature.py)."""
        if self.attn_temperature_layers == "global":
            return tuple(w is None for w in self.layer_windows)
        return (self.attn_temperature != "none",) * self.n_layer

    @property
    def windowed(self) -> bool:
        """Whether some layer has a sliding window."""
        return any(w is not None for w in self.layer_windows)

    @property
    def sink(self) -> str | None:
        """The kind of sink logit each layer holds: learned, zero, or None (a normaliser without a sink)."""
        return NORMALISERS[self.normaliser].sink

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def query_heads(self) -> int:
        """Query heads of a layer: n_head, or two per head with differential attention."""
        return QUERIES_PER_HEAD[self.attention_kind] * self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m


# model.sinks read back in its old spelling (none, learned or zero), for readers of the former field
GPTConfig.sinks = property(lambda self: self.sink or "none")  # type: ignore[assignment]
