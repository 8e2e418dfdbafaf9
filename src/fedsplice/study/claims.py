"""A results page's claims, judged on the measured runs (`fedsplice.study.results` builds the page).

Every claim with a metric is tested: no rule on the same runs decides whether it may be (a gate
that tested only claims whose rows "moved" made a nominal 0.05 test reject 5.4-7.7% of the time
under no difference, and removed FedPuReL's claimed effect, a baseline's GM falling below
zero-shot). What the rows did is printed beside the test as information: each compared row's
paired change from round 0 (mean and t), whether it learned (`learned`), and whether it
diverged (`fedsplice.study.curves.diverged`: training loss ending above its start, or a fall on
every seed after a rise). A statistical verdict over such a row says so (`label`) and does not
count among the page's decisive verdicts (`decisive`).

The claims are pre-registered in the suite in two families, the papers' headline claims
("primary") and the rest ("secondary"), each decided by Holm's correction at its own α
(`decide_all`; the page's α is their sum). A claim whose paper gives an effect size also carries
an equivalence margin, half that effect: TOST at that margin makes "smaller than the paper's
effect" a reachable verdict. tests/test_claims.py simulates the whole procedure under no
difference and checks the family-wise rate of false verdicts.

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
from fedsplice.study import curves as H
from fedsplice.study import stats as S

ALPHA = 0.05
PARAMS = ("trainable params", "shared params")  # from results.json's params: GLOBAL + PRIVATE, GLOBAL
UNTESTABLE = "could not be tested"
BENCHMARK = "measured by a benchmark"
SMALLER = "smaller than the paper's effect"
STATISTICAL = ("held", "did not hold", "inconclusive", SMALLER, f"held, {SMALLER}")


@dataclasses.dataclass
class Verdict:
    verdict: str | None  # None: tested, decided by `decide_all` with the page's other claims
    evidence: str
    p: float = math.nan
    sign: int = 1  # +1: the difference lies on the claimed side
    adjusted: float = math.nan  # the Holm-adjusted p (set by `decide_all`; NaN outside the family)
    family: str = "secondary"  # pre-registered in the suite: "primary" (the papers' headlines) or "secondary"
    p_eq: float = math.nan  # TOST at `margin`, half the paper's effect (NaN: the claim has none)
    margin: float = math.nan
    adjusted_eq: float = math.nan
    alpha: float = math.nan  # the family's α it was decided at
    deterministic: bool = False  # bytes and parameter counts: no seed-to-seed noise
    learned: bool = True  # every compared trained row moved off round 0 (`learned`)
    diverged: list[str] = dataclasses.field(default_factory=list)  # compared rows that diverged, with why


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


# ----------------------------------------------------------------------------- the rows, as information


def change(results: dict[str, list[dict]], name: str, metric: str) -> S.Test | None:
    """Trained row `name`'s paired change from round 0 on `metric` (end − start, per seed; the
    test's t is mean / se); None when it is not trained or the metric has no start."""
    runs = results[name]
    if not runs or not all(r.get("rounds", 0) > 0 for r in runs):
        return None  # zero-shot and the references: nothing to learn
    d = per_seed(results, name, metric) - per_seed(results, name, metric, "start")
    return None if np.isnan(d).all() else S.paired_t(d)


def _t_of(tt: S.Test) -> str:
    return "no spread" if tt.exact else "1 seed" if math.isnan(tt.p) else f"t {tt.t:+.1f}"


def learned(results: dict[str, list[dict]], name: str) -> bool:
    """Whether a row trained measurably: its GM or PM accuracy moved off round 0 (a two-sided
    paired test at 0.05, unadjusted, in either direction). Untrained references count as learned
    (nothing to learn); this labels the page's counts, it never blocks a verdict."""
    tests = [t for m in ("GM acc", "PM acc") if (t := change(results, name, m)) is not None]
    return not tests or any(not math.isnan(t.p) and t.p < ALPHA for t in tests)


def rows_line(results: dict[str, list[dict]], rows: list[str], metric: str) -> str:
    """Each compared row's change from round 0 on the claim's metric: mean (its t), as information."""
    parts = []
    for n in rows:
        if (tt := change(results, n, metric)) is not None:
            parts.append(f"{n} {tt.mean:+.4f} ({_t_of(tt)}{'' if learned(results, n) else ', did not learn'})")
    return f"change from round 0: {', '.join(parts)}" if parts else ""


