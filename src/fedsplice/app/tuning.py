"""Hyperparameters a results suite chooses on a validation split before its measured runs.

An experiment of a suite may carry `tune = {key = "server.lr", values = [...], metric = "GM acc"}`:
each value runs (on `seeds` seeds, default 1) with `eval.on = "validation"`, which evaluates on
training samples held out of training (`fedsplice.federation.experiment.apply_validation`) and
never reads the test set; the value with the best mean metric (the first on a tie) is appended
to the experiment's overrides, and the page records every score. `tune_from = "<experiment>"`
(or a list of them) reuses the values chosen for other experiments (the same method on other
data; an ablation that takes its server optimizer's η and its method's client lr): a key the
experiment tunes itself is not taken, and where two sources tune a key the last one's is used. Runs live under
OUT/tune/runs/<experiment>--<value>/seed-<s>, so a stopped suite resumes here too.

Several keys tune together as a grid: `tune = {grid = {"server.lr" = [...], "server.tau" = [...]},
metric = "PM acc"}` runs every combination (FedYogi's η with its τ); its runs are labelled
<experiment>--<v1>,<v2>.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from fedsplice.app import compare as C
from fedsplice.errors import ConfigError


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


def plan_tuning(suite, out: Path) -> list[tuple]:
    """The validation runs of every tuned experiment: (label, seed, cfg, dir) as compare plans them."""
    entries, seeds = [], 1
    for name, e in suite.experiments.items():
        if "tune" not in e:
            continue
        t = e["tune"]
        seeds = max(seeds, int(t.get("seeds", 1)))
        base = [*suite.groups[e["group"]].get("set", []), *e.get("set", [])]
        for c in combos(t):
            entries.append((_label(name, c), Path(e["config"]), [*base, *_sets(t, c), "eval.on=validation"]))
    return C.plan_entries(entries, seeds, Path(out) / "tune") if entries else []


def _show(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def _label(name: str, combo: tuple) -> str:
    return f"{name}--{','.join(map(_show, combo))}"


def apply_tuning(suite, runs: list[tuple], results: list[dict], value) -> dict[str, dict]:
    """Choose each tuned experiment's value from its validation runs (`value(result, metric)`
    reads a metric), add it to the experiment's overrides, and return {experiment: {key,
    metric, scores {value: mean}, chosen}}."""
    by_label: dict[str, list[dict]] = {}
    for r, res in zip(runs, results):
        by_label.setdefault(r[0], []).append(res)
    chosen = {}
    for name, e in suite.experiments.items():
        if "tune" not in e:
            continue
        t, metric = e["tune"], e["tune"].get("metric", "GM acc")
        scores, order = {}, combos(t)
        for c in order:
            got = [value(res, metric) for res in by_label[_label(name, c)]]
            scores[c] = float(np.nanmean([np.nan if x is None else x for x in got]))
        if all(np.isnan(v) for v in scores.values()):
            raise ConfigError(f"tune of {name!r}: no validation run reports {metric!r}; choose a metric its "
                              f"runs report (tune.metric)")
        best = max(order, key=lambda c: (scores[c] if not np.isnan(scores[c]) else -np.inf, -order.index(c)))
        e["set"] = [*e.get("set", []), *_sets(t, best)]
        chosen[name] = {"keys": keys(t), "metric": metric, "scores": scores, "chosen": best}
    for e in suite.experiments.values():  # tune_from: the values chosen for other experiments,
        own = set(keys(e["tune"])) if "tune" in e else set()  # but never over its own; the last source wins
        for src in sources(e):
            ch = chosen[src]  # (not `c`: above, a combo tuple)
            e["set"] = [*e.get("set", []), *(f"{k}={v}" for k, v in zip(ch["keys"], ch["chosen"]) if k not in own)]
    return chosen


def edge(c: dict) -> str:
    """" (edge of the grid: …)" where a chosen value is a key's smallest or largest: the best may
    lie outside the grid."""
    keys_ = [k for i, k in enumerate(c["keys"]) if len({v[i] for v in c["scores"]}) > 1
             and c["chosen"][i] in (min(v[i] for v in c["scores"]), max(v[i] for v in c["scores"]))]
    return f" (edge of the grid: {', '.join(keys_)})" if keys_ else ""


def tuning_section(chosen: dict[str, dict], labels: dict[str, str]) -> str:
    if not chosen:
        return ""
    md = ["## Hyperparameters chosen on a validation split", "",
          "Each value ran with `eval.on = \"validation\"` (evaluated on training samples held out of training; "
          "the test set is not read); the best mean is used in every measured run of the experiment.", "",
          "| experiment | key | metric | validation score by value | chosen |", "|---|---|---|---|---|"]
    for name, c in chosen.items():
        sc = ", ".join(f"{','.join(map(_show, v))}: {s:.3f}" for v, s in c["scores"].items())
        md.append(f"| {labels.get(name, name)} | `{'`, `'.join(c['keys'])}` | {c['metric']} | {sc} | "
                  f"**{', '.join(map(_show, c['chosen']))}**{edge(c)} |")
    return "\n".join(md) + "\n"
