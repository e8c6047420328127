"""evaluation/stats.py against textbook t-table and order-statistic values, closed forms and
hand-computed cases."""

import math

import pytest

from evaluation.stats import betainc, mean_ci, median_ci, paired_ratios, t_quantile, t_two_sided_p, welch_test

# Two-sided 95% critical values t_{0.975, df}, typed from a printed Student-t table.
T_TABLE_975 = {1: 12.706205, 2: 4.302653, 3: 3.182446, 4: 2.776445, 5: 2.570582, 9: 2.262157, 10: 2.228139,
               30: 2.042272}


@pytest.mark.parametrize("df,value", sorted(T_TABLE_975.items()))
def test_t_quantile_matches_the_table(df, value):
    assert t_quantile(0.975, df) == pytest.approx(value, abs=2e-6)
    assert t_quantile(0.025, df) == pytest.approx(-value, abs=2e-6)  # symmetric
    assert t_two_sided_p(value, df) == pytest.approx(0.05, abs=1e-6)  # the inverse


def test_t_quantile_tends_to_the_normal():
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959964, abs=1e-5)  # z_{0.975}
    assert t_quantile(0.995, 1e7) == pytest.approx(2.575829, abs=1e-5)  # z_{0.995}
    assert t_quantile(0.5, 3) == 0.0


@pytest.mark.parametrize("t", [0.0, 0.1, 0.7, 1.0, 2.5, 10.0, 300.0])
def test_two_sided_p_closed_forms(t):
    # df = 1 (Cauchy): P(|T| >= t) = 1 - (2/pi) atan(t); df = 2: 1 - t / sqrt(2 + t^2)
    assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), rel=1e-12, abs=1e-15)
    assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-12, abs=1e-15)
    assert t_two_sided_p(-t, 2) == t_two_sided_p(t, 2)


def test_betainc_closed_forms():
    # I_x(1, 1) = x; I_x(a, 1) = x^a; I_x(1, b) = 1 - (1 - x)^b; I_{1/2}(a, a) = 1/2
    assert betainc(1, 1, 0.3) == pytest.approx(0.3, rel=1e-13)
    assert betainc(2.5, 1, 0.6) == pytest.approx(0.6 ** 2.5, rel=1e-13)
    assert betainc(1, 3.5, 0.2) == pytest.approx(1 - 0.8 ** 3.5, rel=1e-13)
    assert betainc(7.3, 7.3, 0.5) == pytest.approx(0.5, rel=1e-13)
    assert (betainc(2, 3, 0.0), betainc(2, 3, 1.0)) == (0.0, 1.0)
    with pytest.raises(ValueError, match=r"a > 0, b > 0 and 0 <= x <= 1, got a=2, b=3, x=1.5"):
        betainc(2, 3, 1.5)


def test_mean_ci_hand_computed():
    # [1, 2, 3]: mean 2, s = 1, half-width t_{0.975,2} * 1/sqrt(3) = 4.302653 * 0.577350 = 2.48414
    s = mean_ci([1, 2, 3])
    assert (s.n, s.mean, s.sd) == (3, 2.0, 1.0)
    assert s.half_width == pytest.approx(2.48414, abs=1e-5)
    assert (s.low, s.high) == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-5)
    # [4.88, 4.91, 4.85, 4.90]: mean 4.885, deviations -.005 .025 -.035 .015, sum of squares
    # 0.0021, s^2 = 0.0007, s = 0.0264575; half-width t_{0.975,3} s/2 = 3.182446 * 0.0132288 = 0.0420998
    s = mean_ci([4.88, 4.91, 4.85, 4.90])
    assert s.mean == pytest.approx(4.885) and s.sd == pytest.approx(0.0264575, abs=1e-7)
    assert s.half_width == pytest.approx(0.0420998, abs=1e-6)
    # 90%: t_{0.95,2} = 2.919986 (table) -> 2.919986 / sqrt(3) = 1.685854
    assert mean_ci([1, 2, 3], confidence=0.9).half_width == pytest.approx(1.685854, abs=1e-5)


def test_mean_ci_one_seed_has_no_interval_and_bad_input_is_named():
    s = mean_ci([5.0])
    assert s.mean == 5.0 and math.isnan(s.sd) and math.isnan(s.half_width)
    assert mean_ci([2.0, 2.0, 2.0]).half_width == 0.0
    with pytest.raises(ValueError, match=r"at least one value and no NaN, got \[\]"):
        mean_ci([])
    with pytest.raises(ValueError, match=r"no NaN, got \[1.0, nan\]"):
        mean_ci([1.0, math.nan])
    with pytest.raises(ValueError, match=r"confidence must be in \(0, 1\), got 95"):
        mean_ci([1, 2], confidence=95)