def compared(claim: dict, rows: list[str]) -> tuple[list[str], list[str]]:
    """(every row a claim compares, its baselines: the rows a win is claimed over)."""
    kind = claim["kind"]
    if kind == "greater":
        return [claim["a"], claim["b"]], [claim["b"]]
    if kind in ("best", "lowest"):
        return [claim["a"], *(n for n in rows if n != claim["a"])], [n for n in rows if n != claim["a"]]
    if kind == "gap_greater":
        both = list(dict.fromkeys([claim["a1"], claim["b1"], claim["a2"], claim["b2"]]))
        return both, list(dict.fromkeys([claim["b1"], claim["b2"]]))
    if kind == "balanced":
        return [claim["a"]], []
    return [], []


# ----------------------------------------------------------------------------- one claim


def _few(metric: str) -> str:
    return f"{metric}: too few test samples to report (eval.min_group_samples)"


def deterministic(metric: str) -> bool:
    """Bytes and parameter counts do not vary with the seed; every other metric does."""
    return metric.startswith(("up ", "down ")) or metric in PARAMS


def assess(claim: dict, results: dict[str, list[dict]], rows: list[str],
           histories: dict[str, list[H.History]] | None = None) -> Verdict:
    """The claim's verdict where it needs no test, else its p-values and side (see module doc).
    `histories`: each row's per-seed curves (`fedsplice.study.curves`), to name a row that diverged."""
    kind, metric = claim["kind"], claim.get("metric", "")
    family = claim.get("family", "secondary")
    if kind == "untestable":
        return Verdict(UNTESTABLE, claim.get("reason", ""), family=family)
    if kind == "benchmark":
        return Verdict(BENCHMARK, f"{claim['measured']} ({claim['source']})", family=family)
    if kind == "ratio":
        q = float(np.mean(per_seed(results, claim["a"], metric)) / np.mean(per_seed(results, claim["b"], metric)))
        ok = claim["low"] <= q <= claim["high"]
        return Verdict("held" if ok else "did not hold",
                       f"{metric}: ratio {q:.3f} (claimed {claim['low']}–{claim['high']})", family=family,
                       deterministic=True)
    every, _ = compared(claim, rows)
    v = _test(claim, results, rows, metric, deterministic(metric))
    v.family, v.deterministic = family, deterministic(metric)
    v.learned = all(learned(results, n) for n in every)
    v.diverged = [f"{n} ({why})" for n in every
                  if histories and histories.get(n) and (why := H.diverged(histories[n], metric))]
    v.evidence = "; ".join(x for x in (v.evidence, rows_line(results, every, metric),
                                       *(f"diverged: {d}" for d in v.diverged)) if x)
    return v


def _test(claim: dict, results, rows: list[str], metric: str, det: bool) -> Verdict:
    kind = claim["kind"]
    if kind in ("best", "lowest"):
        return _best(claim, results, rows, metric, 1 if kind == "best" else -1, det)
    if kind == "balanced":
        d = per_seed(results, claim["a"], metric) - per_seed(results, claim["a"], claim["metric_b"])
        if np.isnan(d).all():
            return Verdict(UNTESTABLE, _few(metric))
        tt, p_eq = S.paired_t(d, deterministic=det), S.equivalence(d, claim["margin"], det)
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
    tt = S.paired_t(d, deterministic=det)
    ev = head + S.describe(tt)
    if math.isnan(tt.p):
        return Verdict("inconclusive", ev)
    v = Verdict(None, ev, tt.p, 1 if tt.mean > 0 else -1)
    if (m := claim.get("equivalence")) is not None:  # the paper's effect, halved: "smaller than the paper's"
        v.margin, v.p_eq = float(m), S.equivalence(d, float(m), det)
        v.evidence += f"; within ±{v.margin:g} (half the paper's effect, TOST) p = {v.p_eq:.3g}"
    return v


def _best(claim: dict, results, rows: list[str], metric: str, sign: int, det: bool) -> Verdict:
    a = claim["a"]
    others = [n for n in rows if n != a]
    tests = {}
    for n in others:
        d = paired(results, a, n, metric)
        if np.isnan(d).all():
            return Verdict(UNTESTABLE, _few(metric))
        tests[n] = S.paired_t(sign * d, deterministic=det)
    means = {n: float(np.nanmean(per_seed(results, n, metric))) for n in rows}
    runner = max(others, key=lambda n: sign * means[n])
    ev = (f"{metric}: {a} {means[a]:.4f}, {'best' if sign > 0 else 'lowest'} other {means[runner]:.4f} ({runner}); "
          f"vs it {S.describe(tests[runner], '+.4f')}")
    if any(math.isnan(t.p) for t in tests.values()):
        return Verdict("inconclusive", ev)
    ahead = [n for n, t in tests.items() if t.mean <= 0]
    if not ahead:  # every row behind a: held when all are significantly behind (intersection-union)
        worst = max(tests, key=lambda n: tests[n].p)
        return Verdict(None, ev + f"; decided at the largest pairwise p = {tests[worst].p:.3g} (vs {worst})",
                       tests[worst].p, 1)
    near = min(ahead, key=lambda n: tests[n].p)
    p = min(1.0, len(ahead) * tests[near].p)
    return Verdict(None, ev + f"; {'ahead of' if sign > 0 else 'below'} it: {', '.join(ahead)}; decided at "
                   f"{len(ahead)} × p = {tests[near].p:.3g} (vs {near}) = {p:.3g}", p, -1)


