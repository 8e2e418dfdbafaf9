"""fedsplice.app.stats: paired (cluster) bootstrap intervals, their exact enumeration, verdicts."""

import numpy as np
import pytest

from fedsplice.app import stats as S
from fedsplice.app.stats import Interval, decide, describe, exact_bootstrap_1d, paired_bootstrap

# The bootstrap distribution of the mean of d = [1, 2, 3], by hand: the 10 distinct resampled
# multisets of size 3, each with its count among the 3^3 = 27 ordered resamples (3! / Π c_i!).
HAND = [
    ((1, 1, 1), 1, 3 / 3), ((2, 2, 2), 1, 6 / 3), ((3, 3, 3), 1, 9 / 3),
    ((1, 1, 2), 3, 4 / 3), ((1, 1, 3), 3, 5 / 3), ((1, 2, 2), 3, 5 / 3),
    ((2, 2, 3), 3, 7 / 3), ((1, 3, 3), 3, 7 / 3), ((2, 3, 3), 3, 8 / 3),
    ((1, 2, 3), 6, 6 / 3),
]
# Cumulative: 1 → 1/27, 4/3 → 4/27, 5/3 → 10/27, 2 → 17/27, 7/3 → 23/27, 8/3 → 26/27, 3 → 1.
# inverted_cdf takes the smallest mean whose CDF reaches p:
#   50%: p = .25 → 5/3 (10/27 = .370), p = .75 → 7/3 (23/27 = .852)
#   80%: p = .10 → 4/3 (4/27 = .148),  p = .90 → 8/3 (26/27 = .963)
#   95%: p = .025 → 1 (1/27 = .037),   p = .975 → 3
HAND_INTERVALS = {0.5: (5 / 3, 7 / 3), 0.8: (4 / 3, 8 / 3), 0.95: (1.0, 3.0)}


def test_hand_listed_multisets_are_the_whole_distribution():
    assert len(HAND) == 10 and sum(w for _, w, _ in HAND) == 27
    for ms, _, mean in HAND:
        assert np.mean(ms) == pytest.approx(mean)


@pytest.mark.parametrize("level", sorted(HAND_INTERVALS))
def test_exact_bootstrap_matches_the_hand_computed_interval(level):
    iv = exact_bootstrap_1d(np.array([1.0, 2.0, 3.0]), level)
    assert (iv.lo, iv.hi) == pytest.approx(HAND_INTERVALS[level], abs=1e-12)
    assert (iv.mean, iv.n, iv.cells, iv.level) == (2.0, 3, 3, level)
    # The same quantile rule on the 27 hand-expanded means.
    expanded = np.repeat([m for _, _, m in HAND], [w for _, w, _ in HAND])
    ps = [(1 - level) / 2, (1 + level) / 2]
    assert (iv.lo, iv.hi) == pytest.approx(tuple(np.quantile(expanded, ps, method="inverted_cdf")), abs=1e-12)


@pytest.mark.parametrize("level", sorted(HAND_INTERVALS))
def test_monte_carlo_agrees_with_the_hand_computed_interval(level):
    iv = paired_bootstrap(np.array([1.0, 2.0, 3.0]), level=level)
    lo, hi = HAND_INTERVALS[level]
    assert iv.lo == pytest.approx(lo, abs=0.05) and iv.hi == pytest.approx(hi, abs=0.05)


def test_linear_quantiles_of_the_enumeration_would_not_be_the_monte_carlo_limit():
    # Why the module uses inverted_cdf: 'linear' interpolates between the 27 enumerated means.
    expanded = np.sort(np.repeat([m for _, _, m in HAND], [w for _, w, _ in HAND]))
    assert np.quantile(expanded, 0.025) == pytest.approx(1 + 0.65 / 3)  # h = 26 · .025 = 0.65
    assert paired_bootstrap([1.0, 2.0, 3.0], n_boot=50_000).lo == 1.0


def test_a_quantile_on_a_cdf_step_takes_the_lower_value():
    # d = [0, 1]: means 0, 0.5, 0.5, 1, CDF 1/4, 3/4, 1; p = 0.25 lands exactly on the first step.
    iv = exact_bootstrap_1d([0.0, 1.0], 0.5)
    assert (iv.lo, iv.hi) == (0.0, 0.5)
    assert (iv.lo, iv.hi) == tuple(np.quantile([0, 0.5, 0.5, 1], [0.25, 0.75], method="inverted_cdf"))


