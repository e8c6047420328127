"""Fixed sinusoidal embeddings (Vaswani et al., 2017), added to token embeddings.

PE(p, 2k) = sin(p / 10000^(2k/d_model)),  PE(p, 2k+1) = cos(p / 10000^(2k/d_model)).
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.config import GPTConfig
from model.pe.base import PositionEncoding


def sinusoidal_table(positions: Tensor, d_model: int, base: float = 10000.0) -> Tensor:
    """(..., d_model) float32 table for integer positions, sin on even dims and cos on odd."""
    k2 = torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32)
    inv_freq = base ** (-k2 / d_model)
    angles = positions.float()[..., None] * inv_freq
    table = torch.stack((angles.sin(), angles.cos()), dim=-1)  # interleave sin/cos
    return table.flatten(-2)


class SinusoidalPositionEmbedding(PositionEncoding, name="sinusoidal"):
    def __init__(self, config: GPTConfig, base: float = 10000.0, scale: float = 1.0) -> None:
        super().__init__(config)
        self.base = base
        self.scale = scale  # exact formula at 1.0; exposed because token embeddings start at std 0.02

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        table = sinusoidal_table(positions, self.n_embd, self.base)
        return x + (self.scale * table).to(x.dtype)
