"""Typed model configuration (litgpt style): a small dataclass, not a dict."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "pad_vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head dim n_embd/n_head = {self.head_dim} must be even (rotary schemes rotate pairs)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        m = self.pad_vocab_multiple
        return (self.vocab_size + m - 1) // m * m
