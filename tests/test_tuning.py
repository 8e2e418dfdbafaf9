"""fedsplice.study.tuning's stability rule (a setting whose validation curve fell at its last
evaluation, or whose training loss ended above its start, is not chosen) and the tune table's
`edge_reason` and `seeds`, on hand-written validation runs (the grid's own runs and tune_from:
tests/test_results.py)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedsplice.errors import ConfigError
from fedsplice.study import results as R
from fedsplice.study import tuning as T


def write_run(d: Path, pm: list[float], losses: list[float]) -> Path:
    """A run folder: PM accuracy `pm` at rounds 0, 3, 6, ...; `losses` at rounds 1, 2, ..."""
    d.mkdir(parents=True)
    lines = [{"round": 0, "gm": {"accuracy": 0.5}, "pm": {"accuracy": pm[0]}}]
    for t, loss in enumerate(losses, start=1):
        lines.append({"round": t, "train_loss": loss, **({"gm": {"accuracy": 0.5}, "pm": {"accuracy": pm[t // 3]}}
                                                         if t % 3 == 0 else {})})
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


DOWN = [2.0, 2.0, 2.0, 1.0, 1.0, 1.0]  # the loss falls: (2 + 2 + 2) / 3 -> (1 + 1 + 1) / 3


def tune(tmp_path, runs: dict[float, list[tuple[list[float], list[float]]]], **extra):
    """apply_tuning over server.lr = the keys of `runs`, each value's seeds as (pm curve, losses);
    its score is the mean over seeds of the curve's last value."""
    t = {"key": "server.lr", "values": list(runs), "metric": "PM acc", **extra}
    suite = SimpleNamespace(experiments={"fl": {"tune": t, "set": ["server.optimizer=fedyogi"]}})
    planned, results = [], []
    for v, seeds in runs.items():
        for s, (pm, losses) in enumerate(seeds):
            label = f"fl--{v:g}"
            planned.append((label, s, None, write_run(tmp_path / label / f"seed-{s}", pm, losses)))
            results.append({"pm": {"accuracy": pm[-1]}})
    chosen = T.apply_tuning(suite, planned, results, lambda res, m: res["pm"]["accuracy"])
    return suite, chosen["fl"]


def test_a_setting_that_collapsed_at_its_last_evaluation_is_not_chosen(tmp_path):
    """0.1 scores best, but its validation curve (mean over seeds: 0.4, 0.8, 0.75) fell at the
    end: the next stable setting is chosen. 0.01 fell on one seed, not on the mean (0.7 -> 0.725)."""
    suite, c = tune(tmp_path, {0.001: [([0.4, 0.5, 0.6], DOWN)],
                               0.01: [([0.4, 0.6, 0.7], DOWN), ([0.4, 0.8, 0.75], DOWN)],
                               0.1: [([0.4, 0.9, 0.7], DOWN), ([0.4, 0.7, 0.8], DOWN)]})
    assert c["scores"] == pytest.approx({(0.001,): 0.6, (0.01,): 0.725, (0.1,): 0.75})
    assert c["chosen"] == (0.01,) and suite.experiments["fl"]["set"][-1] == "server.lr=0.01"
    assert c["unstable"] == {(0.1,): "fell 0.800 → 0.750"} and c["none_stable"] is False
    assert c["keys"] == ["server.lr"] and c["metric"] == "PM acc" and c["edge_reason"] is None
    md = T.tuning_section({"fl": c}, {"fl": "FedYogi"})
    assert ("| FedYogi | `server.lr` | PM acc | 0.001: 0.600, 0.01: 0.725, 0.1: 0.750 (unstable: fell 0.800 → "
            "0.750) | **0.01** |") in md
    assert "falls by more than 0.01 between its last two evaluations" in md and T.NONE_STABLE not in md


