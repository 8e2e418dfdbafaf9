"""`fedsplice compare`: every config × seed, the same partition and sampling stream per seed,
one table of mean ± std over seeds, and plots (accuracy vs round and vs cumulative upload
bytes, GM balancedness vs round, per-class accuracy from head to tail classes).

Runs live in OUT/runs/<config stem>/seed-<s>. A run with a results.json is done and is not
run again; a run with checkpoints resumes from its last one; so an interrupted comparison,
started again with the same arguments, finishes only what was missing.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedsplice.app.rundir import atomic_write_text
from fedsplice.data.assets import atomic_write_bytes
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig

# (column, path into results.json); "—" where a run has no such value (no long tail, no PM)
METRICS = [("GM acc", ("gm", "accuracy")), ("GM F1", ("gm", "f1_macro")),
           ("GM many", ("gm", "many")), ("GM medium", ("gm", "medium")), ("GM few", ("gm", "few")),
           ("GM β", ("gm", "balancedness")),
           ("PM acc", ("pm", "accuracy")), ("PM F1", ("pm", "f1_macro")),
           ("PM many", ("pm", "many")), ("PM medium", ("pm", "medium")), ("PM few", ("pm", "few")),
           ("PM β", ("pm", "balancedness")),
           ("up B/round", ("communication", "up_bytes_per_round")), ("up B total", ("communication", "up_bytes"))]


def plan(configs: list[Path], seeds: int, overrides: list[str],
         out: Path) -> list[tuple[str, int, ExperimentConfig, Path]]:
    """(label, seed, config, run dir) for every run; configs are validated before anything runs."""
    stems = [Path(c).stem for c in configs]
    if len(set(stems)) != len(stems):
        raise ConfigError("compare: two configs share a file name; their runs would share a folder — rename one")
    return plan_entries([(stem, Path(c), list(overrides)) for c, stem in zip(configs, stems)], seeds, out)


def plan_entries(entries: list[tuple[str, Path, list[str]]], seeds: int,
                 out: Path) -> list[tuple[str, int, ExperimentConfig, Path]]:
    """Like `plan`, for (label, config path, overrides) entries: one config file can appear
    under several labels with different overrides (the variants of a results suite)."""
    from fedsplice.federation.validate import load_config

    if seeds < 1:
        raise ConfigError(f"compare: --seeds must be >= 1, got {seeds}")
    runs = []
    for label, path, overrides in entries:
        base = load_config(Path(path), overrides)
        for s in range(seeds):
            cfg = load_config(Path(path), [*overrides, f"seed={base.seed + s}"])
            if cfg.tracking.backends:  # each run its own tracking run, grouped under the comparison's folder
                cfg.tracking.group = cfg.tracking.group or Path(out).resolve().name
                cfg.tracking.name = cfg.tracking.name or f"{label}-seed-{cfg.seed}"
            runs.append((label, cfg.seed, cfg, Path(out) / "runs" / label / f"seed-{cfg.seed}"))
    return runs


class RunLines:
    """One run's progress as lines on stderr, `run 2/6 lora seed 1: round 3/10 evaluate: 40/140
    client tasks, 1:02 elapsed, ETA 2:15`: a `progress` for the runner. It pickles, so a --jobs
    worker prints its own run's lines (the workers share the terminal, one line at a time)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __call__(self, event: dict) -> None:
        from fedsplice.app.progress import progress_line

        self.say(progress_line(event))

    def data(self, line: str) -> None:
        """An echoed line of the runner: the data report's (sizes, split, drops, warnings) are
        said; its round lines are not, as the progress lines already give each round's result."""
        if not line.startswith("round "):
            self.say(line)

    def say(self, text: str) -> None:
        from fedsplice.app.console import console

        console.print(f"{self.prefix}: {text}", markup=False, highlight=False, soft_wrap=True)


def _one(cfg, d: Path, threads: int, lines: RunLines | None = None) -> dict:
    """One run, resumed from its checkpoints when it has any (also the body of a --jobs worker)."""
    from fedsplice.app.runner import resume_experiment, run_experiment
    from fedsplice.federation.checkpoint import DIRNAME

    if threads:  # a worker process: its share of the cores (runtime.threads, if set, wins)
        import torch

        torch.set_num_threads(threads)
    resume = (d / DIRNAME).exists()
    if lines is not None:  # the build (model, data) can take a while: say so first
        lines.say(f"{'resuming' if resume else 'starting'} in {d}")
    if resume:
        return resume_experiment(d, quiet=True, progress=lines)
    return run_experiment(cfg, d, overwrite=d.exists(), quiet=True, progress=lines,
                          echo=lines.data if lines is not None else None)


def exit_with_parent(parent: int) -> None:
    """A worker's initializer: a daemon thread ends the worker once its parent is gone (a `kill`
    of `fedsplice compare/results` would otherwise leave its runs going, writing where a restarted
    suite resumes)."""
    import os
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(143)

    threading.Thread(target=watch, daemon=True).start()


def run_all(runs, quiet: bool = False, jobs: int = 1, on_done=None) -> list[dict]:
    """Run (or resume, or skip) every planned run; returns their results in plan order. Unless
    quiet, each run streams its progress lines (`RunLines`) and a line with its result.
    jobs > 1 runs that many at once, each in its own process with cores / jobs torch threads.
    `on_done(run)` is called as each run this call executes finishes."""
    import os
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from multiprocessing import get_context

    from fedsplice.app.console import console
    from fedsplice.app.progress import acc_text, clock

    if jobs < 1:
        raise ConfigError(f"compare: --jobs must be >= 1, got {jobs}")
    results: list[dict | None] = [None] * len(runs)
    todo = []
    for i, (_, _, _, d) in enumerate(runs):
        if (d / "results.json").exists():
            results[i] = json.loads((d / "results.json").read_text())
        else:
            todo.append(i)
    lines = {i: None if quiet else RunLines(f"run {n}/{len(todo)} {runs[i][0]} seed {runs[i][1]}")
             for n, i in enumerate(todo, 1)}
    t_start, done = time.perf_counter(), 0

    def report(i: int) -> None:
        if on_done is not None:
            on_done(runs[i])
        if quiet:
            return
        left, r, line = len(todo) - done, results[i], lines[i]
        assert r is not None and line is not None  # r: just stored; not quiet: every run has its lines
        eta = (time.perf_counter() - t_start) / done * left
        line.say(f"done in {clock(r['time_s'])} (GM acc {acc_text(r['gm']['accuracy'])}, PM acc "
                     f"{acc_text(r['pm']['accuracy'])}); {done}/{len(todo)} runs done"
                     + (f", ETA {clock(eta)} for the other {left}" if left else ""))

    if not quiet and len(todo) < len(runs):
        console.print(f"{len(runs) - len(todo)} of {len(runs)} runs already done; running the other {len(todo)}")
    if jobs == 1 or len(todo) <= 1:
        for i in todo:
            results[i] = _one(runs[i][2], runs[i][3], 0, lines[i])
            done += 1
            report(i)
        return cast(list[dict], results)  # every run has its result now
    threads = max(1, (os.cpu_count() or 1) // jobs)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=exit_with_parent,
                             initargs=(os.getpid(),)) as pool:
        futs = {pool.submit(_one, runs[i][2], runs[i][3], threads, lines[i]): i for i in todo}
        try:
            for f in as_completed(futs):
                i = futs[f]
                results[i] = f.result()
                done += 1
                report(i)
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return cast(list[dict], results)  # every run has its result now


def metric_at(r: dict, path: tuple) -> float | None:
    v: Any = r  # a dict until the last key: its value
    for k in path:
        if not isinstance(v, dict) or k not in v or v[k] is None:
            return None
        v = v[k]
    return float(v)


def summarize(runs, results) -> list[dict]:
    """One row per config: mean and std (over seeds, population std) of every metric."""
    rows: dict[str, dict] = {}
    for (label, *_), res in zip(runs, results):
        rows.setdefault(label, {"method": label, "algorithm": res["algorithm"], "seeds": []})["seeds"].append(res)
    out = []
    for row in rows.values():
        r = {"method": row["method"], "algorithm": row["algorithm"], "n_seeds": len(row["seeds"]),
             "random_weights": sorted({w for s in row["seeds"] for w in s.get("random_weights", [])})}
        for col, path in METRICS:
            vals = [v for v in (metric_at(s, path) for s in row["seeds"]) if v is not None]
            r[col] = (float(np.mean(vals)), float(np.std(vals))) if vals else None
        out.append(r)
    return out


# results.json "references" -> the algorithm that computes the same row on its own
REFERENCES = {"majority": "majority", "local_prior": "local-prior"}


def reference_rows(runs, results) -> list[dict]:
    """The majority-class and local-prior rows every run computed on its own split (no model, no
    traffic): one row each, mean over seeds, when every config shares its seed's split; else one
    per config. Left out where a compared config is that reference itself, or runs have none
    (per-site data; runs of an older fedsplice)."""
    if any(r.get("references") is None for r in results):
        return []
    labels = list(dict.fromkeys(label for label, *_ in runs))
    by_seed: dict[int, list] = {}
    for (_label, seed, *_), res in zip(runs, results):
        by_seed.setdefault(seed, []).append(res["references"])
    shared = all(all(r == refs[0] for r in refs) for refs in by_seed.values())
    out = []
    for key, algo in REFERENCES.items():
        if any(r["method"] == algo for r in results):
            continue
        for label in [None] if shared else labels:
            if shared:  # one per seed: the configs' copies are equal
                seeds = [refs[0][key] for refs in by_seed.values()]
            else:
                seeds = [res["references"][key] for (lab, *_), res in zip(runs, results) if lab == label]
            row = {"method": f"{algo} (reference{'' if shared else ', ' + str(label)})", "algorithm": algo,
                   "n_seeds": len(seeds), "random_weights": []}
            for col, path in METRICS:
                vals = [v for v in (metric_at(s, path) for s in seeds) if v is not None]
                row[col] = (float(np.mean(vals)), float(np.std(vals))) if vals else None
            out.append(row)
    return out


def write_tables(rows: list[dict], out: Path) -> None:
    cols = [c for c, _ in METRICS if any(r[c] is not None for r in rows)]
    def cell(v, col):  # noqa: E306
        if v is None:
            return "—"
        return f"{v[0]:,.0f} ± {v[1]:,.0f}" if col.startswith("up") else f"{v[0]:.3f} ± {v[1]:.3f}"
    md = ["| method | seeds | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    rnd = sorted({w for r in rows for w in r.get("random_weights", [])})
    mark = lambda r: " (random weights)" if r.get("random_weights") else ""  # noqa: E731
    md += [f"| {r['method']}{mark(r)} | {r['n_seeds']} | " + " | ".join(cell(r[c], c) for c in cols) + " |"
           for r in rows]
    note = "\n\nmean ± std over seeds (population std).\n"
    if rnd:
        note += f"\n**RANDOM WEIGHTS** ({', '.join(rnd)}): these numbers test the code path, not the methods.\n"
    atomic_write_text(out / "table.md", "\n".join(md) + note)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["method", "algorithm", "n_seeds", "random_weights"]
               + [f"{c} {s}" for c in cols for s in ("mean", "std")])
    for r in rows:
        w.writerow([r["method"], r["algorithm"], r["n_seeds"], "; ".join(r.get("random_weights", []))]
                   + [x for c in cols for x in (r[c] if r[c] is not None else ("", ""))])
    atomic_write_bytes(out / "table.csv", buf.getvalue().encode())


def _curves(runs) -> dict[str, list[list[dict]]]:
    """Per method, per seed: the evaluated rounds of metrics.jsonl with cumulative upload bytes."""
    out: dict[str, list[list[dict]]] = {}
    for label, _, _, d in runs:
        recs, up = [], 0
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "phase" in r:
                continue
            up += r.get("up_bytes", 0)
            if "gm" in r:
                recs.append({"round": r["round"], "up": up, "gm": r["gm"], "pm": r["pm"]})
        out.setdefault(label, []).append(recs)
    return out


def write_plots(runs, out: Path) -> list[str]:
    """accuracy vs round, accuracy vs cumulative upload bytes, GM balancedness vs round (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = _curves(runs)

    def mean_curve(seeds, x, y):
        n = min(len(s) for s in seeds)  # seeds of one config evaluate the same rounds
        xs = [seeds[0][i][x] if x == "round" else np.mean([s[i][x] for s in seeds]) for i in range(n)]
        ys = [np.mean([y(s[i]) for s in seeds]) for i in range(n)]
        return xs, ys

    specs = [("accuracy_vs_round.png", "round", "accuracy (solid GM, dashed PM)", True),
             ("accuracy_vs_bytes.png", "up", "GM accuracy", False)]
    written = []
    for fname, x, ylabel, with_pm in specs:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
        for label, seeds in curves.items():
            xs, ys = mean_curve(seeds, x, lambda r: r["gm"]["accuracy"])
            line, = ax.plot(xs, ys, "o-", label=label)
            if with_pm:
                xs, ys = mean_curve(seeds, x, lambda r: r["pm"]["accuracy"])
                ax.plot(xs, ys, "s--", color=line.get_color())
        ax.set_xlabel("round" if x == "round" else "cumulative upload bytes")
        if x == "round":
            ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]  # stubs: Locator
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(save_png(fig, out / fname))
    if all("balancedness" in s[0][0]["gm"] for s in curves.values() if s and s[0]):
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
        for label, seeds in curves.items():
            ax.plot(*mean_curve(seeds, "round", lambda r: r["gm"]["balancedness"]), "o-", label=label)
        ax.set_xlabel("round")
        ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]  # stubs: Locator
        ax.set_ylabel("GM balancedness β")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        written.append(save_png(fig, out / "balancedness_vs_round.png"))
    return written


def write_class_plot(runs, results, out: Path) -> str | None:
    """Final GM accuracy per class, classes ordered head to tail by global training count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per: dict[str, list] = {}
    for (label, *_), res in zip(runs, results):
        acc = res["gm"].get("class_accuracy")
        if acc is None:
            return None
        per.setdefault(label, []).append([np.nan if a is None else a for a in acc])
    order = np.argsort(-np.asarray(results[0]["train_counts"]), kind="stable")
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for label, accs in per.items():
        ax.plot(range(len(order)), np.nanmean(np.asarray(accs), axis=0)[order], "o-", ms=3, label=label)
    ax.set_xlabel("class, head (most training samples) to tail")
    ax.xaxis.get_major_locator().set_params(integer=True)  # type: ignore[call-arg]  # stubs: Locator
    ax.set_ylabel("GM accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_png(fig, out / "class_accuracy_head_to_tail.png")


def save_png(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return path.name


def compare(configs: list[Path], seeds: int, overrides: list[str], out: Path, quiet: bool = False,
            jobs: int = 1) -> list[dict]:
    runs = plan(configs, seeds, overrides, out)
    results = run_all(runs, quiet, jobs)
    rows = summarize(runs, results) + reference_rows(runs, results)
    out.mkdir(parents=True, exist_ok=True)
    write_tables(rows, out)
    write_plots(runs, out)
    write_class_plot(runs, results, out)
    return rows
