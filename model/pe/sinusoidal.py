"""Fixed sinusoidal embeddings (Vaswani et al., 2017), added to token embeddings.

PE(p, 2k) = sin(p / 10000^(2k/d_model)),  PE(p, 2k+1) = cos(p / 10000^(2k/d_model)),
times a constant ``scale``. Vaswani et al. multiply the token embeddings by sqrt(d_model)
instead; with nanoGPT's N(0, 0.02) token embeddings an unscaled sinusoid (RMS 0.71 per dim)
drowns the token signal, so ``scale=None`` uses 1/sqrt(d_model), which restores the same
order of magnitude for both. ``scale=1.0`` is the formula exactly as printed.
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
    def __init__(self, config: GPTConfig, base: float = 10000.0, scale: float | None = None) -> None:
        super().__init__(config)
        self.base = base
        self.scale = config.n_embd**-0.5 if scale is None else scale
        if self.scale <= 0:
            raise ValueError(f"pe.scale must be positive or null (1/sqrt(n_embd)), got {scale}")

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        table = sinusoidal_table(positions, self.n_embd, self.base)
        return x + (self.scale * table).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, scale={self.scale:.4g}"
