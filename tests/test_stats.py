"""fedsplice.study.stats: the paired t-test over seeds, TOST, Holm, and their error rates by simulation.

Hand references use Student's t with 2 degrees of freedom (3 seeds), whose distribution has a
closed form: P(|T| > t) = 1 − t / √(t² + 2), and its quantile for tail probability q is
(1 − 2q) / √(2q(1 − q)). With 1 degree of freedom (2 seeds): P(|T| > t) = 1 − (2/π)·atan(t).
"""

import math

import numpy as np
import pytest

from fedsplice.study import stats as S


def p_df2(t: float) -> float:
    return 1 - abs(t) / math.sqrt(t * t + 2)


def q_df2(q: float) -> float:
    p = 1 - q
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


def test_paired_t_against_the_closed_form():
    # d = [1, 2, 3]: mean 2, sd 1, se 1/√3, t = 2√3 = 3.4641
    tt = S.paired_t([1.0, 2.0, 3.0])
    se = 1 / math.sqrt(3)
    assert tt.mean == 2.0 and (tt.n, tt.cells, tt.per_client) == (3, 3, False)
    assert tt.p == pytest.approx(p_df2(2 / se), rel=1e-9) == pytest.approx(0.0741799, abs=1e-7)
    q = q_df2(0.025)
    assert q == pytest.approx(4.302653, abs=1e-6)
    assert (tt.lo, tt.hi) == pytest.approx((2 - q * se, 2 + q * se), rel=1e-9)
    assert tt.lo == pytest.approx(-0.484138, abs=1e-6)


def test_two_seeds_use_one_degree_of_freedom():
    tt = S.paired_t([0.1, 0.15])  # mean .125, sd .0354, se .025, t = 5
    assert tt.p == pytest.approx(1 - 2 / math.pi * math.atan(5), rel=1e-9)


def test_per_client_tables_reduce_to_one_mean_per_seed():
    d = np.array([[0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, -0.1]])  # seed means 0.1 and 0.05
    tt = S.paired_t(d)
    assert tt.per_client and (tt.n, tt.cells) == (2, 8) and tt.mean == pytest.approx(0.075)
    assert tt.p == pytest.approx(1 - 2 / math.pi * math.atan(3), rel=1e-9)  # se .025, t = 3
    ragged = np.array([[0.1, np.nan, 0.3], [np.nan, np.nan, np.nan], [0.2, 0.2, np.nan]])
    x, cells, _ = S.seed_means(ragged)  # a seed with no value is dropped, not a zero
    assert x.tolist() == pytest.approx([0.2, 0.2]) and cells == 4


def test_one_seed_and_constant_differences():
    one = S.paired_t([0.3])
    assert math.isnan(one.p) and math.isnan(one.lo) and S.decide(one.p, 1) == "inconclusive"
    assert "no interval from one seed" in S.describe(one)
    const = S.paired_t([0.5, 0.5, 0.5], deterministic=True)  # bytes: no spread, a sure difference
    assert (const.p, const.lo, const.hi) == (0.0, 0.5, 0.5)
    assert S.paired_t([0.0, 0.0]).p == 1.0  # identical runs
    assert S.paired_t([0.0, 0.0], deterministic=True).p == 1.0


def test_a_constant_accuracy_difference_is_never_p_zero():
    """Accuracy differences are multiples of 1/380: three seeds can each differ by one test item.
    That is no sure difference: the exact sign-flip test gives 2 of the 2^n sign patterns."""
    d = [1 / 380] * 3
    tt = S.paired_t(d)
    assert tt.exact and tt.p == 0.25 and math.isnan(tt.lo) and math.isnan(tt.hi)
    assert S.decide(tt.p, 1) == "inconclusive"
    assert S.paired_t([-1 / 380] * 6).p == pytest.approx(1 / 32)  # 6 seeds: 2/64
    assert S.paired_t([1 / 380] * 7).p == pytest.approx(1 / 64)
    assert "exact sign-flip p = 0.25, 3 seeds" in S.describe(tt)
    # TOST with no spread: each one-sided sign-flip test has p = 1/2^n
    assert S.equivalence([0.01] * 3, 0.05) == 0.125 and S.equivalence([0.1] * 3, 0.05) == 1.0
    # over per-client tables the seed means are what must tie
    assert S.paired_t([[0.1, 0.3], [0.2, 0.2], [0.0, 0.4]]).p == 0.25


def test_equivalence_against_the_closed_form():
    # d = [1, 2, 3], se 1/√3; margin 5: p = max(P(T > 7√3), P(T < −3√3)) = P(T > 3√3) = 0.017549
    se = 1 / math.sqrt(3)
    assert S.equivalence([1.0, 2.0, 3.0], 5.0) == pytest.approx(p_df2(3 / se) / 2, rel=1e-9)
    assert S.equivalence([1.0, 2.0, 3.0], 5.0) == pytest.approx(0.017549, abs=1e-6)
    assert S.equivalence([1.0, 2.0, 3.0], 3.0) == pytest.approx(p_df2(1 / se) / 2, rel=1e-9)  # 0.1127: not shown
    assert S.equivalence([0.01, 0.01], 0.05, deterministic=True) == 0.0
    assert S.equivalence([0.1, 0.1], 0.05, deterministic=True) == 1.0
    with pytest.raises(ValueError, match="margin must be > 0"):
        S.equivalence([0.1, 0.2], 0.0)


