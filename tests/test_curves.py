"""fedsplice.study.curves: a run's curves from its metrics.jsonl and the signs that training went
wrong, on hand-written files with hand-computed expectations."""

import json
import math

from fedsplice.study import curves as K


def run(tmp_path, name, lines, raw=()):
    """A run folder whose metrics.jsonl has `lines` (dicts), then the `raw` text lines."""
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("\n".join([*(json.dumps(x) for x in lines), *raw]) + "\n")
    return d


def ev(round_, pm, gm=0.5, loss=None):
    """An evaluation round's line (round 0 has no train_loss)."""
    rec = {"round": round_, "gm": {"accuracy": gm}, "pm": {"accuracy": pm, "f1_macro": pm / 2}}
    return rec if loss is None else {**rec, "train_loss": loss, "clients": [0, 1]}


def rounds(losses, evals, first=1):
    """Training rounds first.. with `losses`; evals {round: pm} evaluated there (and at 0)."""
    out = [ev(0, evals[0])]
    for t, loss in enumerate(losses, start=first):
        out.append(ev(t, evals[t], loss=loss) if t in evals else {"round": t, "clients": [0, 1], "train_loss": loss})
    return out


def test_history_reads_evaluations_and_losses(tmp_path):
    assert K.history(tmp_path) is None  # no metrics.jsonl
    lines = [ev(0, 0.3), {"round": 1, "train_loss": 2.0}, {"round": 2, "train_loss": 1.5},
             ev(3, 0.5, loss=1.2), {"round": 4, "clients": [1]}, {"round": 5, "train_loss": None},
             ev(6, 0.6, loss=1.0)]
    h = K.history(run(tmp_path, "a", lines, raw=["", '{"round": 7, "train_lo']))  # blank, torn last line
    assert h is not None
    assert h.rounds == (0, 3, 6)
    assert h.evals[1] == {"gm": {"accuracy": 0.5}, "pm": {"accuracy": 0.5, "f1_macro": 0.25}}
    assert h.losses == ((1, 2.0), (2, 1.5), (3, 1.2), (6, 1.0))  # rounds 4, 5 logged none
    assert K.curve(h, "PM acc") == [(0, 0.3), (3, 0.5), (6, 0.6)]
    assert K.curve(h, "PM F1") == [(0, 0.15), (3, 0.25), (6, 0.3)]
    assert K.curve(h, "GM acc") == [(0, 0.5), (3, 0.5), (6, 0.5)]
    assert K.curve(h, "up B total") == [] and K.curve(h, "GM few") == []  # not in the evaluations


def test_a_round_logged_twice_keeps_its_last_line(tmp_path):
    """A resumed run re-ran round 2 (the second line wins); FedPuReL's personalization line
    repeats the last round with its PM after phase 2: the round keeps its train_loss."""
    lines = [ev(0, 0.3), {"round": 1, "train_loss": 2.0}, ev(2, 0.4, loss=1.9), ev(2, 0.45, loss=1.7),
             {"round": 3, "train_loss": 1.6}, ev(4, 0.5, loss=1.4),
             {"round": 4, "phase": "personalization", "gm": {"accuracy": 0.5}, "pm": {"accuracy": 0.62}}]
    h = K.history(run(tmp_path, "r", lines))
    assert h is not None
    assert K.curve(h, "PM acc") == [(0, 0.3), (2, 0.45), (4, 0.62)]
    assert h.losses == ((1, 2.0), (2, 1.7), (3, 1.6), (4, 1.4))
    assert h.evals[-1]["pm"] == {"accuracy": 0.62}  # the phase line's dict, whole


