"""fedsplice.app.claims: each claim kind on hand-computed cases, the training-signal gate on
constructed runs, and the page's joint decision (Holm). p-values of 3 seeds by the closed form
of Student's t with 2 degrees of freedom: P(|T| > t) = 1 − t / √(t² + 2)."""

import math

import pytest

from fedsplice.app import claims as V
from fedsplice.app import stats as S


def p_df2(t: float) -> float:
    return 1 - abs(t) / math.sqrt(t * t + 2)


def res(pm, up=100.0, gm=0.5, cold=None, rounds=0, start_pm=None, start_gm=None, moved=None):
    r = {"gm": {"accuracy": gm}, "pm": {"accuracy": pm}, "communication": {"up_bytes_per_round": up},
         "rounds": rounds, "start": {"gm": {"accuracy": start_gm}, "pm": {"accuracy": start_pm}}}
    if cold is not None:
        r["cold_start"] = {"epochs": [0, 1], "accuracy": cold}
    if moved is not None:
        r["movement"] = {"global": moved, "private": None, "branch": None}
    return r


def one(claim, results, rows=()):
    """A claim decided alone (a family of one: Holm changes nothing)."""
    return V.decide_all([V.assess(claim, results, list(rows))])[0]


R3 = {"a": [res(0.6), res(0.7), res(0.5)], "b": [res(0.5), res(0.6), res(0.55)],
      "c": [res(0.4, up=50), res(0.49, up=50), res(0.31, up=50)], "d": [res(0.9), res(0.1), res(0.2)]}


def test_greater_by_hand():
    # a − b = (.1, .1, −.05): mean .05, sd .0866, se .05, t = 1
    v = one({"kind": "greater", "a": "a", "b": "b", "metric": "PM acc"}, R3)
    assert v.verdict == "inconclusive" and v.p == pytest.approx(p_df2(1.0), rel=1e-9)
    assert v.evidence.startswith("PM acc: 0.6000 vs 0.5500; Δ +0.0500 [95% CI") and "3 seeds" in v.evidence
    # a − c = (.2, .21, .19): se .01/√3, t = 34.64, p = 8.3e-4
    v = one({"kind": "greater", "a": "a", "b": "c", "metric": "PM acc"}, R3)
    assert v.verdict == "held" and v.p == pytest.approx(p_df2(0.2 / (0.01 / math.sqrt(3))), rel=1e-6)
    assert one({"kind": "greater", "a": "c", "b": "a", "metric": "PM acc"}, R3).verdict == "did not hold"


def test_best_and_lowest_by_hand():
    p_ac = p_df2(0.2 / (0.01 / math.sqrt(3)))
    v = one({"kind": "best", "a": "a", "metric": "PM acc"}, R3, ["a", "c"])
    assert v.verdict == "held" and v.p == pytest.approx(p_ac, rel=1e-6)
    # a − d = (−.3, .6, .3): behind on average too, but t = 0.756: the largest p decides (inconclusive)
    v = one({"kind": "best", "a": "a", "metric": "PM acc"}, R3, ["a", "c", "d"])
    assert v.verdict == "inconclusive" and v.p == pytest.approx(p_df2(0.2 / (math.sqrt(0.21) / math.sqrt(3))), rel=1e-6)
    # c is behind a and b: did not hold at 2 × the smaller p
    v = one({"kind": "best", "a": "c", "metric": "PM acc"}, R3, ["a", "b", "c"])
    assert (v.verdict == "did not hold" and v.p == pytest.approx(2 * p_ac, rel=1e-6)
            and "ahead of it: a, b" in v.evidence)
    assert one({"kind": "lowest", "a": "c", "metric": "PM acc"}, R3, ["a", "c"]).verdict == "held"
    assert one({"kind": "lowest", "a": "a", "metric": "PM acc"}, R3, ["a", "c"]).verdict == "did not hold"


