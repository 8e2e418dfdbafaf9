"""A results page's claims, judged on the measured runs (`fedsplice.app.results` builds the page).

Each claim is first *gated*: it is tested only when the budget let the compared rows learn.
A trained baseline must move off its start (round 0) by more than its seed spread, and the
compared rows must differ. Otherwise the verdict is "not tested: no training signal", with the
numbers that show it: never held / did not hold / inconclusive. The claims that pass the gate
form the page's family. Each gives one p-value and the side its difference lies on, and
`decide_all` decides them together with Holm's correction (`fedsplice.app.stats`).

- greater: a beats b on a metric (paired by seed; PM accuracy by client within a seed, the
  seed as the cluster): the two-sided paired t-test.
- best / lowest: a beats (stays below) every other row. It holds when every pairwise test does,
  at the largest of their p-values (an intersection-union test needs no correction). It does
  not hold when some row is ahead, at the smallest p of those rows times their number.
- balanced: one run's two metrics do not differ beyond ±margin. TOST shows equivalence (held);
  a two-sided test shows a difference (did not hold).
- gap_greater: a1 − b1 exceeds a2 − b2, on the per-seed difference of gaps.
- ratio: mean(a) / mean(b) lies in [low, high]. For bytes, which do not vary with the seed, so
  it is outside the family.
- benchmark: a claim measured by a benchmark script (its number and source are shown).
- untestable: a claim this substitute setting cannot test; the suite says why.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fedsplice.app import compare as C
from fedsplice.app import stats as S

ALPHA = 0.05
PARAMS = ("trainable params", "shared params")  # from results.json's params: GLOBAL + PRIVATE, GLOBAL
NO_SIGNAL = "not tested: no training signal"
UNTESTABLE = "could not be tested"
BENCHMARK = "measured by a benchmark"


@dataclasses.dataclass
class Verdict:
    verdict: str | None  # None: tested, decided by `decide_all` with the page's other claims
    evidence: str
    p: float = math.nan
    sign: int = 1  # +1: the difference lies on the claimed side
    adjusted: float = math.nan  # the Holm-adjusted p (set by `decide_all`; NaN outside the family)


# ----------------------------------------------------------------------------- values


def value(r: dict, metric: str, at: str = "end") -> float | None:
    """A run's metric at its end, or at its start (round 0: "start"; None where it has none)."""
    if metric.startswith("cold-start e"):
        if at == "start":
            return None
        cs = r.get("cold_start") or {}
        e = int(metric.removeprefix("cold-start e"))
        v = cs["accuracy"][cs["epochs"].index(e)] if e in cs.get("epochs", []) else None
        return None if v is None else float(v)  # null: undefined in results.json
    if metric in PARAMS:
        if at == "start":
            return None
        p = r.get("params") or {}
        return float(p.get("global", 0) + (p.get("private", 0) if metric == PARAMS[0] else 0))
    path = dict(C.METRICS)[metric]
    if at == "start":  # round 0; older records keep only its GM, as zero_shot_gm
        start = r.get("start") or {"gm": r.get("zero_shot_gm")}
        return C.metric_at(start, path) if path[0] in ("gm", "pm") else None
    return C.metric_at(r, path)


def per_seed(results: dict[str, list[dict]], name: str, metric: str, at: str = "end") -> np.ndarray:
    return np.array([np.nan if (v := value(r, metric, at)) is None else v for r in results[name]], dtype=float)


def fmt(v: np.ndarray, metric: str) -> str:
    if np.isnan(v).all():
        return "—"
    m, s = np.nanmean(v), np.nanstd(v)
    return f"{m:,.0f} ± {s:,.0f}" if metric.startswith("up") or metric in PARAMS else f"{m:.3f} ± {s:.3f}"


def paired(results: dict[str, list[dict]], a: str, b: str, metric: str) -> np.ndarray:
    """a − b, paired: per seed and client (seeds × clients) for PM accuracy, whose clients are
    the same in both runs of a seed; per seed otherwise."""
    if metric == "PM acc":
        ca = [(r.get("pm") or {}).get("client_accuracy") for r in results[a]]
        cb = [(r.get("pm") or {}).get("client_accuracy") for r in results[b]]
        if (all(x is not None and y is not None and len(x) == len(y) for x, y in zip(ca, cb))
                and len({len(x) for x in ca}) == 1):  # type: ignore[arg-type]  # all() above: no None
            return np.array(ca, dtype=float) - np.array(cb, dtype=float)
    return per_seed(results, a, metric) - per_seed(results, b, metric)


# ----------------------------------------------------------------------------- the gate