def test_loss_rose_compares_the_means_of_the_first_and_last_rounds(tmp_path):
    def h(name, losses):
        got = K.history(run(tmp_path, name, rounds(losses, {0: 0.1})))
        assert got is not None
        return got

    # 8 rounds, k = 3: (2 + 1 + 1) / 3 = 1.333 -> (3 + 3 + 3) / 3 = 3
    assert K.loss_rose(h("up", [2, 1, 1, 1, 1, 3, 3, 3])) == "training loss 1.33 → 3.00 (mean of first/last 3 rounds)"
    # the last round is above the first, but the means fell: (1 + 3 + 3) / 3 = 2.33 -> (1 + 1 + 1.5) / 3
    assert K.loss_rose(h("noisy", [1.0, 3.0, 3.0, 1.0, 1.0, 1.5])) is None
    # 4 rounds, k = 2: (1 + 2) / 2 = 1.5 -> (1.5 + 1.6) / 2 = 1.55
    assert K.loss_rose(h("four", [1.0, 2.0, 1.5, 1.6])) == "training loss 1.50 → 1.55 (mean of first/last 2 rounds)"
    # 3 rounds, k = 1: 1 -> 2; digits enough to tell close values apart
    assert K.loss_rose(h("three", [1.0, 5.0, 2.0])) == "training loss 1.00 → 2.00 (mean of first/last round)"
    assert K.loss_rose(h("close", [1.0, 1.001])) == "training loss 1.000 → 1.001 (mean of first/last round)"
    assert K.loss_rose(h("nan", [1.0, 1.0, math.nan])) == "training loss 1.00 → nan (mean of first/last round)"
    assert K.loss_rose(h("flat", [1.0, 1.0])) is None  # not above
    assert K.loss_rose(h("one", [1.0])) is None  # nothing to compare
    assert K.loss_rose(h("none", [])) is None


def test_fell_at_end_compares_the_last_two_evaluations(tmp_path):
    def h(name, evals):
        got = K.history(run(tmp_path, name, rounds([1.0] * 6, evals)))
        assert got is not None
        return got

    assert K.fell_at_end(h("fell", {0: 0.4, 3: 0.6, 6: 0.55}), "PM acc") == "PM acc fell 0.600 → 0.550 (round 3 → 6)"
    assert K.fell_at_end(h("rose", {0: 0.4, 3: 0.6, 6: 0.65}), "PM acc") is None
    assert K.fell_at_end(h("flat", {0: 0.4, 3: 0.6, 6: 0.6}), "PM acc") is None
    assert K.fell_at_end(h("once", {0: 0.4}), "PM acc") is None
    assert K.fell_at_end(h("gm", {0: 0.4, 3: 0.6, 6: 0.55}), "GM acc") is None  # GM is flat at 0.5


def test_diverged_over_seeds(tmp_path):
    def hs(name, *seeds):
        out = []
        for i, (losses, pms) in enumerate(seeds):
            h = K.history(run(tmp_path, f"{name}-{i}", rounds(losses, dict(zip((0, 3, 6), pms)))))
            assert h is not None
            out.append(h)
        return out

    flat = [1.0] * 6
    assert K.diverged([], "PM acc") is None
    # the mean loss over seeds: (1 + 2) / 2 = 1.5 at the start, (3 + 2) / 2 = 2.5 at the end
    up = hs("loss", ([1, 1, 1, 3, 3, 3], [0.4, 0.5, 0.6]), ([2] * 6, [0.4, 0.5, 0.6]))
    assert K.diverged(up, "PM acc") == "training loss 1.50 → 2.50 (mean of first/last 3 rounds, mean over 2 seeds)"
    # one seed's loss rose, the other's fell as much: the mean is flat
    assert K.diverged(hs("even", ([1, 1, 1, 2, 2, 2], [0.4, 0.5, 0.6]), ([2, 2, 2, 1, 1, 1], [0.4, 0.5, 0.6])),
                      "PM acc") is None
    # every seed rose above round 0, then fell at the last evaluation: means 0.5, peak 0.8, last 0.7
    fall = hs("fall", (flat, [0.4, 0.7, 0.6]), (flat, [0.6, 0.9, 0.8]))
    assert K.diverged(fall, "PM acc") == ("PM acc rose then fell at the last evaluation on every seed: 0.500 at the "
                                          "first, peak 0.800, last 0.700 (round 6; means over 2 seeds)")
    assert K.diverged(fall, "GM acc") is None  # GM is flat
    # a fall on one seed only; a fall with no rise before it (below round 0 all along)
    assert K.diverged(hs("one", (flat, [0.4, 0.7, 0.6]), (flat, [0.6, 0.9, 0.95])), "PM acc") is None
    assert K.diverged(hs("down", (flat, [0.6, 0.5, 0.4]), (flat, [0.6, 0.5, 0.4])), "PM acc") is None
    both = hs("both", ([1, 1, 1, 2, 2, 2], [0.4, 0.7, 0.6]))
    assert K.diverged(both, "PM acc") == (
        "training loss 1.00 → 2.00 (mean of first/last 3 rounds, mean over 1 seed); PM acc rose then fell at the "
        "last evaluation on every seed: 0.400 at the first, peak 0.700, last 0.600 (round 6; means over 1 seed)")
