"""Learned absolute position embeddings (GPT-2): a trainable table added to token embeddings."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding


class LearnedPositionEmbedding(PositionEncoding, name="learned"):
    def __init__(self, config: GPTConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.table_size = config.block_size if max_positions is None else max_positions
        if self.table_size < 1:
            raise ValueError(f"pe.max_positions must be a positive integer or null, got {max_positions}")
        self.wpe = nn.Embedding(self.table_size, config.n_embd)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    @property
    def max_positions(self) -> int:
        return self.table_size

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        # nn.Embedding would fail with an opaque index error (or a device assert on CUDA).
        if positions.device.type == "cpu" and not torch.compiler.is_compiling():
            if positions.numel() and int(positions.max()) >= self.table_size:
                raise ValueError(
                    f"learned position embedding has {self.table_size} positions but got position "
                    f"{int(positions.max())}; learned PE cannot extrapolate past its table"
                )
        else:  # no host sync (and no graph break when compiled)
            torch._assert_async(positions.max() < self.table_size, "position beyond the learned PE table")
        return x + self.wpe(positions).to(x.dtype)
