"""Paired percentile-bootstrap intervals and verdicts for the results page's claims.

Runs pair up by seed (same clients, same sampling stream), so a claim "a beats b" is judged on
the paired differences d = a − b: shape (seeds,) for per-seed metrics, or (seeds, clients) for
per-client metrics (personalized accuracy), where NaN marks a missing cell.

- 1-D: resample seeds with replacement.
- 2-D: two-level (cluster) bootstrap — resample seeds, then each resampled seed's own clients;
  clients of one seed share a run, so they are not independent and must not be pooled.
  The statistic is the mean over all resampled (seed, client) cells, and `Interval.mean` is the
  mean over all non-NaN cells to match it.

Quantile rule: numpy's method="inverted_cdf" (F⁻¹(p) = the smallest value whose empirical CDF
reaches p) for both the Monte-Carlo and the exact bootstrap. The exact one enumerates the whole
bootstrap distribution, and inverted_cdf of it is the n_boot → ∞ limit of the Monte-Carlo one;
'linear' is not: on d = [1, 2, 3] it interpolates the 27 enumerated means to a 95% interval of
[1.217, 2.783], while Monte-Carlo draws give [1, 3].

Gap claims, "(a1 − b1) exceeds (a2 − b2)" over two experiments run on the same seeds: callers
pass the per-seed difference of gaps, g1 − g2, as 1-D. The experiments' clients differ (another
partition), so clients do not pair across them; reduce each gap to its per-seed mean first.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

# Cap on values gathered per Monte-Carlo chunk: bounds memory for many clients or resamples.
_CHUNK_CELLS = 1 << 22
# 10 seeds -> 92,378 multisets; beyond that exact enumeration gets slow and is never needed.
_EXACT_MAX_N = 10
VERDICTS = ("held", "did not hold", "inconclusive")


@dataclasses.dataclass(frozen=True)
class Interval:
    """A bootstrap interval for the mean paired difference."""

    mean: float  # the mean over all non-NaN cells (the bootstrap statistic on the data itself)
    lo: float
    hi: float
    n: int  # seeds with at least one value
    cells: int  # non-NaN values (== n for per-seed metrics)
    level: float
    per_client: bool = False  # 2-D input: seeds × clients


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap: level must lie strictly between 0 and 1, got {level}")


def _quantiles(stats: np.ndarray, level: float, weights: np.ndarray | None = None) -> tuple[float, float]:
    """inverted_cdf quantiles at (1 ∓ level) / 2, optionally of a weighted distribution."""
    ps = np.array([(1.0 - level) / 2.0, (1.0 + level) / 2.0])
    if weights is None:
        lo, hi = np.quantile(stats, ps, method="inverted_cdf")
        return float(lo), float(hi)
    order = np.argsort(stats, kind="stable")
    cdf = np.cumsum(weights[order])
    # Integer weights: compare p·total against exact integer cumulative counts (no rounding).
    k = np.searchsorted(cdf, ps * cdf[-1], side="left")
    return float(stats[order][k[0]]), float(stats[order][k[1]])


def _pack(d) -> tuple[np.ndarray, np.ndarray, bool]:
    """(values, per-seed counts, per_client): each seed's non-NaN values moved to the left.

    Packing makes the result independent of where NaN cells sit, and equal to dropping them.
    """
    d = np.asarray(d, dtype=float)
    if d.ndim not in (1, 2):
        raise ValueError(f"bootstrap: differences must be 1-D (seeds) or 2-D (seeds × clients), got shape {d.shape}")
    if d.size == 0:
        raise ValueError("bootstrap: no differences given (empty array)")
    if np.isinf(d).any():
        raise ValueError("bootstrap: differences contain ±inf; only finite values or NaN (missing) are allowed")
    per_client = d.ndim == 2
    if not per_client:
        v = d[~np.isnan(d)]
        if v.size == 0:
            raise ValueError("bootstrap: every difference is NaN; no seed has a value")
        return v[:, None], np.ones(v.size, dtype=np.int64), False
    ok = ~np.isnan(d)
    m = ok.sum(axis=1)
    if m.sum() == 0:
        raise ValueError("bootstrap: every difference is NaN; no seed has a value")
    keep = m > 0  # a seed with no client values is missing, not a zero
    d, ok, m = d[keep], ok[keep], m[keep]
    packed = np.zeros((d.shape[0], int(m.max())))
    for s in range(d.shape[0]):
        packed[s, : m[s]] = d[s, ok[s]]
    return packed, m.astype(np.int64), per_client


def _resample_means(v: np.ndarray, m: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """n_boot two-level resampled means of packed values v (seeds × width, counts m)."""
    s, width = v.shape
    out = np.empty(n_boot)
    step = max(1, _CHUNK_CELLS // (s * width))
    for start in range(0, n_boot, step):
        b = min(step, n_boot - start)
        seeds = rng.integers(0, s, size=(b, s))
        ms = m[seeds]  # (b, s): client count of each resampled seed
        if width == 1:  # per-seed values: nothing to resample within a seed
            total = v[seeds, 0].sum(axis=1)
        else:
            u = rng.random((b, s, width))
            # floor(u·m) can round up to m for u near 1; clip keeps it a valid client index
            j = np.minimum((u * ms[..., None]).astype(np.int64), ms[..., None] - 1)
            take = np.arange(width) < ms[..., None]  # only m_s draws for a seed with m_s clients
            total = np.where(take, v[seeds[..., None], j], 0.0).sum(axis=(1, 2))
        out[start : start + b] = total / ms.sum(axis=1)
    return out


def paired_bootstrap(d, n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> Interval:
    """Percentile bootstrap interval for the mean of paired differences d (see module doc)."""
    _check_level(level)
    if int(n_boot) < 1:
        raise ValueError(f"bootstrap: n_boot must be at least 1, got {n_boot}")
    v, m, per_client = _pack(d)
    stats = _resample_means(v, m, int(n_boot), np.random.default_rng(seed))
    lo, hi = _quantiles(stats, level)
    return Interval(float(v.sum() / m.sum()), lo, hi, int(m.size), int(m.sum()), float(level), per_client)


def exact_bootstrap_1d(d, level: float = 0.95) -> Interval:
    """The 1-D percentile interval from all n^n resamples, enumerated as weighted multisets.

    For tests and tiny inputs (n ≤ 10 non-NaN values): the limit the Monte-Carlo one tends to.
    """
    _check_level(level)
    if np.asarray(d).ndim != 1:
        raise ValueError(f"exact bootstrap: differences must be 1-D, got shape {np.shape(d)}")
    v, _, _ = _pack(d)
    v = v[:, 0]
    n = v.size
    if n > _EXACT_MAX_N:
        raise ValueError(f"exact bootstrap: {n} values would need C({2 * n - 1}, {n}) multisets; "
                         f"use paired_bootstrap (at most {_EXACT_MAX_N} here)")
    combos = np.array(list(itertools.combinations_with_replacement(range(n), n)))
    counts = np.apply_along_axis(np.bincount, 1, combos, minlength=n)
    # A multiset with counts c arises from n! / Π c_i! ordered resamples.
    fact = np.array([math.factorial(k) for k in range(n + 1)], dtype=np.int64)
    weights = math.factorial(n) // np.prod(fact[counts], axis=1)
    means = counts @ v / n
    lo, hi = _quantiles(means, level, weights)
    return Interval(float(v.mean()), lo, hi, n, n, float(level))


def decide(iv: Interval, direction: int = +1) -> str:
    """held | did not hold | inconclusive: whether the interval excludes 0, and on which side.

    direction = +1 claims a > b (needs lo > 0); −1 claims a < b (needs hi < 0). An interval that
    touches 0, such as [0, 0] from identical runs, is inconclusive.
    """
    if direction not in (1, -1):
        raise ValueError(f"decide: direction must be +1 (a > b) or -1 (a < b), got {direction}")
    if iv.lo > 0:
        return "held" if direction == 1 else "did not hold"
    if iv.hi < 0:
        return "held" if direction == -1 else "did not hold"
    return "inconclusive"


def describe(iv: Interval, spec: str = "+.4f") -> str:
    """One line of evidence, e.g. 'Δ +0.0123 [95% CI +0.0040, +0.0210] over 5 seeds × 10 clients'."""
    seeds = f"{iv.n} seed" + ("" if iv.n == 1 else "s")
    if iv.per_client:
        # A ragged table (missing clients) has no single client count; give the cells instead.
        seeds += f" × {iv.cells // iv.n} clients" if iv.cells % iv.n == 0 else f" ({iv.cells} seed-client cells)"
    return f"Δ {iv.mean:{spec}} [{iv.level * 100:g}% CI {iv.lo:{spec}}, {iv.hi:{spec}}] over {seeds}"