def test_welch_hand_computed():
    # a = [1, 2, 3]: mean 2, s^2 = 1; b = [4, 5, 6, 7, 8]: mean 6, s^2 = 10/4 = 2.5.
    # Squared standard errors 1/3 and 2.5/5 = 1/2, sum 5/6: t = (2 - 6)/sqrt(5/6) = -4.381780.
    # df = (5/6)^2 / ((1/3)^2/2 + (1/2)^2/4) = (25/36) / (17/144) = 100/17 = 5.882353.
    # p = P(|T_{100/17}| >= 4.381780) = 0.0048826 (typed from scipy.stats.ttest_ind(equal_var=False)).
    r = welch_test([1, 2, 3], [4, 5, 6, 7, 8])
    assert r.t == pytest.approx(-4.381780, abs=1e-6)
    assert r.df == pytest.approx(100 / 17, rel=1e-12)
    assert r.p == pytest.approx(0.0048826, abs=1e-7)
    assert r.significant
    back = welch_test([4, 5, 6, 7, 8], [1, 2, 3])
    assert (back.t, back.p) == pytest.approx((4.381780, r.p), abs=1e-6)


def test_welch_not_significant_and_degenerate_cases():
    # [1, 2, 3] vs [2, 3, 4]: t = -1/sqrt(2/3) = -1.224745, df = (2/3)^2/(2 (1/3)^2/2) = 4;
    # below t_{0.975,4} = 2.776 so not significant; p = 0.2878 (df 4, two-sided)
    r = welch_test([1, 2, 3], [2, 3, 4])
    assert r.t == pytest.approx(-1.224745, abs=1e-6) and r.df == pytest.approx(4.0)
    assert r.p == pytest.approx(0.28786, abs=1e-5) and not r.significant
    one = welch_test([1.0], [2.0, 3.0])  # one seed: nothing to test
    assert math.isnan(one.p) and not one.significant
    assert welch_test([1, 1], [2, 2]).p == 0.0 and welch_test([1, 1], [2, 2]).significant
    assert welch_test([1, 1], [1, 1]).p == 1.0 and not welch_test([1, 1], [1, 1]).significant
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\), got 5"):
        welch_test([1, 2], [3, 4], alpha=5)


def test_against_scipy_when_installed():
    stats = pytest.importorskip("scipy.stats")
    for df in (0.7, 1.5, 3, 7.25, 40, 250):
        assert t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-10)
        for t in (0.3, 1.7, 4.0):
            assert t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-9)
    a, b = [0.61, 0.72, 0.55, 0.68], [0.41, 0.52, 0.47]
    ref = stats.ttest_ind(a, b, equal_var=False)
    r = welch_test(a, b)
    assert (r.t, r.p) == pytest.approx((ref.statistic, ref.pvalue), rel=1e-9)


def test_median_interval_is_the_textbook_order_statistics():
    """Distribution-free 95% interval of a median (e.g. Conover, Practical Nonparametric
    Statistics, table A3): n = 10 -> (x_(2), x_(9)); n = 20 -> (x_(6), x_(15)); n = 6 -> (x_(1), x_(6))."""
    values = [float(v) for v in range(100, 0, -1)]  # unsorted input: descending
    assert median_ci(values[-10:]) == (2.0, 9.0)
    assert median_ci(values[-20:]) == (6.0, 15.0)
    assert median_ci(values[-6:]) == (1.0, 6.0)
    assert median_ci(values[-5:]) is None
    # 80%: P(Binomial(10, 1/2) <= 2) = 56/1024 = 0.0547 <= 0.1 < P(<= 3) = 176/1024 -> (x_(3), x_(8))
    assert median_ci(values[-10:], alpha=0.2) == (3.0, 8.0)


def _coverage(n: int, lo: int, hi: int) -> float:
    """P(x_(lo) <= median < x_(hi)) = P(lo <= Binomial(n, 1/2) <= hi - 1), summed in float64."""
    return sum(math.comb(n, j) * 0.5**n for j in range(lo, hi))


def test_median_interval_coverage():
    # n = 10: 1 - 2 (1 + 10) / 1024 = 0.978515625; n = 20: 1 - 2 * 21700 / 2^20 = 0.958611
    assert _coverage(10, 2, 9) == pytest.approx(0.978515625, abs=1e-15)
    assert _coverage(20, 6, 15) == pytest.approx(0.958611, abs=1e-6)
    for n in range(6, 61):
        lo, hi = median_ci([float(v) for v in range(1, n + 1)])
        assert hi == n + 1 - lo  # symmetric ranks
        assert _coverage(n, int(lo), int(hi)) >= 0.95, n
        assert _coverage(n, int(lo) + 1, int(hi) - 1) < 0.95, n  # the next narrower one falls short


def test_median_interval_bad_input_is_named():
    with pytest.raises(ValueError, match=r"at least one value and no NaN, got \[\]"):
        median_ci([])
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\), got 5"):
        median_ci([1, 2, 3, 4, 5, 6], alpha=5)


def test_paired_ratios_divide_each_blocks_minima():
    assert paired_ratios([[2.0, 3.0], [4.0, 1.0]], [[1.0, 5.0], [2.0, 2.0]]) == [2.0, 0.5]
    with pytest.raises(ValueError):  # unpaired blocks
        paired_ratios([[1.0], [2.0]], [[1.0]])