def _change(results: dict[str, list[dict]], name: str, metric: str) -> tuple[float, float, float, float] | None:
    """Trained row `name`'s mean start, mean end, mean change from round 0 and seed spread (the
    std of its end values) on `metric`; None when it is not trained or the metric has no start."""
    runs = results[name]
    if not runs or not all(r.get("rounds", 0) > 0 for r in runs):
        return None  # zero-shot and the references: nothing to learn
    end, start = per_seed(results, name, metric), per_seed(results, name, metric, "start")
    ok = ~(np.isnan(end) | np.isnan(start))
    if not ok.any():
        return None
    spread = float(np.std(end[ok], ddof=1)) if ok.sum() > 1 else 0.0
    return float(np.mean(start[ok])), float(np.mean(end[ok])), float(np.mean(end[ok] - start[ok])), spread


def fell(results: dict[str, list[dict]], name: str, metric: str) -> str | None:
    """A note when tested baseline `name` ended below where it started by more than its seed spread
    (a diverged or over-fitted baseline: the reader should know what a win over it is worth)."""
    if (c := _change(results, name, metric)) is None:
        return None
    start, end, change, spread = c
    if not change < -spread:
        return None
    return f"{name} ended below its round-0 {metric} ({start:.4f} → {end:.4f}, more than its seed spread {spread:.4f})"


def moved(results: dict[str, list[dict]], name: str, metric: str) -> str | None:
    """Why trained row `name` shows no training signal on `metric` (None: it moved, or it is not
    trained, or the metric has no start): its mean change from round 0 is within its seed spread."""
    if (c := _change(results, name, metric)) is None:
        return None
    start, end, change, spread = c
    if abs(change) > spread and change != 0.0:
        return None
    norms = [r["movement"]["global"] for r in results[name] if (r.get("movement") or {}).get("global") is not None]
    tensors = f", ‖Δ GLOBAL‖ {np.mean(norms):.3g}" if norms else ""
    return (f"{name} {metric} {end:.4f} against {start:.4f} at round 0: "
            f"change {change:+.4f} within its seed spread {spread:.4f}{tensors}")


def _identical(results, a: str, b: str, metric: str) -> str | None:
    x, y = per_seed(results, a, metric), per_seed(results, b, metric)
    if x.shape == y.shape and not np.isnan(x).all() and np.array_equal(x, y, equal_nan=True):
        return f"{a} and {b} are identical in {metric} on every seed"
    return None


def gate(claim: dict, results: dict[str, list[dict]], rows: list[str]) -> str | None:
    """Why a claim is not tested (None: it is): a trained baseline that did not move, or compared
    rows that are identical."""
    kind, metric = claim["kind"], claim.get("metric", "")
    if kind == "greater":
        pairs, bases = [(claim["a"], claim["b"])], [claim["b"]]
    elif kind in ("best", "lowest"):
        bases = [n for n in rows if n != claim["a"]]
        pairs = [(claim["a"], n) for n in bases]
    elif kind == "gap_greater":
        pairs, bases = [(claim["a1"], claim["b1"]), (claim["a2"], claim["b2"])], [claim["b1"], claim["b2"]]
    else:
        return None
    why = [w for a, b in pairs if (w := _identical(results, a, b, metric))]
    why += [w for n in dict.fromkeys(bases) if (w := moved(results, n, metric))]
    return "; ".join(why) or None


# ----------------------------------------------------------------------------- one claim


def _few(metric: str) -> str:
    return f"{metric}: too few test samples to report (eval.min_group_samples)"


