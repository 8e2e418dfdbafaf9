"""Shared by the benchmark scripts: one measured run in a fresh process, tables, CSV.

Every script prints a markdown table and writes it (with the date, commit and command that
produced it) to benchmarks/results/<name>[-quick].{csv,md}. Runs that are compared happen in
the same invocation, one after another, each in its own process so peak RSS is its own.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def in_subprocess(module: str, payload: dict, timeout: float = 3600) -> dict:
    """Run `python -m benchmarks.<module>` with a JSON job on stdin; its last stdout line is JSON."""
    p = subprocess.run([sys.executable, "-m", f"benchmarks.{module}"], input=json.dumps(payload), cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"benchmarks.{module} failed (exit {p.returncode}): " + " | ".join(tail))
    return json.loads(lines[-1])


def run_script_child(script: str, job: dict, timeout: float = 7200) -> tuple[dict, str]:
    """Run `python SCRIPT --child` with `job` as JSON on stdin, in a fresh process (its peak RSS
    its own): (its last stdout line that is JSON, its stderr)."""
    p = subprocess.run([sys.executable, script, "--child"], input=json.dumps(job), cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr or p.stdout).splitlines()[-8:]
        raise RuntimeError(f"{Path(script).name} child failed (exit {p.returncode}): " + " | ".join(tail))
    return json.loads(lines[-1]), p.stderr


def interleaved_args(doc: str, workloads, per: str):
    """The command line of a script that compares settings interleaved in one child per workload."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny random models (a smoke run of the script)")
    ap.add_argument("--only", action="append", default=[], choices=list(workloads))
    ap.add_argument("--reps", type=int, default=0, help=f"timed calls per {per} (default 4; quick 1)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    args.reps = args.reps or (1 if args.quick else 4)
    return args


def chosen(args, workloads: dict, tmp: Path, quick_set: list[str], tiny: dict):
    """(name, workload, its --set list) of each workload the command line chose; with --quick, the
    model is tiny[name](folder) (a random model of the test suite) and quick_set cuts the budget."""
    for name, w in workloads.items():
        if args.only and name not in args.only:
            continue
        sets = list(w["set"])
        if args.quick:
            sets += quick_set + [f"model.name='{tiny[name](tmp / name)}'"]
        yield name, w, sets


def child_or_main(child, main) -> None:
    """A script's __main__: `--child` runs child(the JSON job on stdin), else main()."""
    if "--child" in sys.argv:
        child(json.loads(sys.stdin.read()))
    else:
        main()


# Benchmarks compare other things than precision: fp32, as they measured before runtime.precision
# = "auto" became the default (issue 27); a job's own runtime.precision, later in its list, wins
FP32 = ["runtime.precision=fp32"]

COMMIT = commit()  # at start: the code that ran, even if the tree changes while it runs


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def report(name: str, rows: list[dict], cols: list[str], quick: bool, notes: list[str], script: str = "") -> str:
    """Print the table and write <name>[-quick].csv / .md under benchmarks/results (atomically);
    `script`: the benchmark's file stem when one script writes several tables (default: name)."""
    script = script or name
    from fedsplice.data.assets import atomic_write_bytes

    stem = name + ("-quick" if quick else "")
    head = [f"# benchmarks/{script}.py{' --quick' if quick else ''}",
            f"date {dt.datetime.now().isoformat(timespec='seconds')}, commit {COMMIT}, "
            f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
            f"command: python benchmarks/{script}.py {' '.join(sys.argv[1:])}".rstrip(), ""]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    md = "\n".join(head + table + [""] + [f"- {n}" for n in notes]) + "\n"
    print(md)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(RESULTS / f"{stem}.csv", buf.getvalue().encode())
    atomic_write_bytes(RESULTS / f"{stem}.md", md.encode())
    return md
