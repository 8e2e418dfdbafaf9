"""Hyperparameters a results suite chooses on a validation split before its measured runs.

An experiment of a suite may carry `tune = {key = "server.lr", values = [...], metric = "GM acc"}`:
each value runs (on `seeds` seeds, default 1) with `eval.on = "validation"`, which evaluates on
training samples held out of training (`fedsplice.federation.experiment.apply_validation`) and
never reads the test set; the value with the best mean metric (the first on a tie) is appended
to the experiment's overrides, and the page records every score. `tune_from = "<experiment>"`
(or a list of them) reuses the values chosen for other experiments (the same method on other
data; an ablation that takes its server optimizer's η and its method's client lr): a key the
experiment tunes itself is not taken, and where two sources tune a key the last one's is used.
A tuned experiment's own validation runs already use its sources' values: the suite tunes in
stages (`stages`), each after the ones it takes values from. Runs live under
OUT/tune/runs/<experiment>--<value>/seed-<s>, so a stopped suite resumes here too.

A group's `tune_set = [...]` adds overrides to its validation runs only (the results suite's
groups draw 100 local validation items a client, not the measured runs' 300: they come from a
190-item hold-out, so more would repeat items and only cost evaluation time).

Several keys tune together as a grid: `tune = {grid = {"server.lr" = [...], "server.tau" = [...]},
metric = "PM acc"}` runs every combination (FedYogi's η with its τ); its runs are labelled
<experiment>--<v1>,<v2>.

A setting must also have trained stably (`fedsplice.study.curves`, read from its runs'
metrics.jsonl): one whose validation curve (the tune metric, mean over its seeds at each
evaluation) falls by more than 0.01 between its last two evaluations, or whose training loss ends
above its start (mean over seeds; start and end the means of the first and last 3 rounds), is
*unstable* and not chosen; the best stable setting is (the first on a tie). Where no setting is stable the best is
chosen anyway, and the record and the page say so. Every unstable setting's reason is recorded
and shown next to its score. A chosen value on the smallest or largest of its key's values is
marked (the best may lie outside the grid); `edge_reason = "..."` in the tune table states why
that is acceptable, and the marker then carries it. `seeds` (default 1) must be an integer >= 1.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from fedsplice.app import compare as C
from fedsplice.errors import ConfigError
from fedsplice.study import curves as K


def check_tune(path: Path, name: str, tune: dict, columns: set[str]) -> None:
    if "grid" in tune:
        g = tune["grid"]
        if not (isinstance(g, dict) and g and all(isinstance(v, list) and v for v in g.values())
                and len(combos(tune)) >= 2):
            raise ConfigError(f"{path}: experiment {name!r}: tune.grid must map keys to lists of values, with at "
                              f"least 2 combinations (e.g. grid = "
                              f"{{\"server.lr\" = [0.01, 0.1], \"server.tau\" = [0.001]}})")
    else:
        for k in ("key", "values"):
            if k not in tune:
                raise ConfigError(f"{path}: experiment {name!r}: tune needs `{k}` (e.g. tune = {{key = \"server.lr\", "
                                  f"values = [0.001, 0.01, 0.1], metric = \"GM acc\"}}), or a `grid`")
        if not isinstance(tune["values"], list) or len(tune["values"]) < 2:
            raise ConfigError(f"{path}: experiment {name!r}: tune.values must list at least 2 values")
    seeds = tune.get("seeds", 1)
    if not isinstance(seeds, int) or isinstance(seeds, bool) or seeds < 1:
        raise ConfigError(f"{path}: experiment {name!r}: tune.seeds must be an integer >= 1, got {seeds!r}")
    reason = tune.get("edge_reason", "x")
    if not isinstance(reason, str) or not reason.strip() or "\n" in reason:
        raise ConfigError(f"{path}: experiment {name!r}: tune.edge_reason must be a one-line text saying why a "
                          f"value on the grid's edge is fine, got {reason!r}")
    if tune.get("metric", "GM acc") not in columns:
        raise ConfigError(f"{path}: experiment {name!r}: tune.metric {tune.get('metric')!r} is unknown; "
                          f"one of {', '.join(sorted(columns))}")


def sources(e: dict) -> list[str]:
    """The experiments whose tuned values `e` takes (`tune_from`: a name or a list of names)."""
    src = e.get("tune_from", [])
    return [src] if isinstance(src, str) else list(src)


def keys(tune: dict) -> list[str]:
    return list(tune["grid"]) if "grid" in tune else [tune["key"]]


def combos(tune: dict) -> list[tuple]:
    """Every value tuple to try, in order (one value per key)."""
    if "grid" not in tune:
        return [(v,) for v in tune["values"]]
    return list(itertools.product(*tune["grid"].values()))


def _sets(tune: dict, combo: tuple) -> list[str]:
    return [f"{k}={v}" for k, v in zip(keys(tune), combo)]


def stages(suite) -> list[list[str]]:
    """The tuned experiments in the order their validation runs can be planned: an experiment
    whose `tune_from` names another tuned experiment runs its grid at that one's chosen values
    (FedYogi's η at FedAvg-LoRA's chosen client lr, not at its config's), so it comes a stage later."""
    left = [n for n, e in suite.experiments.items() if "tune" in e]
    done: set[str] = set()
    out = []
    while left:
        ready = [n for n in left if all(s in done for s in sources(suite.experiments[n]))]
        if not ready:
            raise ConfigError(f"tune_from forms a cycle among {', '.join(left)}; one of them must tune first")
        out.append(ready)
        done.update(ready)
        left = [n for n in left if n not in done]
    return out


def plan_tuning(suite, out: Path, names: list[str] | None = None) -> list[tuple]:
    """The validation runs of the tuned experiments `names` (default: all): (label, seed, cfg,
    dir) as compare plans them, on each experiment's own `tune.seeds` (default 1), with the
    overrides it has so far (its sources' chosen values once `inherit` added them)."""
    runs: list[tuple] = []
    for name, e in suite.experiments.items():
        if "tune" not in e or (names is not None and name not in names):
            continue
        t = e["tune"]
        g = suite.groups[e["group"]]  # tune_set: the group's overrides for validation runs only
        base = [*g.get("set", []), *g.get("tune_set", []), *e.get("set", [])]
        entries = [(_label(name, c), Path(e["config"]), [*base, *_sets(t, c), "eval.on=validation"])
                   for c in combos(t)]
        runs += C.plan_entries(entries, int(t.get("seeds", 1)), Path(out) / "tune")
    return runs


def _show(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def _label(name: str, combo: tuple) -> str:
    return f"{name}--{','.join(map(_show, combo))}"


# A validation curve "falls" when it loses more than a point: the validation splits hold 190 items
# (10 a class, 19 classes), so smaller falls are one or two items and happen to stable runs too.
FELL_TOL = 0.01


def unstable(run_dirs: list[Path], metric: str) -> str | None:
    """Why a setting (the run folders of its seeds) is unstable, in short ("fell 0.610 → 0.550",
    "loss rose 1.45 → 2.10"), or None: its validation curve, the mean over seeds at each
    evaluation, falls by more than FELL_TOL between its last two evaluations, or its training
    loss, the mean over seeds at each round, ends above its start (`curves.loss_rose`'s rule).
    Runs without a metrics.jsonl are not read."""
    hs = [h for d in run_dirs if (h := K.history(d)) is not None]
    reasons = []
    if (drop := K.last_fall(K.mean_curve(hs, metric), FELL_TOL)) is not None:
        reasons.append(f"fell {K.pair(*drop)}")
    ends = K.loss_ends([v for _, v in K.mean_losses(hs)])
    if K.rose(ends):
        assert ends is not None
        reasons.append(f"loss rose {K.pair(ends[0], ends[1], 2)}")
    return ", ".join(reasons) or None


def apply_tuning(suite, runs: list[tuple], results: list[dict], value) -> dict[str, dict]:
    """`choose` for every tuned experiment, then `inherit` for every experiment (one stage: the
    validation runs given were planned before any choice)."""
    chosen = choose(suite, [n for n, e in suite.experiments.items() if "tune" in e], runs, results, value)
    inherit(suite, chosen, list(suite.experiments))
    return chosen


def choose(suite, names: list[str], runs: list[tuple], results: list[dict], value) -> dict[str, dict]:
    """Choose each tuned experiment of `names` from its validation runs (`value(result, metric)`
    reads a metric; a run's folder, its 4th item, its metrics.jsonl), add it to the experiment's
    overrides, and return {experiment: {keys, metric, scores {combo: mean}, chosen, unstable
    {combo: short reason} (every unstable setting), none_stable (True where no stable setting had
    a score, so that `chosen` is the best unstable one), edge_reason (the tune table's, or None)}}."""
    by_label: dict[str, list[dict]] = {}
    dirs: dict[str, list[Path]] = {}
    for r, res in zip(runs, results):
        by_label.setdefault(r[0], []).append(res)
        dirs.setdefault(r[0], []).append(Path(r[3]))
    chosen = {}
    for name in names:
        e = suite.experiments[name]
        t, metric = e["tune"], e["tune"].get("metric", "GM acc")
        scores, order = {}, combos(t)
        for c in order:
            got = [value(res, metric) for res in by_label[_label(name, c)]]
            scores[c] = float(np.nanmean([np.nan if x is None else x for x in got]))
        if all(np.isnan(v) for v in scores.values()):
            raise ConfigError(f"tune of {name!r}: no validation run reports {metric!r}; choose a metric its "
                              f"runs report (tune.metric)")
        bad = {c: why for c in order if (why := unstable(dirs[_label(name, c)], metric))}
        stable = [c for c in order if c not in bad and not np.isnan(scores[c])]
        best = max(stable or order,
                   key=lambda c: (scores[c] if not np.isnan(scores[c]) else -np.inf, -order.index(c)))
        e["set"] = [*e.get("set", []), *_sets(t, best)]
        chosen[name] = {"keys": keys(t), "metric": metric, "scores": scores, "chosen": best, "unstable": bad,
                        "none_stable": not stable, "edge_reason": t.get("edge_reason")}
    return chosen


def inherit(suite, chosen: dict[str, dict], names: list[str]) -> None:
    """tune_from: add the values chosen for an experiment's sources to its overrides, never over a
    key it tunes itself; where two sources tune a key the last one's is used."""
    for name in names:
        e = suite.experiments[name]
        own = set(keys(e["tune"])) if "tune" in e else set()
        for src in sources(e):
            ch = chosen[src]
            e["set"] = [*e.get("set", []), *(f"{k}={v}" for k, v in zip(ch["keys"], ch["chosen"]) if k not in own)]


def edge(c: dict) -> str:
    """" (edge of the grid: …)" where a chosen value is a key's smallest or largest: the best may
    lie outside the grid; with the tune table's `edge_reason`, " (edge of the grid: …: <reason>)"."""
    keys_ = [k for i, k in enumerate(c["keys"]) if len({v[i] for v in c["scores"]}) > 1
             and c["chosen"][i] in (min(v[i] for v in c["scores"]), max(v[i] for v in c["scores"]))]
    why = f": {_cell(c['edge_reason'])}" if c.get("edge_reason") else ""
    return f" (edge of the grid: {', '.join(keys_)}{why})" if keys_ else ""


def _cell(text: str) -> str:
    """Text for a markdown table cell (a "|" would end the cell)."""
    return text.replace("|", "\\|")


NONE_STABLE = "**no setting was stable: the best unstable one is used**"


def tuning_section(chosen: dict[str, dict], labels: dict[str, str]) -> str:
    if not chosen:
        return ""
    md = ["## Hyperparameters chosen on a validation split", "",
          "Each value ran with `eval.on = \"validation\"` (evaluated on training samples held out of training; "
          "the test set is not read); the best mean is used in every measured run of the experiment. A setting "
          "is *unstable*, and not chosen, when its validation curve (mean over seeds) falls by more than 0.01 "
          "between its last two evaluations or its training loss (mean over seeds) ends above its start (means of "
          "the first and last 3 rounds); where no setting is stable the best is used anyway and the row says so.", "",
          "| experiment | key | metric | validation score by value | chosen |", "|---|---|---|---|---|"]
    for name, c in chosen.items():
        bad = c.get("unstable", {})
        sc = ", ".join(f"{','.join(map(_show, v))}: {s:.3f}" + (f" (unstable: {bad[v]})" if v in bad else "")
                       for v, s in c["scores"].items())
        warn = f" {NONE_STABLE}" if c.get("none_stable") else ""
        md.append(f"| {labels.get(name, name)} | `{'`, `'.join(c['keys'])}` | {c['metric']} | {sc} | "
                  f"**{', '.join(map(_show, c['chosen']))}**{edge(c)}{warn} |")
    return "\n".join(md) + "\n"