def test_holm_by_hand():
    # m = 4 (NaN is outside the family): sorted .005·4 = .02, .01·3 = .03, .03·2 = .06, .04·1 = .04 → .06 (monotone)
    adj = S.holm([0.01, 0.04, 0.03, np.nan, 0.005])
    assert adj[[0, 1, 2, 4]] == pytest.approx([0.03, 0.06, 0.06, 0.02]) and np.isnan(adj[3])
    assert S.holm([0.3, 0.9]).tolist() == [0.6, 0.9]  # capped at 1 only where needed
    assert np.isnan(S.holm([np.nan])).all()
    with pytest.raises(ValueError, match=r"p-values must lie in \[0, 1\]"):
        S.holm([1.5])


@pytest.mark.parametrize("p, sign, want", [(0.01, 1, "held"), (0.01, -1, "did not hold"), (0.05, 1, "inconclusive"),
                                           (math.nan, 1, "inconclusive")])
def test_decide(p, sign, want):
    assert S.decide(p, sign) == want


@pytest.mark.parametrize("d, match", [([], "empty"), ([np.nan, np.nan], "every difference is NaN"),
                                      ([1.0, np.inf], "inf"), (np.zeros((2, 2, 2)), "1-D")])
def test_bad_differences_raise(d, match):
    with pytest.raises(ValueError, match=match):
        S.paired_t(d)


def test_describe():
    tt = S.paired_t(np.array([[0.1, 0.2], [0.3, 0.1], [0.2, 0.2]]))
    assert S.describe(tt).endswith(f"p = {tt.p:.3g}, 3 seeds × 2 clients")
    assert S.describe(tt).startswith(f"Δ {tt.mean:+.4f} [95% CI {tt.lo:+.4f}, {tt.hi:+.4f}]")


# ----------------------------------------------------------------------------- error rates


def _false_rate(draw, n_sims: int, rng) -> float:
    return float(np.mean([S.decide(S.paired_t(draw(rng)).p, 1) != "inconclusive" for _ in range(n_sims)]))


@pytest.mark.parametrize("seeds", [3, 5, 10])
def test_no_effect_is_decided_wrongly_at_most_5_percent(seeds):
    """Under no effect, a decision either way is false: at most 5% (+ 3 Monte-Carlo SEs)."""
    rate = _false_rate(lambda r: r.normal(0.0, 1.0, seeds), 4000, np.random.default_rng(seeds))
    assert rate <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000)
    assert rate >= 0.05 - 3 * math.sqrt(0.05 * 0.95 / 4000)  # exact, not merely conservative


def test_the_replaced_bootstrap_rule_was_wrong_a_quarter_of_the_time():
    # 3 seeds' percentile bootstrap is [min, max]: it excludes 0 whenever all 3 signs agree
    rng = np.random.default_rng(0)
    d = rng.normal(0.0, 1.0, (20000, 3))
    old = np.mean((d.min(1) > 0) | (d.max(1) < 0))
    assert old == pytest.approx(0.25, abs=0.01)


def test_seeds_are_the_clusters_of_client_tables():
    """Clients of one seed share its run (a common seed effect): the seed-means test stays at 5%,
    treating the 50 cells as independent would not."""
    from scipy import stats

    rng = np.random.default_rng(1)
    draw = lambda r: r.normal(0, 1, (5, 1)) + r.normal(0, 1, (5, 10))  # noqa: E731
    assert _false_rate(draw, 3000, rng) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 3000)
    naive = np.mean([stats.ttest_1samp(draw(rng).ravel(), 0.0).pvalue < 0.05 for _ in range(1000)])
    assert naive > 0.3


def test_power_against_an_effect_of_one_seed_sd():
    """10 seeds detect a mean difference of one seed-to-seed SD about 80% of the time (noncentral
    t: 0.803); 3 seeds about 20%: why the page wants more seeds where runs are cheap."""
    rng = np.random.default_rng(2)
    held = lambda n: np.mean([S.decide(S.paired_t(rng.normal(1.0, 1.0, n)).p, 1) == "held" for _ in range(2000)])  # noqa: E731
    assert held(10) == pytest.approx(0.803, abs=0.04)
    assert held(3) < 0.3


def test_equivalence_at_the_margin_is_shown_at_most_5_percent():
    rng = np.random.default_rng(3)
    shown = np.mean([S.equivalence(rng.normal(0.05, 0.02, 10), 0.05) < 0.05 for _ in range(4000)])
    assert shown <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 4000)


def test_holm_keeps_the_family_wise_rate_of_a_page():
    """20 claims, none true, 5 seeds each: one or more false decisions at most 5% of the time."""
    rng = np.random.default_rng(4)
    any_false = [np.nanmin(S.holm([S.paired_t(rng.normal(0, 1, 5)).p for _ in range(20)])) < 0.05
                 for _ in range(1000)]
    assert np.mean(any_false) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / 1000)
