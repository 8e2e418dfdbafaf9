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
# FEDSPLICE_BENCH_RESULTS: another folder for the tables (the test suite's smoke runs keep the tree clean)
RESULTS = Path(os.environ.get("FEDSPLICE_BENCH_RESULTS") or ROOT / "benchmarks" / "results")
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


def workload_children(script: str, args, workloads: dict, quick_set: list[str], tiny: dict, **job):
    """(name, workload, its child's result) of each workload the command line chose (`chosen`),
    each measured by `script --child` in a fresh process on the shipped config (job: "config",
    "set", "reps", "threads", and `job`'s own keys, a value callable on the workload for a
    per-workload one)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        for name, w, sets in chosen(args, workloads, Path(tmp), quick_set, tiny):
            extra = {k: v(w) if callable(v) else v for k, v in job.items()}
            r, _ = run_script_child(script, {"config": str(ROOT / "configs" / w["config"]), "set": sets,
                                             "reps": args.reps, "threads": args.threads, **extra})
            yield name, w, r


# --quick: a smoke run of a script (tests/test_benchmarks.py runs every one in `make test`): the
# shipped config's model is swapped for the test suite's tiny random model of its kind, and the
# budget cut to one round of 2 steps on a few test items. Its times and accuracies mean nothing.
QUICK_BUDGET = ["server.rounds=1", "client.max_steps=2", "client.batch_size=4", "data.test_per_class=2",
                "data.local_test_size=4", "eval.cold_start_epochs=0", "model.max_length=32"]


def tiny_model(model_name: str, folder: Path) -> str:
    """The tiny random model standing in for `model_name` (a shipped config's model.name), built once
    into `folder`: BERT for MiniLM, Llama for SmolLM2 (and any other causal LM), CLIP for CLIP."""
    from fedsplice.data import tiny

    kind = "clip" if "clip" in model_name.lower() else "bert" if "minilm" in model_name.lower() else "llama"
    build = {"clip": tiny.tiny_clip, "bert": tiny.tiny_bert, "llama": tiny.tiny_llama}[kind]
    dest = Path(folder) / f"tiny-{kind}"
    if not (dest / "config.json").exists():
        build(dest)
    return str(dest)


def quick_sets(config: str | Path, folder: Path, budget: bool = True) -> list[str]:
    """The `--set` list that makes `config` a quick smoke run: its model swapped for tiny_model's
    (into `folder`), and with `budget` QUICK_BUDGET's cuts."""
    import tomllib

    name = tomllib.loads(Path(config).read_text()).get("model", {}).get("name", "zoo:minilm")
    return [f"model.name='{tiny_model(name, folder)}'"] + (QUICK_BUDGET if budget else [])


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


# the instruction-set flags that decide a kernel's speed here (fp32 and bf16 matmuls)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu() -> str:
    """The CPU's model name and which of ISA_FLAGS it has ("unknown" off Linux)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return f"{platform.processor() or 'unknown'}"
    text = info.read_text()
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in text.splitlines() if ln.startswith("flags")), set())
    return f"{name}, flags {' '.join(f for f in ISA_FLAGS if f in flags) or 'none of ' + '/'.join(ISA_FLAGS)}"


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
            f"cpu: {cpu()}",
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
