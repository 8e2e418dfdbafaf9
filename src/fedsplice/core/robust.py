"""Server-side defences: validate every client update before it is aggregated, and aggregate
robustly when clients are not trusted.

`check_update` is the gate between the wire and the server optimizer. It returns a reason
(one line, for the log and metrics.jsonl) or None for an acceptable update. An update is
refused, never repaired: a client that sends a PRIVATE name, an unknown or missing name, a
wrong shape or dtype, a NaN/Inf, or a delta whose L2 norm is above `norm_bound` contributes
nothing this round. Nothing is raised, so one hostile or broken client cannot stop a round.

`aggregate` replaces the sample-weighted mean by a coordinate-wise median or trimmed mean
(Yin et al., "Byzantine-Robust Distributed Learning", ICML 2018,
https://arxiv.org/abs/1803.01498) over the GLOBAL deltas. Both ignore sample counts on
purpose: a client could lie about its count, and weighting it would hand it the aggregate.
All arithmetic is float64, as in `server.weighted_mean`, so results do not depend on the
order in which replies arrived.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch

from fedsplice.core.server import OWN_WEIGHT, Params, weighted_mean

AGGREGATIONS = ("mean", "median", "trimmed_mean")


def check_update(tensors: Mapping[str, torch.Tensor], reference: Params, private: set[str],
                 norm_bound: float = 0.0) -> str | None:
    """Why this upload must be refused, or None. `reference` holds the GLOBAL tensors the
    server sent this round (names, shapes and dtypes an upload must match exactly)."""
    leaked = sorted(set(tensors) & private)
    if leaked:
        return f"carries PRIVATE tensor {leaked[0]}"
    unknown = sorted(set(tensors) - set(reference))
    if unknown:
        return f"carries unknown tensor {unknown[0]}"
    missing = sorted(set(reference) - set(tensors))
    if missing:
        return f"lacks GLOBAL tensor {missing[0]}"
    sq = 0.0
    for name in sorted(reference):
        ref, t = reference[name], tensors[name]
        if not isinstance(t, torch.Tensor):
            return f"{name}: not a tensor"
        if tuple(t.shape) != tuple(ref.shape):
            return f"{name}: shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
        if t.dtype != ref.dtype:
            return f"{name}: dtype {t.dtype}, expected {ref.dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name}: non-finite values (NaN or Inf)"
        d = t.to(torch.float64) - ref.to(torch.float64)
        sq += float((d * d).sum())
    norm = math.sqrt(sq)
    if not math.isfinite(norm):
        return f"update norm overflows ({norm})"
    if norm_bound > 0 and norm > norm_bound:
        return f"update norm {norm:.4g} exceeds server.update_norm_bound {norm_bound:.4g}"
    return None


def check_weight(num_examples: object) -> str | None:
    """A reply's sample count weights its update in the mean: it must be a positive integer."""
    if isinstance(num_examples, bool) or not isinstance(num_examples, numbers.Integral) or num_examples <= 0:
        return f"bad sample count {num_examples!r}"
    return None


def check_stats(stats: object) -> str | None:
    """Training statistics go into metrics.jsonl: a flat dict of finite numbers."""
    if not isinstance(stats, dict):
        return "training statistics are not a table"
    for k, v in stats.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"training statistic {k!r} is not a number"
        if not math.isfinite(v):
            return f"training statistic {k!r} is not finite ({v})"
        if k.startswith(OWN_WEIGHT) and v < 0:
            return f"aggregation weight {k!r} is negative ({v})"
    return None


def coordinate_median(updates: list[Params]) -> Params:
    """Per-coordinate median; for an even count, the mean of the two middle values."""
    return _sorted_reduce(updates, 0.0)


def trimmed_mean(updates: list[Params], trim_fraction: float) -> Params:
    """Per coordinate, drop the floor(trim_fraction·n) largest and smallest values and average
    the rest (n = number of updates). trim_fraction in [0, 0.5)."""
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trimmed_mean: trim_fraction must be in [0, 0.5), got {trim_fraction}")
    return _sorted_reduce(updates, trim_fraction, median=False)


def _sorted_reduce(updates: list[Params], trim_fraction: float, median: bool = True) -> Params:
    if not updates:
        raise ValueError("robust aggregation: no updates")
    n = len(updates)
    out: Params = {}
    for name in updates[0]:
        stack = torch.stack([u[name].to(torch.float64) for u in updates])
        s, _ = torch.sort(stack, dim=0)
        if median:
            mid = n // 2
            out[name] = s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
        else:
            k = int(math.floor(trim_fraction * n))
            out[name] = s[k:n - k].mean(dim=0)
    return out


def aggregate(updates: list[Params], weights: Sequence[float], method: str = "mean",
              trim_fraction: float = 0.1) -> Params:
    """The server's aggregate of client deltas: "mean" (sample-weighted, the default and the
    FedAvg rule), "median" or "trimmed_mean" (unweighted, coordinate-wise)."""
    if method == "mean":
        return weighted_mean(updates, weights)
    if method == "median":
        return coordinate_median(updates)
    if method == "trimmed_mean":
        return trimmed_mean(updates, trim_fraction)
    raise ValueError(f"aggregate: unknown method {method!r}; choose one of {', '.join(AGGREGATIONS)}")