def test_monte_carlo_ends_are_resampled_means_not_interpolations():
    d = np.random.default_rng(9).normal(size=4)
    possible = [np.mean(d[list(i)]) for i in np.ndindex(4, 4, 4, 4)]
    iv = paired_bootstrap(d, n_boot=7, level=0.5)
    assert min(abs(np.array(possible) - iv.lo)) < 1e-12 and min(abs(np.array(possible) - iv.hi)) < 1e-12


def test_exact_and_monte_carlo_agree_on_random_values():
    d = np.random.default_rng(7).normal(size=6)
    ex, mc = exact_bootstrap_1d(d, 0.9), paired_bootstrap(d, n_boot=40_000, level=0.9)
    assert ex.mean == pytest.approx(mc.mean)
    assert mc.lo == pytest.approx(ex.lo, abs=0.05) and mc.hi == pytest.approx(ex.hi, abs=0.05)


@pytest.mark.parametrize("shape", [(5,), (4, 7)])
def test_constant_differences_give_a_point_interval(shape):
    iv = paired_bootstrap(np.full(shape, 0.25))
    assert (iv.mean, iv.lo, iv.hi) == (0.25, 0.25, 0.25)
    assert decide(iv) == "held"


@pytest.mark.parametrize("shape", [(6,), (5, 10)])
def test_shifting_differences_shifts_the_interval(shape):
    d = np.random.default_rng(1).normal(size=shape)
    a, b = paired_bootstrap(d), paired_bootstrap(d + 3.5)
    assert b.lo == pytest.approx(a.lo + 3.5, abs=1e-12) and b.hi == pytest.approx(a.hi + 3.5, abs=1e-12)
    assert b.mean == pytest.approx(a.mean + 3.5, abs=1e-12) and a.lo < a.mean < a.hi


def test_nan_cells_are_ignored_as_if_dropped():
    d = np.random.default_rng(2).normal(size=(5, 10))
    assert paired_bootstrap(np.insert(d[:, 0], 2, np.nan)) == paired_bootstrap(d[:, 0])
    holey = d.copy()
    holey[1, 3] = holey[4, [0, 9]] = np.nan
    iv = paired_bootstrap(holey)
    assert (iv.n, iv.cells) == (5, 47) and iv.mean == pytest.approx(np.nanmean(holey))
    # Dropping a seed's missing clients = moving them to the end of its row.
    moved = np.array([np.concatenate([r[~np.isnan(r)], r[np.isnan(r)]]) for r in holey])
    assert paired_bootstrap(moved) == iv
    # An all-NaN client column or an all-NaN seed row is the same as not having it.
    assert paired_bootstrap(np.column_stack([d, np.full(5, np.nan)])) == paired_bootstrap(d)
    no_seed = paired_bootstrap(np.vstack([d[:3], np.full(10, np.nan), d[3:4]]))
    assert no_seed == paired_bootstrap(d[:4]) and no_seed.n == 4


def test_fixed_seed_is_deterministic_and_seeds_differ():
    d = np.random.default_rng(3).normal(size=(5, 10))
    assert paired_bootstrap(d, seed=11) == paired_bootstrap(d, seed=11)
    assert paired_bootstrap(d, seed=11).lo != paired_bootstrap(d, seed=12).lo
    assert paired_bootstrap(d[:, 0], seed=4) == paired_bootstrap(d[:, 0].tolist(), seed=4)


def test_cluster_resampling_keeps_a_seeds_clients_together():
    # The same 50 values (ten 1s, forty 0s): all 1s in seed 0, or two 1s in every seed.
    clustered = np.zeros((5, 10))
    clustered[0] = 1.0
    spread = np.zeros((5, 10))
    spread[:, :2] = 1.0
    c, s, pooled = paired_bootstrap(clustered), paired_bootstrap(spread), paired_bootstrap(clustered.ravel())
    assert c.mean == s.mean == pooled.mean == pytest.approx(0.2)
    # Clustered: the mean is (copies of seed 0) / 5, Binomial(5, 1/5): [0, 0.6] at 95%.
    assert (c.lo, c.hi) == pytest.approx((0.0, 0.6))
    # Spread: every seed's mean is 0.2, only client resampling varies it (sd ≈ 0.057).
    assert s.hi - s.lo < 0.3 and s.lo > 0.05
    assert c.hi - c.lo > 2 * (s.hi - s.lo)
    # Treating the 50 cells as independent would hide the clustering.
    assert c.hi - c.lo > 2 * (pooled.hi - pooled.lo)
    assert decide(c) == "inconclusive" and decide(s) == "held"


