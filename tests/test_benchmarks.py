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
# A quick mode of one script that writes another table name than the script's: privacy --dpsgd
EXTRA = {"privacy": [["--dpsgd"]]}
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
