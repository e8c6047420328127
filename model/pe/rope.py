"""Rotary position embedding (RoFormer, Su et al. 2021).

Pairs (x[k], x[k + r/2]) of the first r = rotary_fraction * head_dim dims of q and k are
rotated by angle p * theta_k, theta_k = base^(-2k/r). This is the half-split
("rotate_half") layout of GPT-NeoX / LLaMA / Hugging Face, not RoFormer's interleaved
pairs; the two are the same function up to a fixed permutation of the head dims.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.config import GPTConfig
from model.pe.base import PositionEncoding


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x pairwise; later dims pass through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat((*rotated, rest), dim=-1) if rest.shape[-1] else torch.cat(rotated, dim=-1)


class RoPE(PositionEncoding, name="rope"):
    def __init__(self, config: GPTConfig, base: float = 10000.0, rotary_fraction: float = 1.0) -> None:
        super().__init__(config)
        if not 0.0 < rotary_fraction <= 1.0:
            raise ValueError(f"pe.rotary_fraction must be in (0, 1], got {rotary_fraction}")
        if base <= 1.0:
            raise ValueError(f"pe.base must be > 1, got {base}")
        self.rotary_dim = int(config.head_dim * rotary_fraction) // 2 * 2
        if self.rotary_dim < 2:
            raise ValueError(
                f"pe.rotary_fraction={rotary_fraction} of head_dim={config.head_dim} leaves no pair to rotate"
            )
        self.base = base
        k2 = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64)
        self.register_buffer("inv_freq", (base ** (-k2 / self.rotary_dim)).float(), persistent=False)

    def angles(self, positions: Tensor) -> Tensor:
        """(T, rotary_dim/2) float32 angles p * theta_k."""
        return positions.float()[:, None] * self.inv_freq

    def rotate(self, q: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor]:
        return self._rotate_one(q, q_positions), self._rotate_one(k, k_positions)

    def _rotate_one(self, x: Tensor, positions: Tensor, scale: Tensor | None = None) -> Tensor:
        angles = self.angles(positions)
        cos, sin = angles.cos(), angles.sin()
        if scale is not None:  # xPos multiplies both the cos and sin terms
            cos, sin = cos * scale, sin * scale
        return rotate_half(x, cos.to(x.dtype), sin.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, rotary_dim={self.rotary_dim}"