def test_resampled_means_weight_seeds_by_their_client_count():
    # Seed 0: one client at 10; seed 1: nine clients at 0 (the rest missing). k copies of seed 0
    # in a resample give 10k / (k + 9(2 − k)): 0 (1/4), 1 (1/2) or 10 (1/4), not a mean of means.
    d = np.full((2, 9), np.nan)
    d[0, 0], d[1] = 10.0, 0.0
    wide, mid = paired_bootstrap(d), paired_bootstrap(d, level=0.4)
    assert (wide.mean, wide.lo, wide.hi, wide.cells) == (1.0, 0.0, 10.0, 10)
    assert (mid.lo, mid.hi) == (1.0, 1.0)


def test_clients_are_resampled_within_a_single_seed():
    iv = paired_bootstrap(np.array([[0.0, 1.0, 2.0, 3.0]]))
    assert (iv.n, iv.cells) == (1, 4) and iv.lo < 1.5 < iv.hi and iv.hi - iv.lo > 0.5


def test_chunked_resampling_gives_the_same_distribution(monkeypatch):
    d = np.random.default_rng(5).normal(size=(5, 30))
    whole = paired_bootstrap(d, n_boot=500)
    monkeypatch.setattr(S, "_CHUNK_CELLS", 5 * 30 * 7)  # 7 resamples a chunk
    chunked = paired_bootstrap(d, n_boot=500)
    assert chunked.n == whole.n and chunked.lo == pytest.approx(whole.lo, abs=0.15)


def iv(lo, hi):
    return Interval(mean=(lo + hi) / 2, lo=lo, hi=hi, n=5, cells=5, level=0.95)


@pytest.mark.parametrize("lo, hi, up, down", [
    (0.01, 0.2, "held", "did not hold"),
    (-0.2, -0.01, "did not hold", "held"),
    (-0.1, 0.2, "inconclusive", "inconclusive"),
    (0.0, 0.2, "inconclusive", "inconclusive"),  # touching 0 does not exclude it
    (-0.2, 0.0, "inconclusive", "inconclusive"),
    (0.0, 0.0, "inconclusive", "inconclusive"),  # identical runs
])
def test_decide_each_verdict_in_both_directions(lo, hi, up, down):
    assert decide(iv(lo, hi)) == decide(iv(lo, hi), +1) == up
    assert decide(iv(lo, hi), -1) == down


def test_identical_runs_are_inconclusive():
    assert decide(paired_bootstrap(np.zeros((3, 4)))) == "inconclusive"
    assert decide(paired_bootstrap(np.zeros(3)), -1) == "inconclusive"


def test_describe():
    one = Interval(mean=0.0123, lo=0.004, hi=0.021, n=5, cells=50, level=0.95, per_client=True)
    assert describe(one) == "Δ +0.0123 [95% CI +0.0040, +0.0210] over 5 seeds × 10 clients"
    ragged = Interval(mean=-0.5, lo=-1.0, hi=0.25, n=5, cells=47, level=0.9, per_client=True)
    assert describe(ragged) == "Δ -0.5000 [90% CI -1.0000, +0.2500] over 5 seeds (47 seed-client cells)"
    assert describe(paired_bootstrap([0.5])) == "Δ +0.5000 [95% CI +0.5000, +0.5000] over 1 seed"
    assert describe(iv(1000.0, 3000.0), "+,.0f") == "Δ +2,000 [95% CI +1,000, +3,000] over 5 seeds"


@pytest.mark.parametrize("d, match", [
    ([], "empty"),
    (np.empty((0, 4)), "empty"),
    (np.empty((3, 0)), "empty"),
    ([np.nan, np.nan], "every difference is NaN"),
    (np.full((2, 3), np.nan), "every difference is NaN"),
    (np.zeros((2, 2, 2)), "1-D .* or 2-D"),
    ([1.0, np.inf], "inf"),
])
def test_bad_differences_raise(d, match):
    with pytest.raises(ValueError, match=match):
        paired_bootstrap(d)
    if np.ndim(d) == 1:
        with pytest.raises(ValueError, match=match):
            exact_bootstrap_1d(d)


@pytest.mark.parametrize("level", [0.0, 1.0, -0.1, 1.5, 95])
def test_level_outside_the_unit_interval_raises(level):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        paired_bootstrap([1.0, 2.0], level=level)
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        exact_bootstrap_1d([1.0, 2.0], level=level)


def test_other_bad_arguments_raise():
    with pytest.raises(ValueError, match="n_boot"):
        paired_bootstrap([1.0, 2.0], n_boot=0)
    with pytest.raises(ValueError, match="direction"):
        decide(iv(0.1, 0.2), 0)
    with pytest.raises(ValueError, match="1-D"):
        exact_bootstrap_1d(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="use paired_bootstrap"):
        exact_bootstrap_1d(np.arange(11.0))
