"""ALiBi (Press et al., 2022): logits += -m_h * (i - j); no position embedding."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.config import GPTConfig
from model.pe.base import PositionEncoding, per_head, relative_distance


def alibi_slopes(n_head: int) -> Tensor:
    """Per-head slopes m_h, float32.

    Powers of two: m_h = 2^(-8h/H), h = 1..H. Otherwise take the slopes for the largest
    power of two P < H and append every other slope of the 2P set until there are H.
    """

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * h / n) for h in range(1, n + 1)]

    if n_head < 1:
        raise ValueError(f"ALiBi needs at least one head, got {n_head}")
    p = 2 ** math.floor(math.log2(n_head))
    slopes = geometric(p) + geometric(2 * p)[0::2][: n_head - p]
    return torch.tensor(slopes, dtype=torch.float32)


class SlopeBias:
    """The bias -m_h (i - j) of per-head slopes (``slopes``, an (H,) float32 buffer) in every
    form the backends take, interpolated by a ``linear`` scaling (-m (i - j) / s = -(m / s)(i - j)).
    Mixed into ALiBi and RoPE+ALiBi, ahead of their PositionEncoding base."""

    bias_of_distance = True
    slopes: Tensor

    def scale(self, scaling) -> None:
        super().scale(scaling)
        if scaling.kind == "linear":  # every form of the bias (flex, key-only) reads the slopes
            self.slopes = self.slopes / scaling.factor

    def bias(self, q_positions: Tensor, k_positions: Tensor) -> Tensor:
        slopes, distance = per_head(self.slopes, relative_distance(q_positions, k_positions))
        return -slopes * distance

    def bias_score(self):
        """Elementwise -m_h (i - j) (the flex backend's form of ``bias``)."""
        slopes = self.slopes
        return lambda q, k, head: -slopes[head] * (q - k).float()

    def key_only_slopes(self) -> Tensor:
        return self.slopes


class ALiBi(SlopeBias, PositionEncoding, name="alibi"):
    scaling_kinds = ("linear",)  # distances divided by the factor

    def __init__(self, config: GPTConfig) -> None:
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)