# ----------------------------------------------------------------------------- the page


def label(v: Verdict) -> str:
    """The verdict as the page prints it: a statistical verdict names a compared row that diverged
    or did not learn (the claim was still tested; its win is worth no more than that row)."""
    if v.verdict not in STATISTICAL:
        return str(v.verdict)
    why = [w for w, bad in (("a compared row diverged", v.diverged), ("a compared row did not learn", not v.learned))
           if bad]
    return f"{v.verdict} ({'; '.join(why)})" if why else str(v.verdict)


def decisive(v: Verdict) -> bool:
    """A statistical verdict other than inconclusive, on rows that all learned and none diverged."""
    return (v.verdict in STATISTICAL and v.verdict != "inconclusive" and not v.deterministic
            and not v.diverged and v.learned)


def decide_all(verdicts: list[Verdict], alphas: dict[str, float] | None = None) -> list[Verdict]:
    """Decide every tested claim together, family by family (`alphas`, e.g. {"primary": 0.04,
    "secondary": 0.01}; None: one family at ALPHA): Holm over the family's difference and
    equivalence tests, then held (claimed side) / did not hold (other side) / inconclusive, and
    "smaller than the paper's" where the equivalence test at half the paper's effect is shown.
    Claims already decided (bytes, untestable) stay as they are."""
    alphas = alphas or {f: ALPHA for f in {v.family for v in verdicts}}
    for fam, alpha in alphas.items():
        family = [v for v in verdicts if v.verdict is None and v.family == fam]
        ps = [v.p for v in family] + [v.p_eq for v in family]
        adj = S.holm(ps) if ps else np.array([])
        for v, p, p_eq in zip(family, adj[:len(family)], adj[len(family):]):
            v.adjusted, v.adjusted_eq, v.alpha = float(p), float(p_eq), alpha
            v.verdict = S.decide(p, v.sign, alpha)
            if not math.isnan(p_eq) and p_eq < alpha and v.verdict != "did not hold":
                v.verdict = SMALLER if v.verdict == "inconclusive" else f"held, {SMALLER}"
            v.evidence += f"; Holm-adjusted p = {p:.3g}" + ("" if math.isnan(p_eq) else f", equivalence {p_eq:.3g}")
            v.evidence += f" ({fam} family, α = {alpha:g})"
    if (left := [v for v in verdicts if v.verdict is None]):
        raise ValueError(f"decide_all: claims of families {sorted({v.family for v in left})} have no α")
    return verdicts


def family_note(verdicts: list[Verdict], alphas: dict[str, float] | None = None, seeds: int | None = None) -> str:
    """What the page's decisions are worth: each family's error rate and, given the fewest seeds a
    group runs, what the strictest Holm step asks of a claim."""
    alphas = alphas or {f: ALPHA for f in {v.family for v in verdicts if not math.isnan(v.adjusted)}}
    sizes = {f: sum(not math.isnan(v.adjusted) and v.family == f for v in verdicts)
             + sum(not math.isnan(v.adjusted_eq) and v.family == f for v in verdicts) for f in alphas}
    parts = ", ".join(f"{n} tests in the {f} family at α = {alphas[f]:g}" for f, n in sizes.items() if n)
    total = sum(alphas[f] for f, n in sizes.items() if n)
    note = (f"Tested together: {parts or 'none'}. Within each family Holm's correction keeps the chance that "
            f"one or more of its held / did not hold / smaller-than-the-paper's verdicts is false at or below the "
            f"family's α, so over the page that chance is at most {total:g} (the families' α added). It bounds "
            f"the chance of any false verdict, not their number.")
    strict = [(f, n) for f, n in sizes.items() if n]
    if seeds is not None and seeds > 1 and strict:
        f, n = min(strict, key=lambda x: alphas[x[0]] / x[1])
        a = alphas[f] / n
        note += (f" With {seeds} seeds a paired t-test has {seeds - 1} degrees of freedom, and the strictest Holm "
                 f"step ({f}) needs p ≤ {alphas[f]:g}/{n} = {a:.2g}, a t of at least {S.t_needed(a, seeds):.1f}; "
                 f"a tie over every seed (no spread) can reach at best p = {2 / 2 ** seeds:.2g}.")
    return note
