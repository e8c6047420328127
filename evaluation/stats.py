"""Statistics across seeds (mean with a Student-t confidence interval, Welch's t-test) and of
repeated timings (paired ratios, a distribution-free interval of the median).

- ``mean_ci(values)``: mean, sample standard deviation s (n - 1 in the denominator) and the
  95% interval mean ± t_{0.975, n-1}·s/√n. With one value there is no interval (half-width NaN).
- ``welch_test(a, b)``: Welch's unequal-variance t-test, two-sided, α = 0.05. Reports the
  statistic, the Welch–Satterthwaite degrees of freedom, the p-value and ``significant``
  (p < α). With fewer than two values on either side there is nothing to test: p is NaN and
  ``significant`` False. When both samples have zero variance the statistic is infinite
  (different means: p = 0) or undefined (equal means: p = 1).
- ``median_ci(values)``: the distribution-free interval (coverage at least 95%) of the median,
  two order statistics chosen from the Binomial(n, 1/2) distribution of how many values lie
  below the true median; None below 6 values.
- ``paired_ratios(num, den)``: min(num[i]) / min(den[i]) per block i, for timings paired by
  block (e.g. the bench's rounds), so that slow drifts of a machine's speed cancel.

The t-distribution is computed here (no scipy dependency): the two-sided tail is
P(|T| ≥ t) = I_{ν/(ν+t²)}(ν/2, 1/2), the regularised incomplete beta function, evaluated by
its continued fraction (Numerical Recipes §6.4, modified Lentz), accurate to ~1e-13 for
any real ν > 0; quantiles invert it by bisection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

ALPHA = 0.05
CONFIDENCE = 0.95


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if not (a > 0 and b > 0 and 0 <= x <= 1):
        raise ValueError(f"betainc needs a > 0, b > 0 and 0 <= x <= 1, got a={a}, b={b}, x={x}")
    if x in (0.0, 1.0):
        return float(x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1) / (a + b + 2):  # the fraction converges fast on this side; else use the symmetry
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` (real, > 0) degrees of freedom."""
    if not df > 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 0.0
    return betainc(df / 2, 0.5, df / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (e.g. p=0.975, df=2: 4.302653)."""
    if not 0 < p < 1:
        raise ValueError(f"quantile probability must be in (0, 1), got {p}")
    if p <= 0.5:
        return 0.0 if p == 0.5 else -t_quantile(1 - p, df)
    tail = 2 * (1 - p)  # two-sided tail beyond the quantile
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > tail:
        lo, hi = hi, 2 * hi
    for _ in range(200):  # bisection to float resolution
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > tail else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Summary:
    n: int
    mean: float
    sd: float  # sample standard deviation (n - 1); NaN for n = 1
    half_width: float  # of the confidence interval; NaN for n = 1

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width


def _values(values: Sequence[float], what: str) -> list[float]:
    values = [float(v) for v in values]
    if not values or any(math.isnan(v) for v in values):
        raise ValueError(f"{what} needs at least one value and no NaN, got {values}")
    return values


def mean_ci(values: Sequence[float], confidence: float = CONFIDENCE) -> Summary:
    """Mean ± t_{(1+confidence)/2, n-1}·s/√n over the values (one per seed)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    values = _values(values, "mean_ci")
    n = len(values)
    mean = math.fsum(values) / n
    if n == 1:
        return Summary(1, mean, math.nan, math.nan)
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return Summary(n, mean, sd, t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n))


@dataclass(frozen=True)
class WelchResult:
    t: float
    df: float
    p: float  # two-sided
    significant: bool  # p < alpha


def welch_test(a: Sequence[float], b: Sequence[float], alpha: float = ALPHA) -> WelchResult:
    """Welch's two-sided t-test of equal means (unequal variances); see the module docstring for
    the degenerate cases."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    a, b = _values(a, "welch_test (first sample)"), _values(b, "welch_test (second sample)")
    if len(a) < 2 or len(b) < 2:
        return WelchResult(math.nan, math.nan, math.nan, False)
    sa, sb = mean_ci(a), mean_ci(b)
    va, vb = sa.sd ** 2 / sa.n, sb.sd ** 2 / sb.n  # squared standard errors
    diff = sa.mean - sb.mean
    if va + vb == 0:
        p = 1.0 if diff == 0 else 0.0
        return WelchResult(0.0 if diff == 0 else math.copysign(math.inf, diff), math.nan, p, p < alpha)
    t = diff / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va ** 2 / (sa.n - 1) + vb ** 2 / (sb.n - 1))
    p = t_two_sided_p(t, df)
    return WelchResult(t, df, p, p < alpha)


def median_ci(values: Sequence[float], alpha: float = ALPHA) -> tuple[float, float] | None:
    """Distribution-free interval of the median with coverage >= 1 - alpha: the order statistics
    x_(k), x_(n+1-k) with k the largest such that P(Binomial(n, 1/2) < k) <= alpha/2 (e.g.
    Conover, Practical Nonparametric Statistics, table A3). None when no k exists (n < 6 at 95%)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    xs = sorted(_values(values, "median_ci"))
    n = len(xs)
    tail, k = 0.0, 0  # tail = P(Binomial(n, 1/2) <= k - 1)
    while tail + math.comb(n, k) / 2**n <= alpha / 2:
        tail += math.comb(n, k) / 2**n
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


def paired_ratios(num: Sequence[Sequence[float]], den: Sequence[Sequence[float]]) -> list[float]:
    """min(num[i]) / min(den[i]) for each block i. Each block's minimum drops what other load on
    a machine adds to a timing; pairing by block cancels drifts slower than a block."""
    return [min(a) / min(b) for a, b in zip(num, den, strict=True)]
