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
  with published YaRN results. ``attention_factor`` replaces 0.1 ln(s) + 1 (Hugging Face's
  ``attention_factor`` key).
- ``llama3`` (Meta's ``apply_scaling`` for Llama 3.1, Hugging Face's
  ``_compute_llama3_parameters``): wavelength w_k = 2 pi / theta_k; w_k < L / high_freq_factor:
  kept; w_k > L / low_freq_factor: divided by s; in between
  smooth = (L / w_k - low_freq_factor) / (high_freq_factor - low_freq_factor) and
  theta'_k = (1 - smooth) theta_k / s + smooth theta_k. No attention factor.
- ``longrope`` (LongRoPE, Ding et al. 2024, as Hugging Face's ``_compute_longrope_parameters``
  and its per-call update): theta'_k = theta_k / e_k with e = ``long_factor`` when
  T = largest position + 1 exceeds L, else ``short_factor`` (one factor per rotary pair);
  attention factor sqrt(1 + ln(s) / ln(L)) for s > 1 (1 for s = 1) unless
  ``attention_factor`` is given. ``factor`` s only sets that default (Hugging Face derives s
  from max / original length).

Everything is computed in float64 from the float32 ``inv_freq`` and returned in float32.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
from torch import Tensor

# the kinds an evaluation can switch on by name (longrope needs its factor lists: training only)
ROPE_SCALINGS: tuple[str, ...] = ("linear", "ntk", "dynamic_ntk", "yarn", "llama3")
SCALING_KINDS: tuple[str, ...] = (*ROPE_SCALINGS, "longrope")
# the options each kind reads beside factor and original_length (any other must stay at its default)
KIND_OPTIONS: dict[str, tuple[str, ...]] = {
    "linear": (), "ntk": (), "dynamic_ntk": (),
    "yarn": ("beta_fast", "beta_slow", "truncate", "attention_factor"),
    "llama3": ("low_freq_factor", "high_freq_factor"),
    "longrope": ("short_factor", "long_factor", "attention_factor"),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling: ``kind`` (one of SCALING_KINDS), scale ``factor`` (>= 1; 1 is the
    identity for every kind but longrope), the training context ``original_length`` L, YaRN's
    ramp bounds in rotations over L (0 < ``beta_slow`` < ``beta_fast``) and whether its
    correction dims are rounded outwards to integers (``truncate``), an ``attention_factor``
    replacing YaRN's / LongRoPE's default (None: the method's), Llama 3's wavelength bands
    (0 < ``low_freq_factor`` < ``high_freq_factor``) and LongRoPE's per-pair factor lists."""

    kind: str
    factor: float
    original_length: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCALING_KINDS:
            raise ValueError(f"rope scaling kind must be one of {', '.join(SCALING_KINDS)}; got {self.kind!r}")
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
        if self.attention_factor is not None and not (_real(self.attention_factor) and self.attention_factor > 0
                                                      and math.isfinite(self.attention_factor)):
            raise ValueError(f"rope scaling attention_factor must be null or a finite number > 0; "
                             f"got {self.attention_factor!r}")
        if not (_real(self.low_freq_factor) and _real(self.high_freq_factor)
                and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(  # equal factors would divide by zero in llama3's smooth band
                f"rope scaling needs 0 < low_freq_factor < high_freq_factor; got low_freq_factor="
                f"{self.low_freq_factor!r}, high_freq_factor={self.high_freq_factor!r}")
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, bytes)) or not all(_real(v) and v > 0 and math.isfinite(v) for v in value):
                    raise ValueError(f"rope scaling {name} must be a list of finite numbers > 0; got {value!r}")
                object.__setattr__(self, name, tuple(float(v) for v in value))  # hashable, frozen
        if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError(f"rope scaling kind longrope needs short_factor and long_factor (one factor per "
                             f"rotary pair); got short_factor={self.short_factor!r}, long_factor={self.long_factor!r}")
        if self.kind == "longrope" and self.original_length < 2:  # its attention factor divides by ln L
            raise ValueError(f"rope scaling longrope needs original_length >= 2; got {self.original_length!r}")


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
    factor = 0.1 * math.log(s.factor) + 1.0 if s.attention_factor is None else s.attention_factor
    return RopeFrequencies(theta.float(), attention_factor=factor)


def _llama3(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    theta = inv_freq.double()
    wavelength = 2 * math.pi / theta
    L = s.original_length
    smooth = ((L / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).clamp(0.0, 1.0)
    # smooth is 1 for w < L / high (kept) and 0 for w > L / low (divided by s), as the reference's branches
    theta = (1 - smooth) * theta / s.factor + smooth * theta
    return RopeFrequencies(theta.float())


def _longrope(s: RopeScaling, inv_freq: Tensor, length: Tensor | int) -> RopeFrequencies:
    if len(s.short_factor) != inv_freq.numel() or len(s.long_factor) != inv_freq.numel():
        raise ValueError(f"rope scaling short_factor and long_factor must be lists of {inv_freq.numel()} factors "
                         f"(one per rotary pair, rotary dim {2 * inv_freq.numel()}); got {len(s.short_factor)} "
                         f"and {len(s.long_factor)}")
    device = inv_freq.device
    short = torch.tensor(s.short_factor, dtype=torch.float64, device=device)
    long = torch.tensor(s.long_factor, dtype=torch.float64, device=device)
    T = torch.as_tensor(length, device=device)  # a tensor: no host sync on GPU
    theta = inv_freq.double() / torch.where(T > s.original_length, long, short)
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.factor <= 1.0:
        factor = 1.0
    else:
        factor = math.sqrt(1 + math.log(s.factor) / math.log(s.original_length))
    return RopeFrequencies(theta.float(), attention_factor=factor)


_METHODS: dict[str, Callable[[RopeScaling, Tensor, Tensor | int], RopeFrequencies]] = {
    "linear": _linear,
    "ntk": _ntk,
    "dynamic_ntk": _dynamic_ntk,
    "yarn": _yarn,
    "llama3": _llama3,
    "longrope": _longrope,
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
    tensor); ``dynamic_ntk`` and ``longrope`` use it.
    """
    return _METHODS[scaling.kind](scaling, inv_freq, length)