def assess(claim: dict, results: dict[str, list[dict]], rows: list[str]) -> Verdict:
    """The claim's verdict where it needs no test, else its p-value and side (see module doc)."""
    kind, metric = claim["kind"], claim.get("metric", "")
    if kind == "untestable":
        return Verdict(UNTESTABLE, claim.get("reason", ""))
    if kind == "benchmark":
        return Verdict(BENCHMARK, f"{claim['measured']} ({claim['source']})")
    if kind == "ratio":
        q = float(np.mean(per_seed(results, claim["a"], metric)) / np.mean(per_seed(results, claim["b"], metric)))
        ok = claim["low"] <= q <= claim["high"]
        return Verdict("held" if ok else "did not hold",
                       f"{metric}: ratio {q:.3f} (claimed {claim['low']}–{claim['high']})")
    if (why := gate(claim, results, rows)) is not None:
        return Verdict(NO_SIGNAL, why)
    if kind in ("best", "lowest"):
        return _best(claim, results, rows, metric, 1 if kind == "best" else -1)
    if kind == "balanced":
        d = per_seed(results, claim["a"], metric) - per_seed(results, claim["a"], claim["metric_b"])
        if np.isnan(d).all():
            return Verdict(UNTESTABLE, _few(metric))
        tt, p_eq = S.paired_t(d), S.equivalence(d, claim["margin"])
        ev = (f"{metric} − {claim['metric_b']} of {claim['a']}: {S.describe(tt)}; "
              f"equivalence within ±{claim['margin']:g} (TOST) p = {p_eq:.3g}")
        if math.isnan(tt.p):
            return Verdict("inconclusive", ev)
        return Verdict(None, ev, p_eq, 1) if p_eq <= tt.p else Verdict(None, ev, tt.p, -1)
    if kind == "greater":
        d = paired(results, claim["a"], claim["b"], metric)
        if np.isnan(d).all():
            return Verdict(UNTESTABLE, _few(metric))
        head = (f"{metric}: {np.nanmean(per_seed(results, claim['a'], metric)):.4f} vs "
                f"{np.nanmean(per_seed(results, claim['b'], metric)):.4f}; ")
    else:  # gap_greater
        g1 = per_seed(results, claim["a1"], metric) - per_seed(results, claim["b1"], metric)
        g2 = per_seed(results, claim["a2"], metric) - per_seed(results, claim["b2"], metric)
        if np.isnan(g1 - g2).all():
            return Verdict(UNTESTABLE, _few(metric))
        d, head = g1 - g2, f"{metric}: gap {np.nanmean(g1):+.4f} vs {np.nanmean(g2):+.4f}; difference of gaps "
    tt = S.paired_t(d)
    bases = [claim["b"]] if kind == "greater" else list(dict.fromkeys([claim["b1"], claim["b2"]]))
    ev = "; ".join([head + S.describe(tt), *(f for b in bases if (f := fell(results, b, metric)))])
    if math.isnan(tt.p):
        return Verdict("inconclusive", ev)
    return Verdict(None, ev, tt.p, 1 if tt.mean > 0 else -1)


def _best(claim: dict, results, rows: list[str], metric: str, sign: int) -> Verdict:
    a = claim["a"]
    others = [n for n in rows if n != a]
    tests = {}
    for n in others:
        d = paired(results, a, n, metric)
        if np.isnan(d).all():
            return Verdict(UNTESTABLE, _few(metric))
        tests[n] = S.paired_t(sign * d)
    means = {n: float(np.nanmean(per_seed(results, n, metric))) for n in rows}
    runner = max(others, key=lambda n: sign * means[n])
    ev = (f"{metric}: {a} {means[a]:.4f}, {'best' if sign > 0 else 'lowest'} other {means[runner]:.4f} ({runner}); "
          f"vs it {S.describe(tests[runner], '+.4f')}")
    if any(math.isnan(t.p) for t in tests.values()):
        return Verdict("inconclusive", ev)
    ahead = [n for n, t in tests.items() if t.mean <= 0]
    if not ahead:  # every row behind a: held when all are significantly behind
        return Verdict(None, ev, max(t.p for t in tests.values()), 1)
    p = min(1.0, len(ahead) * min(tests[n].p for n in ahead))
    return Verdict(None, ev + f"; {'ahead of' if sign > 0 else 'below'} it: {', '.join(ahead)}", p, -1)


# ----------------------------------------------------------------------------- the page


def decide_all(verdicts: list[Verdict], alpha: float = ALPHA) -> list[Verdict]:
    """Decide every tested claim together: Holm-adjusted p-values, then held (claimed side) / did
    not hold (other side) / inconclusive. Claims already decided stay as they are."""
    family = [v for v in verdicts if v.verdict is None]
    for v, p in zip(family, S.holm([v.p for v in family])):
        v.verdict, v.adjusted = S.decide(p, v.sign, alpha), float(p)
        v.evidence += f"; Holm-adjusted p = {p:.3g}"
    return verdicts


def family_note(verdicts: list[Verdict], alpha: float = ALPHA, seeds: int | None = None) -> str:
    """What the page's decisions are worth: the family's error rate and, given the fewest seeds
    a group runs, what the strictest Holm step asks of a claim."""
    m = sum(not math.isnan(v.adjusted) for v in verdicts)
    gated = sum(v.verdict == NO_SIGNAL for v in verdicts)
    note = (f"{m} claims were tested together. Holm's correction keeps the chance that any of their held / did not "
            f"hold verdicts is false at or below {alpha:g}, so the expected number of false decisions is at most "
            f"{alpha:g} × {m} = {alpha * m:.2f}. {gated} claims were not tested because a compared row did not learn.")
    if seeds is not None and seeds > 1 and m > 0:
        note += (f" With {seeds} seeds a paired t-test has {seeds - 1} degrees of freedom, and the strictest Holm step "
                 f"needs p ≤ {alpha:g}/{m} = {alpha / m:.2g}, a t of at least {S.t_needed(alpha / m, seeds):.1f}: "
                 "an inconclusive verdict here says mostly that the seeds are too few to decide, not that the "
                 "rows tie.")
    return note