def test_ratio_gap_cold_start_and_untestable():
    ratio = {"kind": "ratio", "a": "c", "b": "a", "metric": "up B/round", "low": 0.45, "high": 0.55}
    assert one(ratio, R3).verdict == "held" and math.isnan(one(ratio, R3).adjusted)  # outside the family
    assert one({**ratio, "low": 0.55, "high": 0.6}, R3).verdict == "did not hold"
    gap = {"kind": "gap_greater", "a1": "a", "b1": "c", "a2": "b", "b2": "c", "metric": "PM acc"}
    v = one(gap, R3)  # (a − c) − (b − c) = a − b
    assert v.verdict == "inconclusive" and v.p == pytest.approx(p_df2(1.0), rel=1e-9)
    assert v.evidence.startswith("PM acc: gap +0.2000 vs +0.1500; difference of gaps Δ +0.0500")
    cold = {"x": [res(0.5, cold=c) for c in ([0.3, 0.5], [0.35, 0.5], [0.32, 0.5])],
            "y": [res(0.5, cold=c) for c in ([0.2, 0.6], [0.2, 0.7], [0.2, 0.65])]}
    assert one({"kind": "greater", "a": "x", "b": "y", "metric": "cold-start e0"}, cold).verdict == "held"
    assert one({"kind": "greater", "a": "x", "b": "y", "metric": "cold-start e1"}, cold).verdict == "did not hold"
    single = {"x": cold["x"][:1], "y": cold["y"][:1]}
    v = one({"kind": "greater", "a": "x", "b": "y", "metric": "cold-start e0"}, single)
    assert v.verdict == "inconclusive" and "no interval from one seed" in v.evidence
    assert one({"kind": "untestable", "reason": "no images"}, R3).verdict == V.UNTESTABLE
    few = {"x": [{"pm": {"few": None}}] * 2, "y": [{"pm": {"few": None}}] * 2}  # too few samples: null
    assert one({"kind": "greater", "a": "x", "b": "y", "metric": "PM few"}, few).verdict == V.UNTESTABLE
    bench = one({"kind": "benchmark", "measured": "+0.6%", "source": "docs/performance.md"}, R3)
    assert (bench.verdict, bench.evidence) == (V.BENCHMARK, "+0.6% (docs/performance.md)")


def test_balanced_is_an_equivalence_test():
    bal = {"kind": "balanced", "metric": "GM many", "metric_b": "GM few", "margin": 0.05}
    runs = lambda pairs: [{"gm": {"many": m, "few": f}} for m, f in pairs]  # noqa: E731
    zs = {"z": runs([(0.6, 0.5), (0.5, 0.6), (0.55, 0.5)]),  # many − few (.1, −.1, .05): absence of evidence
          "w": runs([(0.6, 0.5), (0.7, 0.5), (0.65, 0.5)]),  # (.1, .2, .15): favours the head
          "e": runs([(0.51, 0.5), (0.49, 0.5), (0.5, 0.5)])}  # (.01, −.01, 0): within ±.05, shown
    assert one({**bal, "a": "z"}, zs).verdict == "inconclusive"
    v = one({**bal, "a": "w"}, zs)
    assert v.verdict == "did not hold" and v.p == pytest.approx(p_df2(0.15 / (0.05 / math.sqrt(3))), rel=1e-6)
    v = one({**bal, "a": "e"}, zs)  # TOST: P(T > .05 / (.01/√3)) one-sided
    assert v.verdict == "held" and v.p == pytest.approx(p_df2(0.05 / (0.01 / math.sqrt(3))) / 2, rel=1e-6)
    assert "equivalence within ±0.05 (TOST)" in v.evidence


# ----------------------------------------------------------------------------- the gate


def _trained(pm, start, moved=0.1):
    return [res(p, rounds=5, start_pm=s, moved=moved) for p, s in zip(pm, start)]


def test_gate_identical_rows_are_not_tested():
    same = _trained([0.6, 0.7, 0.65], [0.3, 0.3, 0.3])
    v = one({"kind": "greater", "a": "a", "b": "b", "metric": "PM acc"}, {"a": same, "b": same})
    assert v.verdict == V.NO_SIGNAL and "a and b are identical in PM acc on every seed" in v.evidence
    assert math.isnan(v.adjusted)  # outside the family


def test_gate_a_baseline_that_never_moved_is_not_tested():
    a = _trained([0.70, 0.72, 0.71], [0.50, 0.50, 0.50])
    b = _trained([0.51, 0.49, 0.505], [0.50, 0.50, 0.50], moved=0.0)  # change +.0017, spread .0104
    v = one({"kind": "greater", "a": "a", "b": "b", "metric": "PM acc"}, {"a": a, "b": b})
    assert v.verdict == V.NO_SIGNAL
    assert v.evidence == ("b PM acc 0.5017 against 0.5000 at round 0: change +0.0017 within its seed spread 0.0104, "
                          "‖Δ GLOBAL‖ 0")
    # as best / lowest: any trained row that did not move stops the claim
    assert one({"kind": "best", "a": "a", "metric": "PM acc"}, {"a": a, "b": b}, ["a", "b"]).verdict == V.NO_SIGNAL


