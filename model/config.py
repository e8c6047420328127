"""Typed model configuration (litgpt style): a small dataclass, not a dict."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from pelab.config import check_options, require

ATTENTION_BACKENDS = ("auto", "sdpa", "sdpa_key", "flex", "math")


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
    # Attention backend (model/gpt.py; docs/design.md, section 5): auto | sdpa | sdpa_key | flex | math.
    attention: Literal["auto", "sdpa", "sdpa_key", "flex", "math"] = "auto"

    def __post_init__(self) -> None:
        check_options("model", {f.name: getattr(self, f.name) for f in fields(self)}, GPTConfig)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "pad_vocab_multiple"):
            require(getattr(self, name) >= 1, f"model.{name}", getattr(self, name), "a positive integer")
        require(self.n_embd % self.n_head == 0, "model.n_embd", self.n_embd,
                f"divisible by model.n_head={self.n_head}")
        # rotary schemes rotate pairs of head dims
        require(self.head_dim % 2 == 0, "model.n_embd / model.n_head", self.head_dim, "even")
        require(0.0 <= self.dropout < 1.0, "model.dropout", self.dropout, "in [0, 1)")
        require(self.attention in ATTENTION_BACKENDS, "model.attention", self.attention,
                "one of " + ", ".join(ATTENTION_BACKENDS))
        require(not (self.attention == "flex" and self.dropout > 0), "model.attention", self.attention,
                "not flex when model.dropout > 0 (FlexAttention has no attention dropout)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m
