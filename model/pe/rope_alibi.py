"""RoPE on q/k plus an ALiBi bias: score = (R_i q).(R_j k)/sqrt(d) - c * m_h (i - j).

``bias_heads`` picks how many heads (the first n) carry the bias; those heads get the
standard ALiBi slope set for n heads, the rest are pure RoPE. ``slope_multiplier`` c
scales every slope. A ``linear`` scaling (model/pe/scaling.py) interpolates both parts (angles
of p/s, slopes m/s); the other kinds scale the rotation only.
"""

from __future__ import annotations

import torch

from model.config import GPTConfig
from model.pe.alibi import SlopeBias, alibi_slopes
from model.pe.rope import RoPE


class RoPEALiBi(SlopeBias, RoPE, name="rope_alibi"):
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

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, bias_heads={self.bias_heads}, slope_multiplier={self.slope_multiplier}"
