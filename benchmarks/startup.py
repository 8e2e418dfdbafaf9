"""Start-up: how long a user waits before fedsplice does the work asked for.

    python benchmarks/startup.py [--quick] [--reps N]

Each measurement is a fresh `fedsplice` process (the venv's console script, as a user runs it),
wall clock from launch, the minimum over --reps runs (5; --quick: 3), so a busy moment of the
machine does not count:
  validate --no-data        the embedded default config, checked alone;
  validate 5,000-row CSV    the default config on a CSV made here like a user's file (labels
                            `great` / `other` about 2:1, a `split` column, 10-40 word texts);
  run pfadapter-minilm      configs/pfadapter-minilm.toml with server.rounds = 3 (once): set-up
                            (launch until round 0's evaluation starts: imports, config, data, model
                            load, zero-shot caches), round 0's evaluation, the rest, and the
                            set-up's share of the whole run.
The issue's targets are in the table: validate --no-data < 3 s, the CSV < 6 s, set-up <= 25%.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT, report  # noqa: E402

FEDSPLICE = str(Path(sys.executable).parent / "fedsplice")
WORDS = ("the food was cold warm tasty bland service slow quick price fair high portion small large staff rude "
         "kind table view noise wine bread soup fish dessert").split()


def food_csv(path: Path, n: int = 5000) -> Path:
    rnd = random.Random(0)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text", "split"])
        for i in range(n):
            text = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(10, 40)))
            w.writerow(["great" if rnd.random() < 0.66 else "other", text, "test" if i % 5 == 0 else "train"])
    return path


def wall(args: list[str], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([FEDSPLICE, *args], cwd=ROOT, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


def timed_run(out: Path) -> dict:
    """One run; the time each line reached us (stderr is a pipe: progress comes as lines)."""
    env = {**os.environ, "COLUMNS": "200"}
    t0 = time.perf_counter()
    p = subprocess.Popen([FEDSPLICE, "run", "configs/pfadapter-minilm.toml", "--set", "server.rounds=3",
                          "--out", str(out), "--overwrite"], cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    at: dict[str, float] = {}
    assert p.stdout is not None  # stdout=PIPE
    for line in p.stdout:
        for key, start in (("eval0", "round 0/3 evaluate"), ("round0", "round   0 ")):
            if line.startswith(start) and key not in at:
                at[key] = time.perf_counter() - t0
    if p.wait() != 0 or len(at) < 2:
        raise RuntimeError(f"the run failed (exit {p.returncode}) or printed no round 0")
    total = time.perf_counter() - t0
    return {"setup_s": at["eval0"], "round0_s": at["round0"] - at["eval0"], "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 repetitions of each validate")
    ap.add_argument("--reps", type=int, default=0)
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 5)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append({"what": "validate --no-data", "seconds": wall(["validate", "--no-data"], reps),
                     "target": "< 3 s"})
        f = food_csv(Path(tmp) / "food.csv")
        rows.append({"what": "validate, 5,000-row CSV", "seconds": wall(
            ["validate", "--set", f"data.dataset=csv:{f}"], reps), "target": "< 6 s"})
        r = timed_run(Path(tmp) / "run")
    rows += [{"what": "run pfadapter-minilm, 3 rounds: set-up before round 0", "seconds": r["setup_s"],
              "share": f"{r['setup_s'] / r['total_s']:.0%}", "target": "<= 25%"},
             {"what": "  round 0's evaluation", "seconds": r["round0_s"],
              "share": f"{r['round0_s'] / r['total_s']:.0%}"},
             {"what": "  rounds 1-3, cold start, results", "seconds": r["total_s"] - r["setup_s"] - r["round0_s"],
              "share": f"{(r['total_s'] - r['setup_s'] - r['round0_s']) / r['total_s']:.0%}"},
             {"what": "  whole run (wall)", "seconds": r["total_s"], "share": "100%"}]
    load = os.getloadavg()[0]
    report("startup", rows, ["what", "seconds", "share", "target"], args.quick, [
        f"validate rows: the minimum of {reps} fresh processes; the run: one; load average at the end {load:.1f}",
        "set-up: from launch until the line `round 0/3 evaluate` (imports, config, data, model load, "
        "zero-shot caches, run directory)"])


if __name__ == "__main__":
    main()
