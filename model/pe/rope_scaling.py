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
- ``yarn`` (Peng et al. 2023), as in the code behind the paper's numbers (jquesnelle/yarn)
  and Hugging Face's ``_compute_yarn_parameters``: corr(r) = d ln(L / (2 pi r)) / (2 ln base)
  is the fractional pair index whose pair turns r times over L;
  low = max(floor(corr(beta_fast)), 0), high = min(ceil(corr(beta_slow)), d - 1) (high +=
  0.001 if they are equal); ramp_k = clamp((k - low) / (high - low), 0, 1);
  theta'_k = ramp_k theta_k / s + (1 - ramp_k) theta_k; attention factor 0.1 ln(s) + 1.
  ``truncate=False`` (Hugging Face's option) skips the floor / ceil.
  The paper's text ramps linearly in the rotations r instead, with no rounding:
  gamma = clamp((r - beta_slow) / (beta_fast - beta_slow), 0, 1) is the share of theta kept.
  Both keep pairs with r > beta_fast and divide those with r < beta_slow by s, but inside
  the ramp they differ a lot (d = 64, L = 256: the pair at r = 4.07 keeps 5/13 = 0.38 of
  theta in the code, 0.10 by the text). pelab follows the code, so its numbers compare
  with published YaRN results.

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
    and YaRN's ramp bounds in rotations over L (0 < ``beta_slow`` < ``beta_fast``) and whether
    its correction dims are rounded outwards to integers (``truncate``)."""

    kind: str
    factor: float
    original_length: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

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
        if not (_real(self.beta_fast) and _real(self.beta_slow) and 0 < self.beta_slow < self.beta_fast):
            raise ValueError(  # beta_slow = 0 would put YaRN's correction dim at infinity
                f"rope scaling needs 0 < beta_slow < beta_fast; got beta_slow={self.beta_slow!r}, "
                f"beta_fast={self.beta_fast!r}"
            )
        if not isinstance(self.truncate, bool):
            raise ValueError(f"rope scaling truncate must be True or False; got {self.truncate!r}")


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


def _yarn_ramp(s: RopeScaling, inv_freq: Tensor) -> Tensor:
    """ramp_k: the share of pair k that is interpolated (divided by s)."""
    n, d = inv_freq.numel(), 2 * inv_freq.numel()
    k = torch.arange(n, dtype=torch.float64, device=inv_freq.device)
    if n == 1:  # low >= 0, so pair 0 is always kept (and theta_0 = 1 says nothing of the base)
        return torch.zeros_like(k)
    # Only inv_freq is passed in, so ln(base) comes from the lowest frequency
    # theta_{n-1} = base^(-(d-2)/d) (float32 rounding: < 1e-8 relative in corr for base 10000).
    # Tensor ops throughout: no host sync on GPU.
    log_base = -inv_freq[-1].double().log() * d / (d - 2)

    def corr(rotations: float) -> Tensor:
        return d * math.log(s.original_length / (2 * math.pi * rotations)) / (2 * log_base)

    low, high = corr(s.beta_fast), corr(s.beta_slow)
    if s.truncate:
        low, high = low.floor(), high.ceil()
    low, high = low.clamp(min=0), high.clamp(max=d - 1)  # d - 1, not n - 1: as the reference
    high = torch.where(low == high, high + 0.001, high)
    return ((k - low) / (high - low)).clamp(0.0, 1.0)


def _yarn(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    theta = inv_freq.double()
    ramp = _yarn_ramp(s, inv_freq)
    theta = ramp * theta / s.factor + (1 - ramp) * theta
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
