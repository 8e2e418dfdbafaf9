"""Paired tests for the results page's claims, with a known error rate.

Runs pair up by seed (same clients, same sampling stream), so "a beats b" is judged on the
paired differences d = a − b: shape (seeds,) for per-seed metrics, or (seeds, clients) for
per-client ones (personalized accuracy), where NaN marks a missing cell.

- The unit of replication is the seed. Clients of one seed share a run, so they are not
  independent: a (seeds, clients) table is reduced to one mean per seed first (seeds as
  clusters), and the test runs on those means.
- `paired_t`: the two-sided paired t-test and its t-interval on the per-seed differences. Under
  no effect and normal seed-to-seed noise it decides wrongly exactly `alpha` of the time, for any
  number of seeds >= 2 (tests/test_stats.py simulates it). The percentile bootstrap it replaces
  gave [min, max] of the differences with 3 seeds and was wrong 25% of the time.
- `equivalence` (TOST, two one-sided tests): "no difference beyond ±margin" is *shown*, not
  assumed from an interval that contains 0.
- `holm`: Holm's step-down adjustment of a page's p-values, so that the chance of one or more
  false decisions among all the page's claims is at most alpha (family-wise).
- No spread (every seed gives the same difference, se = 0): a sure difference only for
  quantities that do not vary with the seed (bytes, parameter counts: `deterministic=True`).
  An accuracy difference is a multiple of 1/test items, so seeds can tie by chance; there the
  t statistic is undefined and the test falls back to the exact sign-flip test of the seeds,
  whose p is 2/2^n when all n seeds agree (0.25 at 3 seeds, 0.031 at 6): never 0.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Test:
    """A paired t-test of mean(d) = 0 over seeds, with its (1 − alpha) t-interval."""

    mean: float  # mean of the per-seed differences
    lo: float  # NaN with fewer than 2 seeds
    hi: float
    p: float  # two-sided; NaN with fewer than 2 seeds
    n: int  # seeds with a value
    cells: int  # non-NaN cells (== n for per-seed metrics)
    level: float
    per_client: bool = False
    exact: bool = False  # no spread over seeds: p from the exact sign-flip test, no interval
    t: float = math.nan  # mean / se (NaN with one seed or no spread)


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"stats: alpha must lie strictly between 0 and 1, got {alpha}")


def seed_means(d) -> tuple[np.ndarray, int, bool]:
    """(one value per seed, non-NaN cells, per_client): a (seeds, clients) table's per-seed means,
    seeds with no value dropped (a missing seed is not a zero)."""
    d = np.asarray(d, dtype=float)
    if d.ndim not in (1, 2):
        raise ValueError(f"stats: differences must be 1-D (seeds) or 2-D (seeds × clients), got shape {d.shape}")
    if d.size == 0:
        raise ValueError("stats: no differences given (empty array)")
    if np.isinf(d).any():
        raise ValueError("stats: differences contain ±inf; only finite values or NaN (missing) are allowed")
    ok = ~np.isnan(d)
    if not ok.any():
        raise ValueError("stats: every difference is NaN; no seed has a value")
    if d.ndim == 1:
        return d[ok], int(ok.sum()), False
    keep = ok.any(axis=1)
    return np.array([row[m].mean() for row, m in zip(d[keep], ok[keep])]), int(ok.sum()), True


def _no_spread(x: np.ndarray) -> bool:
    """Every seed gives the same value, up to float round-off (seed means of per-client tables,
    1/380 summed in another order on another CPU): then the t statistic is undefined."""
    return float(np.ptp(x)) <= 1e-12 * max(1.0, float(np.abs(x).max()))


def _t():
    from scipy import stats  # lazy: scipy costs a second at import

    return stats.t


def paired_t(d, alpha: float = 0.05, deterministic: bool = False) -> Test:
    """The two-sided paired t-test of the per-seed differences (see module doc). With no spread
    over seeds, `deterministic` quantities (bytes) differ surely (p = 0); others get the exact
    sign-flip test's p = 2/2^n."""
    _check_alpha(alpha)
    x, cells, per_client = seed_means(d)
    n, mean = x.size, float(x.mean())
    if n < 2:
        return Test(mean, math.nan, math.nan, math.nan, n, cells, 1 - alpha, per_client)
    se = 0.0 if _no_spread(x) else float(x.std(ddof=1)) / math.sqrt(n)
    if se == 0.0 and deterministic:
        return Test(mean, mean, mean, 0.0 if mean != 0 else 1.0, n, cells, 1 - alpha, per_client)
    if se == 0.0:  # seeds tied by chance: the sign-flip test (all 2^n sign patterns, 2 as extreme)
        p = 1.0 if mean == 0 else min(1.0, 2.0 / 2 ** n)
        return Test(mean, math.nan, math.nan, p, n, cells, 1 - alpha, per_client, exact=True)
    t = _t()
    q = float(t.ppf(1 - alpha / 2, n - 1))
    p = float(2 * t.sf(abs(mean) / se, n - 1))
    return Test(mean, mean - q * se, mean + q * se, p, n, cells, 1 - alpha, per_client, t=mean / se)


