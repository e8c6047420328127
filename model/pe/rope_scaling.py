"""RoPE scaling at evaluation time: run a RoPE model past its training context, no retraining.

Every method maps the unscaled pair frequencies theta_k = base^(-2k/d) (``inv_freq``,
k = 0 .. d/2-1, d = rotary dim) and a scale s = ``factor`` to a ``RopeFrequencies``:
angle = (p * position_scale) * theta'_k, and cos and sin are both multiplied by
attention_factor (for q and for k, so the logits scale by its square). L = original_length.

- ``linear`` (position interpolation, Chen et al. 2023): angle (p / s) * theta_k.
- ``ntk`` (NTK-aware base change): base' = base * s^(d/(d-2)), i.e.
  theta'_k = theta_k * s^(-2k/(d-2)): pair 0 (highest frequency) is unchanged, the last
  (lowest frequency) pair is divided by exactly s.
- ``dynamic_ntk``: ``ntk`` with s = max(1, factor * T/L - (factor - 1)), T = largest
  position of the call + 1 (Hugging Face's formula). Exactly plain RoPE while T <= L.
- ``yarn`` (Peng et al. 2023): pair k turns r_k = L / (2 pi / theta_k) times over the
  training context. gamma = clamp((r - beta_slow) / (beta_fast - beta_slow), 0, 1);
  theta'_k = (1 - gamma) theta_k / s + gamma theta_k, so pairs with r < beta_slow are
  interpolated, pairs with r > beta_fast kept; attention factor 0.1 ln(s) + 1.
  The ramp here is the paper's: continuous and linear in r. Hugging Face's implementation
  ramps linearly in the pair index k instead (linear in log r), between the indices where
  r = beta_fast and r = beta_slow rounded with floor / ceil, so pairs inside the ramp
  differ slightly from this one; the pairs outside it are the same.

Everything is computed in float64 from the float32 ``inv_freq`` and returned in float32.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

ROPE_SCALINGS: tuple[str, ...] = ("linear", "ntk", "dynamic_ntk", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """An evaluation-time RoPE scaling: ``kind`` (one of ROPE_SCALINGS), scale ``factor``
    (>= 1; 1 is the identity for every kind), the training context ``original_length`` L,
    and YaRN's ramp bounds in rotations over L (``beta_slow`` < ``beta_fast``)."""

    kind: str
    factor: float
    original_length: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise ValueError(f"rope scaling kind must be one of {', '.join(ROPE_SCALINGS)}; got {self.kind!r}")
        if not _real(self.factor) or not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"rope scaling factor must be a finite number >= 1 (1 = no scaling); got {self.factor!r}")
        if not isinstance(self.original_length, numbers.Integral) or isinstance(self.original_length, bool) \
                or self.original_length < 1:
            raise ValueError(
                f"rope scaling original_length (the training context) must be an integer >= 1; "
                f"got {self.original_length!r}"
            )
        if not (_real(self.beta_fast) and _real(self.beta_slow) and 0 <= self.beta_slow < self.beta_fast):
            raise ValueError(
                f"rope scaling needs 0 <= beta_slow < beta_fast; got beta_slow={self.beta_slow!r}, "
                f"beta_fast={self.beta_fast!r}"
            )


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


class RopeFrequencies(NamedTuple):
    """What one call rotates with: angle = (p * position_scale) * inv_freq[k]; cos and sin
    are multiplied by attention_factor."""

    inv_freq: Tensor  # (rotary_dim/2,) float32
    position_scale: float = 1.0
    attention_factor: float = 1.0


def ntk_inv_freq(inv_freq: Tensor, scale: float | Tensor) -> Tensor:
    """theta_k * scale^(-2k/(d-2)): the frequencies of base * scale^(d/(d-2))."""
    d = 2 * inv_freq.numel()
    k = torch.arange(inv_freq.numel(), dtype=torch.float64, device=inv_freq.device)
    exponent = 2 * k / max(d - 2, 1)  # d = 2: the single pair has theta = 1 whatever the base
    return (inv_freq.double() * scale ** -exponent).float()


def _linear(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    return RopeFrequencies(inv_freq, position_scale=1.0 / s.factor)


def _ntk(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    return RopeFrequencies(ntk_inv_freq(inv_freq, float(s.factor)))


def _dynamic_ntk(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    T = torch.as_tensor(length, device=inv_freq.device).double()  # a tensor: no host sync on GPU
    scale = (s.factor * T / s.original_length - (s.factor - 1)).clamp(min=1.0)
    return RopeFrequencies(ntk_inv_freq(inv_freq, scale))


def _yarn(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    theta = inv_freq.double()
    rotations = s.original_length * theta / (2 * math.pi)  # r_k = L / wavelength_k
    gamma = ((rotations - s.beta_slow) / (s.beta_fast - s.beta_slow)).clamp(0.0, 1.0)
    theta = (1 - gamma) * theta / s.factor + gamma * theta
    return RopeFrequencies(theta.float(), attention_factor=0.1 * math.log(s.factor) + 1.0)


_METHODS: dict[str, Callable[[RopeScaling, Tensor, Tensor | int], RopeFrequencies]] = {
    "linear": _linear,
    "ntk": _ntk,
    "dynamic_ntk": _dynamic_ntk,
    "yarn": _yarn,
}


def default_factor(kind: str, eval_length: int, train_length: int) -> float:
    """The factor an evaluation at ``eval_length`` uses unless one is given: the length
    ratio for static methods; 1 for ``dynamic_ntk``, which takes its scale from T itself
    (a factor > 1 there would scale twice)."""
    if kind == "dynamic_ntk":
        return 1.0
    return max(1.0, eval_length / train_length)


def scaled_frequencies(scaling: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    """Effective frequencies for one call from the unscaled float32 ``inv_freq``.

    ``length`` is T = the largest position in the call + 1 (an integer or a 0-d integer
    tensor); only ``dynamic_ntk`` uses it.
    """
    return _METHODS[scaling.kind](scaling, inv_freq, length)