def test_a_setting_whose_loss_rose_is_not_chosen_and_ties_go_to_the_first(tmp_path):
    """The loss rule is on the mean over seeds: 0.1's seeds start at (1 + 3) / 2 = 2 and end at
    (3 + 3) / 2 = 3; 0.01's rose on one seed and fell as much on the other (flat)."""
    up, flat = [1.0, 1.0, 1.0, 3.0, 3.0, 3.0], [3.0] * 6
    _, c = tune(tmp_path, {0.001: [([0.4, 0.5, 0.6], DOWN), ([0.4, 0.5, 0.6], DOWN)],
                           0.01: [([0.4, 0.5, 0.6], up), ([0.4, 0.5, 0.6], [3.0, 3.0, 3.0, 1.0, 1.0, 1.0])],
                           0.1: [([0.4, 0.6, 0.9], up), ([0.4, 0.6, 0.9], flat)]})
    assert c["unstable"] == {(0.1,): "loss rose 2.00 → 3.00"}
    assert c["chosen"] == (0.001,)  # 0.001 and 0.01 tie at 0.6: the first in grid order
    assert T.edge(c) == " (edge of the grid: server.lr)"  # no reason given: the bare marker


def test_when_no_setting_is_stable_the_best_is_chosen_and_the_page_says_so(tmp_path):
    suite, c = tune(tmp_path, {0.01: [([0.4, 0.6, 0.5], DOWN)],
                               0.1: [([0.4, 0.8, 0.7], [1.0, 1.0, 1.0, 1.2, 1.2, 1.2])]})
    assert c["chosen"] == (0.1,) and suite.experiments["fl"]["set"][-1] == "server.lr=0.1"
    assert c["none_stable"] is True
    assert c["unstable"] == {(0.01,): "fell 0.600 → 0.500", (0.1,): "fell 0.800 → 0.700, loss rose 1.00 → 1.20"}
    md = T.tuning_section({"fl": c}, {})
    assert md.rstrip().endswith(f"| **0.1** (edge of the grid: server.lr) {T.NONE_STABLE} |")
    assert "0.1: 0.700 (unstable: fell 0.800 → 0.700, loss rose 1.00 → 1.20)" in md


def test_runs_without_metrics_are_stable(tmp_path):
    """A run folder without metrics.jsonl tells nothing about the curve: the score decides."""
    suite = SimpleNamespace(experiments={"fl": {"tune": {"key": "server.lr", "values": [1, 2]}}})
    runs = [(f"fl--{v}", 0, None, tmp_path / str(v)) for v in (1, 2)]
    c = T.apply_tuning(suite, runs, [{"gm": {"accuracy": a}} for a in (0.7, 0.6)],
                       lambda res, m: res["gm"]["accuracy"])["fl"]
    assert c["chosen"] == (1,) and c["unstable"] == {} and c["none_stable"] is False


def test_edge_reason_replaces_the_bare_marker(tmp_path):
    _, c = tune(tmp_path, {0.01: [([0.4, 0.5, 0.6], DOWN)], 0.1: [([0.4, 0.6, 0.7], DOWN)]},
                edge_reason="η above 0.1 diverges | see issue 47")
    assert c["chosen"] == (0.1,) and c["edge_reason"] == "η above 0.1 diverges | see issue 47"
    assert T.edge(c) == r" (edge of the grid: server.lr: η above 0.1 diverges \| see issue 47)"
    assert T.tuning_section({"fl": c}, {}).rstrip().endswith(
        r"| **0.1** (edge of the grid: server.lr: η above 0.1 diverges \| see issue 47) |")
    inside = {**c, "scores": {(1,): 0.1, (2,): 0.3, (3,): 0.2}, "chosen": (2,)}
    assert T.edge(inside) == ""  # not on the edge: the reason is not needed


@pytest.mark.parametrize("field, bad, match", [
    ("seeds", 0, r"tune.seeds must be an integer >= 1, got 0"),
    ("seeds", "2", r"tune.seeds must be an integer >= 1, got '2'"),
    ("seeds", True, r"tune.seeds must be an integer >= 1, got True"),
    ("seeds", 1.5, r"tune.seeds must be an integer >= 1, got 1.5"),
    ("edge_reason", "", r"tune.edge_reason must be a one-line text"),
    ("edge_reason", "  ", r"tune.edge_reason must be a one-line text"),
    ("edge_reason", 3, r"tune.edge_reason must be a one-line text .*, got 3"),
    ("edge_reason", "a\nb", r"tune.edge_reason must be a one-line text"),
])
def test_check_tune_rejects_bad_seeds_and_edge_reason(field, bad, match):
    t = {"key": "server.lr", "values": [0.1, 1.0], "metric": "PM acc"}
    T.check_tune(Path("suite.toml"), "fl", {**t, "seeds": 3, "edge_reason": "the loss diverges above 1"}, {"PM acc"})
    with pytest.raises(ConfigError, match=match) as err:
        T.check_tune(Path("suite.toml"), "fl", {**t, field: bad}, {"PM acc"})
    assert str(err.value).startswith("suite.toml: experiment 'fl': ") and "\n" not in str(err.value)


