"""xPos (Sun et al., 2023): RoPE whose pair k also decays with distance.

zeta_k = (2k/r + gamma) / (1 + gamma). The query at position n is multiplied by
zeta^(n/B) and the key at m by zeta^(-m/B) on both the cos and sin terms, so q.k
carries zeta^((n-m)/B). Exponents use positions centred on the midpoint c of the
attention span (all key positions; when generating, the whole generation), so c cancels
in q.k, the float32 powers stay small, and keys in a KV cache keep one reference point.
Meant for causal attention only: for m > n the key factor grows instead of decaying.
The factorised powers stay finite in float32 while (window span / 2) / B < ~70, i.e. for
windows up to ~70k tokens at B = 512.
A RoPE scaling (``scale``, ``scaled``) changes the rotation angles (and YaRN's attention factor)
only; the zeta decay is unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.config import GPTConfig
from model.pe.rope import RoPE, RotaryTables
from model.pe.schedule import LayerRope


class XPos(RoPE, name="xpos"):
    def __init__(
        self,
        config: GPTConfig,
        base: float = 10000.0,
        gamma: float = 0.4,
        scale_base: float = 512.0,
        rotary_fraction: float = 1.0,
    ) -> None:
        super().__init__(config, base=base, rotary_fraction=rotary_fraction)
        if gamma <= 0 or scale_base <= 0:
            raise ValueError(f"pe.gamma and pe.scale_base must be positive, got {gamma}, {scale_base}")
        self.gamma, self.scale_base = gamma, scale_base
        k2 = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32)
        self.register_buffer("zeta", (k2 / self.rotary_dim + gamma) / (1 + gamma), persistent=False)

    def decay(self, positions: Tensor, center: Tensor, sign: float) -> Tensor:
        """(..., T, rotary_dim/2) float32 factors zeta^(sign * (p - c) / B)."""
        exponent = sign * (positions - center).float()[..., None] / self.scale_base
        return self.zeta ** exponent

    def rotation_tables(self, positions: Tensor, span: Tensor, layer: LayerRope | None = None) -> RotaryTables:
        center = (span.min() + span.max()) // 2  # fixed by the span: a KV cache keeps its keys valid
        freqs = self.frequencies(span, layer=layer)  # RoPE scaling (if set) moves the angles only
        q_cos, q_sin = self._cos_sin(positions, freqs, self.decay(positions, center, +1.0))
        k_cos, k_sin = self._cos_sin(positions, freqs, self.decay(positions, center, -1.0))
        return RotaryTables(q_cos, q_sin, k_cos, k_sin)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gamma={self.gamma}, scale_base={self.scale_base}"
