"""Rotary position embedding (RoFormer, Su et al. 2021).

Pairs (x[k], x[k + r/2]) of the first r = rotary_fraction * head_dim dims of q and k are
rotated by angle p * theta_k, theta_k = base^(-2k/r). This is the half-split
("rotate_half") layout of GPT-NeoX / LLaMA / Hugging Face, not RoFormer's interleaved
pairs; the two are the same function up to a fixed permutation of the head dims.

``set_scaling`` switches on an evaluation-time RoPE scaling (linear interpolation, NTK,
dynamic NTK, YaRN; see model/pe/rope_scaling.py) for every subclass (xPos, RoPE+ALiBi).
It is a plain attribute, not part of the state dict: checkpoints never carry it.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from model.config import GPTConfig
from model.pe.base import PositionEncoding
from model.pe.rope_scaling import RopeFrequencies, RopeScaling, scaled_frequencies


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x pairwise; later dims pass through."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    rotated = (x1 * cos - x2 * sin, x2 * cos + x1 * sin)
    return torch.cat((*rotated, rest), dim=-1) if rest.shape[-1] else torch.cat(rotated, dim=-1)


class RoPE(PositionEncoding, name="rope"):
    supports_rope_scaling: ClassVar[bool] = True

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
        self.scaling: RopeScaling | None = None

    def set_scaling(self, scaling: RopeScaling | None) -> None:
        """Use ``scaling`` from now on (meant for evaluation); None restores plain RoPE exactly."""
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise TypeError(f"set_scaling expects a RopeScaling or None, got {type(scaling).__name__}")
        self.scaling = scaling

    def frequencies(self, *positions: Tensor) -> RopeFrequencies:
        """The call's effective frequencies. Pass every position tensor of the call (q's and
        k's): dynamic NTK takes T from the largest of them, and q and k must share it."""
        if self.scaling is None:
            return RopeFrequencies(self.inv_freq)
        length = torch.stack([p.max() for p in positions]).max() + 1
        return scaled_frequencies(self.scaling, self.inv_freq, length)

    def angles(self, positions: Tensor, freqs: RopeFrequencies | None = None) -> Tensor:
        """(T, rotary_dim/2) float32 angles p * theta_k (with the scaling applied, if set)."""
        if freqs is None:
            freqs = self.frequencies(positions)
        p = positions.float()
        if freqs.position_scale != 1.0:
            p = p * freqs.position_scale
        return p[:, None] * freqs.inv_freq

    def rotate(self, q: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor]:
        freqs = self.frequencies(q_positions, k_positions)
        return self._rotate_one(q, q_positions, freqs), self._rotate_one(k, k_positions, freqs)

    def _rotate_one(self, x: Tensor, positions: Tensor, freqs: RopeFrequencies, scale: Tensor | None = None) -> Tensor:
        angles = self.angles(positions, freqs)
        cos, sin = angles.cos(), angles.sin()
        if freqs.attention_factor != 1.0:  # YaRN: on q and on k, so the logits scale by its square
            scale = freqs.attention_factor if scale is None else scale * freqs.attention_factor
        if scale is not None:  # xPos multiplies both the cos and sin terms
            cos, sin = cos * scale, sin * scale
        return rotate_half(x, cos.to(x.dtype), sin.to(x.dtype))

    def extra_repr(self) -> str:
        extra = f", scaling={self.scaling}" if self.scaling is not None else ""
        return f"{super().extra_repr()}, base={self.base}, rotary_dim={self.rotary_dim}{extra}"