def test_a_fall_of_a_point_or_less_is_noise(tmp_path):
    """0.1 ends 0.008 below its previous evaluation (under two of 190 validation items): stable.
    0.01 scores higher but falls by 0.012 (0.72 -> 0.708): unstable, so 0.1 is chosen."""
    _, c = tune(tmp_path, {0.01: [([0.4, 0.72, 0.708], DOWN)], 0.1: [([0.4, 0.708, 0.7], DOWN)]})
    assert c["chosen"] == (0.1,) and c["unstable"] == {(0.01,): "fell 0.720 → 0.708"}


def test_each_experiment_tunes_on_its_own_seeds(tmp_path):
    """tune.seeds is the experiment's own: a 2-seed grid does not make a 1-seed one run twice."""
    cfg = Path("configs/fedavg-lora-minilm.toml").resolve()
    suite = tmp_path / "suite.toml"
    suite.write_text(f"""[groups.g]\ntitle = "g"\n
[[experiment]]\nname = "a"\ngroup = "g"\nconfig = "{cfg}"
tune = {{key = "client.lr", values = [0.001, 0.01], seeds = 2}}
[[experiment]]\nname = "b"\ngroup = "g"\nconfig = "{cfg}"
tune = {{key = "client.lr", values = [0.001, 0.01]}}
""")
    runs = T.plan_tuning(R.load_suite(suite), tmp_path / "out")
    assert sorted((r[0], r[1]) for r in runs) == [("a--0.001", 0), ("a--0.001", 1), ("a--0.01", 0), ("a--0.01", 1),
                                                  ("b--0.001", 0), ("b--0.01", 0)]
    # a group's tune_set reaches its validation runs only, before the experiment's own set
    suite.write_text(suite.read_text().replace('title = "g"', 'title = "g"\ntune_set = ["data.local_test_size=7"]'))
    loaded = R.load_suite(suite)
    assert {r[2].data.local_test_size for r in T.plan_tuning(loaded, tmp_path / "out")} == {7}
    assert {r[2].data.local_test_size for r in R.plan_suite(loaded, tmp_path / "out")} == {40}
    suite.write_text(suite.read_text().replace('tune_set = ["data.local_test_size=7"]', 'tune_set = "x"'))
    with pytest.raises(ConfigError, match=r"\[groups.g\] tune_set must list overrides"):
        R.load_suite(suite)


def test_a_dependent_grid_runs_at_its_sources_chosen_values(tmp_path):
    """FedYogi's η is tuned at FedAvg-LoRA's chosen client lr, not its config's: `b` (tune_from
    `a`) comes a stage later, and its validation runs carry a's choice; a cycle is an error."""
    cfg = Path("configs/fedavg-lora-minilm.toml").resolve()
    suite = tmp_path / "suite.toml"
    suite.write_text(f"""[groups.g]\ntitle = "g"\n
[[experiment]]\nname = "a"\ngroup = "g"\nconfig = "{cfg}"
tune = {{key = "client.lr", values = [0.001, 0.003], metric = "PM acc"}}
[[experiment]]\nname = "b"\ngroup = "g"\nconfig = "{cfg}"\ntune_from = "a"
tune = {{key = "server.lr", values = [0.1, 1.0], metric = "PM acc"}}
""")
    s = R.load_suite(suite)
    assert T.stages(s) == [["a"], ["b"]]
    first = T.plan_tuning(s, tmp_path / "out", ["a"])
    for r in first:
        write_run(Path(r[3]), [0.4, 0.5, 0.6], DOWN)
    score = {"a--0.001": 0.5, "a--0.003": 0.7}
    chosen = T.choose(s, ["a"], first, [{"pm": {"accuracy": score[r[0]]}} for r in first],
                      lambda res, m: res["pm"]["accuracy"])
    T.inherit(s, chosen, ["b"])
    assert {r[2].client.lr for r in T.plan_tuning(s, tmp_path / "out", ["b"])} == {0.003}
    s.experiments["a"]["tune_from"] = "b"
    with pytest.raises(ConfigError, match="tune_from forms a cycle among a, b"):
        T.stages(s)
