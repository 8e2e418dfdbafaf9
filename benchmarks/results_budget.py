"""What `make results` costs from scratch on this machine, without running all of it.

    python benchmarks/results_budget.py [--quick] [--only EXPERIMENT ...] [--like VARIANT=BASE ...]
                                        [--out DIR] [--jobs 2]

The page's header sums the CPU time its records took, but records made on other machines and at
older commits (a run here took 157 s of CPU where its record took 600 s) bound nothing about a run
from scratch. This runs one representative of every experiment of configs/results/suite.toml as the
suite plans it from scratch: seed 0 of each measured experiment, and the first value (seed 0) of
each tuned experiment's validation grid, `--jobs` at once with one torch thread each, as `make
results` runs them. Each experiment's estimate is its representative's CPU time (process time)
times the runs the suite plans for it (its seeds; its grid's values times its tune seeds). The
estimate assumes that every seed and every grid value of an experiment costs what its
representative did: a learning rate changes no shape here, so it changes little.
`--like VARIANT=BASE` does not run VARIANT's representative of a kind and counts its runs at BASE's
CPU time instead (the table's "measured on" says so): for a variant whose settings change no shape
and no amount of work (a Dirichlet α, a loss weight, which roles are shared), when time is short.
Runs are resumable in --out (default runs/results-budget): a second invocation prints the table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import FP32, QUICK_BUDGET, ROOT, report, tiny_model  # noqa: E402


def plan(suite_path: Path, out: Path, only: list[str], extra: list[str]):
    """(rows, representatives): one row per experiment and kind with its planned run count, and
    the run that stands for it."""
    from fedsplice.study.results import load_suite, plan_suite
    from fedsplice.study.tuning import plan_tuning

    suite = load_suite(suite_path)
    names = [n for n in suite.experiments if not only or n in only]
    if only and len(names) != len(set(only)):
        sys.exit(f"results_budget: --only names no experiment of {suite_path}: "
                 f"{sorted(set(only) - set(names))}; pick from {list(suite.experiments)}")
    for n in names:  # the quick mode's tiny model and budget win over the suite's own settings
        suite.experiments[n]["set"] = [*suite.experiments[n].get("set", []), *extra]
    rows, reps = [], []
    for kind, runs in (("validation", plan_tuning(suite, out, names)),
                       ("measured", plan_suite(suite, out, only=names))):
        for n in names:
            mine = [r for r in runs if (r[0].split("--")[0] if kind == "validation" else r[0]) == n]
            if mine:
                group = suite.experiments[n]["group"]
                rows.append({"experiment": n, "kind": kind, "planned runs": len(mine), "group": group})
                reps.append(mine[0])
    return rows, reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=str(ROOT / "configs/results/suite.toml"))
    ap.add_argument("--out", default=str(ROOT / "runs/results-budget"))
    ap.add_argument("--only", action="append", default=[], help="an experiment of the suite (repeatable)")
    ap.add_argument("--like", action="append", default=[], metavar="VARIANT=BASE",
                    help="count VARIANT's runs at BASE's measured CPU time (repeatable)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once, as the suite's `jobs` (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny random model, a one-round budget (a smoke run)")
    args = ap.parse_args()
    from fedsplice.app.compare import run_all

    with tempfile.TemporaryDirectory() as tmp:
        extra, only, out = [], args.only, Path(args.out)
        if args.quick:
            extra = [*FP32, *QUICK_BUDGET, f"model.name='{tiny_model('zoo:minilm', Path(tmp))}'"]
            only, out = only or ["pf-fedavg", "lt-fedpurel-prompt"], Path(tmp) / "out"
        rows, reps = plan(Path(args.suite), out, only, extra)
        if not all("=" in pair for pair in args.like):
            sys.exit(f"results_budget: --like takes VARIANT=BASE, got {args.like}")
        like = dict(pair.split("=", 1) for pair in args.like)
        mine = {(r["experiment"], r["kind"]): i for i, r in enumerate(rows)}
        found = [mine.get((like.get(r["experiment"], r["experiment"]), r["kind"])) for r in rows]
        bad = [f"{r['experiment']}={like[r['experiment']]}" for r, i in zip(rows, found) if i is None]
        bad += [f"{v}={b}" for v, b in like.items() if v not in {r["experiment"] for r in rows}]
        if bad:
            sys.exit(f"results_budget: --like {bad}: VARIANT and BASE must be planned experiments, "
                     "BASE with VARIANT's kinds")
        stand = [i for i in found if i is not None]
        todo = sorted(set(stand))
        t0 = time.perf_counter()
        results = dict(zip(todo, run_all([reps[i] for i in todo], jobs=args.jobs)))
        wall = time.perf_counter() - t0
    for row, i in zip(rows, stand):
        r = results[i]
        row["measured on"] = rows[i]["experiment"]
        row["CPU s (its representative)"] = r["cpu_s"]
        row["CPU min (all its runs)"] = r["cpu_s"] * row["planned runs"] / 60
    total = sum(r["CPU min (all its runs)"] for r in rows) / 60
    by: dict[str, float] = {}
    for r in rows:
        k = f"{r['group']} {r['kind']}"
        by[k] = by.get(k, 0.0) + r["CPU min (all its runs)"] / 60
    rows.sort(key=lambda r: -r["CPU min (all its runs)"])
    notes = [f"{len(results)} representatives ran in {wall / 60:.1f} min of wall time, {args.jobs} at once"
             " (0 if an earlier invocation had run them all)",
             f"estimated CPU time from scratch: {total:.2f} h ({', '.join(f'{k} {v:.2f} h' for k, v in by.items())});"
             f" with {args.jobs} runs at once about {total / args.jobs:.2f} h, if the queue keeps both busy",
             "planned runs: every seed of a measured experiment; every value x tune seed of a validation grid"]
    report("results_budget", rows, ["experiment", "kind", "planned runs", "measured on", "CPU s (its representative)",
                                    "CPU min (all its runs)"], args.quick, notes)


if __name__ == "__main__":
    main()
