"""Every benchmark still runs (issue 46: benchmarks/overheads.py had drifted from the API it times,
and nothing noticed). Each script's `--quick` mode is a smoke run on tiny random models; here it
runs in a subprocess, writing its table into a temporary folder (FEDSPLICE_BENCH_RESULTS), never
into benchmarks/results/. Times mean nothing at this size, so nothing here asserts one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
# Scripts that are not benchmarks of their own: flower_tutorial is round_time's Flower-tutorial-style
# baseline (run by `round_time.py --quick`).
HELPERS = {"flower_tutorial"}
# A quick mode of one script that writes another table name than the script's: privacy --dpsgd;
# results_budget --like, which counts one experiment's runs at another's time
EXTRA = {"privacy": [["--dpsgd"]], "results_budget": [["--like", "lt-fedpurel-prompt=pf-fedavg"]]}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem not in HELPERS)
RUNS = [(s, a) for s in SCRIPTS for a in [[], *EXTRA.get(s, [])]]


def test_every_benchmark_has_a_quick_mode():
    missing = [s for s in SCRIPTS if "--quick" not in (BENCH / f"{s}.py").read_text()]
    assert not missing, f"benchmarks without a --quick smoke mode (tests/test_benchmarks.py runs each): {missing}"


@pytest.mark.integration
@pytest.mark.timeout(600)
@pytest.mark.parametrize("script, args", RUNS, ids=[" ".join([s, *a]) for s, a in RUNS])
def test_the_quick_mode_runs_and_writes_its_table(tmp_path, script, args):
    env = {**os.environ, "FEDSPLICE_BENCH_RESULTS": str(tmp_path)}
    r = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--quick", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=590)
    assert r.returncode == 0, (r.stdout[-3000:] + "\n" + r.stderr[-3000:])
    tables = sorted(tmp_path.glob("*-quick.md"))
    assert tables, f"{script} --quick wrote no table into FEDSPLICE_BENCH_RESULTS"
    for t in tables:
        text = t.read_text()
        assert text.startswith(f"# benchmarks/{script}.py --quick") and "| " in text, text[:500]
        assert (t.with_suffix(".csv")).exists()


@pytest.mark.integration  # importing a benchmark asks git for the commit (a process)
def test_results_budget_plans_one_representative_per_experiment_and_counts_every_run(tmp_path):
    """benchmarks/results_budget.py's estimate multiplies one run by the runs it stands for: the
    counts must add up to every run the suite plans, and each representative must be a run of its
    own experiment (a validation run of a tuned one)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.results_budget import plan

    from fedsplice.study.results import load_suite, plan_suite
    from fedsplice.study.tuning import plan_tuning

    path = ROOT / "configs" / "results" / "suite.toml"
    rows, reps = plan(path, tmp_path, [], [])
    suite = load_suite(path)
    n_measured, n_tune = len(plan_suite(suite, tmp_path)), len(plan_tuning(suite, tmp_path))
    by_kind = {k: sum(r["planned runs"] for r in rows if r["kind"] == k) for k in ("measured", "validation")}
    assert by_kind == {"measured": n_measured, "validation": n_tune}
    assert sorted(r["experiment"] for r in rows if r["kind"] == "measured") == sorted(suite.experiments)
    for row, (label, seed, cfg, d) in zip(rows, reps):
        assert label.split("--")[0] == row["experiment"] and seed == cfg.seed
        assert (cfg.eval.on == "validation") == (row["kind"] == "validation") and tmp_path in d.parents
    six = next(r for r in rows if r["experiment"] == "pf-pfadapter" and r["kind"] == "measured")
    assert six["planned runs"] == suite.experiment_seeds("pf-pfadapter") == 6
