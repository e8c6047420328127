"""RoPE on q/k plus an ALiBi bias: score = (R_i q).(R_j k)/sqrt(d) - c * m_h (i - j).

``bias_heads`` picks how many heads (the first n) carry the bias; those heads get the
standard ALiBi slope set for n heads, the rest are pure RoPE. ``slope_multiplier`` c
scales every slope. ``pe.scaling.kind=linear`` interpolates both parts (angles of p/s, slopes
m/s); the other kinds scale the rotation only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from model.config import GPTConfig
from model.pe.alibi import alibi_slopes, linear_bias_score
from model.pe.base import per_head, relative_distance
from model.pe.rope import RoPE


class RoPEALiBi(RoPE, name="rope_alibi"):
    bias_of_distance = True
    def __init__(
        self,
        config: GPTConfig,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
        bias_heads: int | None = None,
        slope_multiplier: float = 1.0,
    ) -> None:
        super().__init__(config, base=base, rotary_fraction=rotary_fraction)
        n_biased = config.n_head if bias_heads is None else bias_heads
        if not 1 <= n_biased <= config.n_head:
            raise ValueError(f"pe.bias_heads must be in [1, n_head={config.n_head}] or null, got {bias_heads}")
        slopes = torch.zeros(config.n_head)
        slopes[:n_biased] = alibi_slopes(n_biased) * slope_multiplier
        self.register_buffer("slopes", slopes, persistent=False)
        self.bias_heads, self.slope_multiplier = n_biased, slope_multiplier

    def scale(self, scaling) -> None:
        super().scale(scaling)
        if scaling.kind == "linear":  # position interpolation moves the bias's distances too
            self.slopes = self.slopes / scaling.factor

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        slopes, distance = per_head(self.slopes, relative_distance(q_positions, k_positions))
        return -slopes * distance

    def bias_score(self):
        return linear_bias_score(self.slopes)

    def key_only_slopes(self) -> Tensor:
        return self.slopes

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bias_heads={self.bias_heads}, slope_multiplier={self.slope_multiplier}"