def test_gate_passes_a_genuine_difference_and_untrained_references():
    a = _trained([0.70, 0.72, 0.71], [0.50, 0.50, 0.50])
    b = _trained([0.60, 0.61, 0.59], [0.50, 0.50, 0.50])  # moved +.10, spread .01
    v = one({"kind": "greater", "a": "a", "b": "b", "metric": "PM acc"}, {"a": a, "b": b})
    assert v.verdict == "held" and v.adjusted == v.p
    zs = [res(0.5, start_pm=0.5), res(0.52, start_pm=0.52), res(0.49, start_pm=0.49)]  # rounds 0: zero-shot
    assert one({"kind": "greater", "a": "a", "b": "z", "metric": "PM acc"}, {"a": a, "z": zs}).verdict == "held"
    # records without a start (older results.json): GM falls back to zero_shot_gm; PM has none
    old = [{"gm": {"accuracy": 0.5}, "zero_shot_gm": {"accuracy": 0.5}, "rounds": 3} for _ in range(3)]
    assert V.moved({"o": old}, "o", "GM acc").startswith("o GM acc 0.5000 against 0.5000")
    assert V.moved({"o": old}, "o", "PM acc") is None


def test_a_tested_baseline_that_fell_below_its_start_is_named():
    """A baseline that diverged still moved (the claim is tested), and the evidence says it fell:
    mean start .50, end .27 (sd .03), change −.23 beyond the spread."""
    a = _trained([0.64, 0.66, 0.62], [0.50, 0.50, 0.50])
    b = _trained([0.27, 0.30, 0.24], [0.50, 0.50, 0.50])
    v = one({"kind": "greater", "a": "a", "b": "b", "metric": "PM acc"}, {"a": a, "b": b})
    assert v.verdict in ("held", "inconclusive") and not math.isnan(v.p)  # tested, not gated
    assert "; b ended below its round-0 PM acc (0.5000 → 0.2700, more than its seed spread 0.0300); Holm" in v.evidence
    up = _trained([0.60, 0.61, 0.59], [0.50, 0.50, 0.50])  # rose: no note
    assert "ended below" not in one({"kind": "greater", "a": "a", "b": "b", "metric": "PM acc"},
                                    {"a": a, "b": up}).evidence
    gap = {"kind": "gap_greater", "a1": "a", "b1": "b", "a2": "a", "b2": "u", "metric": "PM acc"}
    assert one(gap, {"a": a, "b": b, "u": up}).evidence.count("ended below") == 1


def test_the_page_is_decided_together():
    """Two claims at p = .03 each: alone each holds; together Holm makes both .06, inconclusive."""
    vs = [V.Verdict(None, "x", 0.03, 1), V.Verdict(None, "y", 0.03, -1), V.Verdict("held", "bytes")]
    V.decide_all(vs)
    assert [v.verdict for v in vs] == ["inconclusive", "inconclusive", "held"]
    assert vs[0].adjusted == pytest.approx(0.06) and vs[0].evidence == "x; Holm-adjusted p = 0.06"
    note = V.family_note(vs + [V.Verdict(V.NO_SIGNAL, "")])
    assert note.startswith("2 claims were tested together") and "at most 0.05 × 2 = 0.10" in note
    assert note.endswith("1 claims were not tested because a compared row did not learn.")
    # 3 seeds, 2 claims: p ≤ .025 at 2 df; by the closed form 1 − t/√(t² + 2) = .025,
    # t = √2 · .975 / √(1 − .975²) = 6.2053
    with3 = V.family_note(vs, seeds=3)
    assert with3.endswith("With 3 seeds a paired t-test has 2 degrees of freedom, and the strictest Holm step "
                          "needs p ≤ 0.05/2 = 0.025, a t of at least 6.2: an inconclusive verdict here says mostly "
                          "that the seeds are too few to decide, not that the rows tie.")
    assert S.t_needed(0.025, 3) == pytest.approx(math.sqrt(2) * 0.975 / math.sqrt(1 - 0.975 ** 2), rel=1e-9)