def t_needed(p: float, n: int) -> float:
    """The |t| a two-sided paired t-test over n seeds needs to reach p."""
    return float(_t().isf(p / 2, n - 1))


def equivalence(d, margin: float, deterministic: bool = False) -> float:
    """TOST p-value that |mean(d)| < margin (small: shown equivalent), on the per-seed values.
    With no spread: 0 or 1 for `deterministic` quantities, else each one-sided sign-flip test's
    1/2^n (see module doc)."""
    if not margin > 0:
        raise ValueError(f"stats: an equivalence margin must be > 0, got {margin}")
    x, _, _ = seed_means(d)
    n, mean = x.size, float(x.mean())
    if n < 2:
        return math.nan
    se = 0.0 if _no_spread(x) else float(x.std(ddof=1)) / math.sqrt(n)
    if se == 0.0:
        return (0.0 if deterministic else 1.0 / 2 ** n) if abs(mean) < margin else 1.0
    t = _t()
    p_low = float(t.sf((mean + margin) / se, n - 1))  # H0: mean <= −margin
    p_high = float(t.cdf((mean - margin) / se, n - 1))  # H0: mean >= +margin
    return max(p_low, p_high)


def holm(ps) -> np.ndarray:
    """Holm-adjusted p-values (NaN entries stay NaN and do not count): reject where adjusted < alpha."""
    ps = np.asarray(ps, dtype=float)
    out = np.full(ps.shape, np.nan)
    idx = np.flatnonzero(~np.isnan(ps))
    if idx.size == 0:
        return out
    if ((ps[idx] < 0) | (ps[idx] > 1)).any():
        raise ValueError("holm: p-values must lie in [0, 1]")
    order = idx[np.argsort(ps[idx], kind="stable")]
    m = order.size
    adj = np.minimum(1.0, (m - np.arange(m)) * ps[order])
    out[order] = np.maximum.accumulate(adj)
    return out


def decide(p_adj: float, sign: int, alpha: float = 0.05) -> str:
    """held | did not hold | inconclusive: a significant difference on the claimed side (sign
    +1), on the other side (−1), or none (also when there is no p-value)."""
    if sign not in (1, -1):
        raise ValueError(f"decide: sign must be +1 (the claimed side) or -1, got {sign}")
    if math.isnan(p_adj) or p_adj >= alpha:
        return "inconclusive"
    return "held" if sign == 1 else "did not hold"


def describe(tt: Test, spec: str = "+.4f") -> str:
    """One line of evidence, e.g. 'Δ +0.0123 [95% CI +0.0040, +0.0210], p = 0.012, 5 seeds × 10 clients'."""
    seeds = f"{tt.n} seed" + ("" if tt.n == 1 else "s")
    if tt.per_client:
        # A ragged table (missing clients) has no single client count; give the cells instead.
        seeds += f" × {tt.cells // tt.n} clients" if tt.cells % tt.n == 0 else f" ({tt.cells} seed-client cells)"
    if math.isnan(tt.p):
        return f"Δ {tt.mean:{spec}} from {seeds} (no interval from one seed)"
    if tt.exact:
        return (f"Δ {tt.mean:{spec}} on every seed (no spread, so no t-interval), exact sign-flip p = {tt.p:.3g}, "
                f"{seeds}")
    return f"Δ {tt.mean:{spec}} [{tt.level * 100:g}% CI {tt.lo:{spec}}, {tt.hi:{spec}}], p = {tt.p:.3g}, {seeds}"
