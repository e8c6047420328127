"""Learned absolute position embeddings (GPT-2): a trainable table added to token embeddings.

``extend=interpolate``: starting a run from another run's weights (``init_from``) with a
table of another size, row p of the new table (n rows) is the old table (m rows) linearly
interpolated at p (m - 1) / (n - 1), so the first and last rows are kept (position
interpolation for an absolute table). Without it a table of another size is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding


class LearnedPositionEmbedding(PositionEncoding, name="learned"):
    def __init__(self, config: GPTConfig, max_positions: int | None = None, extend: str | None = None) -> None:
        super().__init__(config)
        if extend not in (None, "interpolate"):
            raise ValueError(f"pe.extend must be null or 'interpolate', got {extend!r}")
        self.extend = extend
        self.table_size = config.block_size if max_positions is None else max_positions
        if self.table_size < 1:
            raise ValueError(f"pe.max_positions must be a positive integer or null, got {max_positions}")
        self.wpe = nn.Embedding(self.table_size, config.n_embd)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)

    def resized_state(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        table = state.get("wpe.weight")
        if table is None or table.shape[0] == self.table_size:
            return state
        if self.extend is None:
            raise ValueError(f"pe.extend must be 'interpolate' to start a table of {self.table_size} positions from "
                             f"one of {table.shape[0]} (linear interpolation), got None")
        # (1, C, m) -> (1, C, n); align_corners: new row p samples old row p (m - 1) / (n - 1)
        rows = F.interpolate(table.float().t()[None], size=self.table_size, mode="linear", align_corners=True)
        return {**state, "wpe.weight": rows[0].t().to(table.dtype)}

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
