"""Regression set: short runs of every shipped config, recorded once and compared exactly (floats
within FLOAT_TOL: the last bits of a sum move with the CPU).

    python scripts/regression.py record --out-dir tests/regression/golden
    python scripts/regression.py check --golden tests/regression/golden [--only STEM ...]

Each config in configs/*.toml (the top-level folder only) and the embedded default (`fedsplice
run` with no CONFIG, stem "default") is run through `python -m fedsplice run` with the
interpreter running this script, on a tiny budget given by `--set` overrides (OVERRIDES below).
Whichever `fedsplice` that interpreter imports is the code under test: the installed package,
or another checkout through PYTHONPATH=<checkout>/src.

A run's metrics.jsonl and results.json are normalised (the wall-clock fields in VOLATILE are
dropped, then every record is re-serialised with json.dumps(sort_keys=True): one line per round
in metrics.jsonl, indent=1 in results.json so that a difference shows as one line; NaN stays
NaN) and
written as <dir>/<stem>/metrics.jsonl and <dir>/<stem>/results.json. `record` writes them into
--out-dir; `check` writes them into a temp folder, compares them with --golden (every key,
string, integer and length exactly; floats within FLOAT_TOL, relative or absolute), prints one row
per config (same / DIFF / FAILED) with the first differing line and field, and exits 1 on any
difference. Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
DEFAULT = "default"  # stem of the embedded default config (no CONFIG argument)
# What the overrides depend on, of the embedded default (src/fedsplice/defaults/default.toml;
# not read from there, as the package layout may change under the set).
DEFAULT_TABLE = {"algorithm": "pfadapter", "model": {"name": "zoo:minilm"}}
FILES = ("metrics.jsonl", "results.json")

# Valid for every shipped config: 2 rounds of 2 clients, 2 local steps, at most 8 training
# samples per class, 4 test samples per class, 8 local test samples per client, 1 cold-start
# epoch, one torch thread (the same summation order on every machine).
OVERRIDES = {
    "server.rounds": "2",
    "server.clients_per_round": "2",
    "client.max_steps": "2",
    "data.max_per_class": "8",
    "data.test_per_class": "4",
    "data.local_test_size": "8",
    "eval.cold_start_epochs": "1",
    "runtime.threads": "1",
}
# SmolLM2 (135M, 30 layers; causal LM and VLM configs) scores every answer of every test sample:
# a smaller budget on top, so that the whole record stays within ~10 minutes on 2 cores.
SMOLLM2_OVERRIDES = {
    "data.max_per_class": "4",
    "data.test_per_class": "1",
    "data.local_test_size": "2",
    "client.batch_size": "4",
    "model.max_length": "32",
    "eval.every": "2",
}
# Only for algorithms that take the key (method.* is validated per algorithm).
METHOD_OVERRIDES = {"fedpurel": {"method.personal_rounds": "1"}}

# Keys dropped at any depth: they differ between two runs of the same config.
VOLATILE = {"time_s"}

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "MPLBACKEND": "Agg"}


def stems() -> list[str]:
    """Every config of the set: the embedded default, then configs/*.toml by name, but those
    that name a CUDA device (they need a GPU and the hub: pfadapter-qwen2-7b-nf4)."""
    return [DEFAULT] + sorted(p.stem for p in CONFIGS.glob("*.toml") if not needs_gpu(p))


def needs_gpu(path: Path) -> bool:
    return str(tomllib.loads(path.read_text()).get("runtime", {}).get("device", "")).startswith("cuda")


def overrides(stem: str) -> list[str]:
    """The --set overrides (KEY=VALUE) of one config."""
    table = DEFAULT_TABLE if stem == DEFAULT else tomllib.loads((CONFIGS / f"{stem}.toml").read_text())
    chosen = dict(OVERRIDES)
    if table.get("model", {}).get("name") == "zoo:smollm2":
        chosen.update(SMOLLM2_OVERRIDES)
    chosen.update(METHOD_OVERRIDES.get(table.get("algorithm"), {}))
    return [f"{k}={v}" for k, v in chosen.items()]


def run(stem: str, run_dir: Path) -> None:
    """`python -m fedsplice run [CONFIG] --out RUN_DIR` on the tiny budget; raises on failure."""
    cmd = [sys.executable, "-m", "fedsplice", "run"]
    if stem != DEFAULT:
        cmd.append(str(CONFIGS / f"{stem}.toml"))
    cmd += ["--out", str(run_dir), "--overwrite", "--quiet"]
    for o in overrides(stem):
        cmd += ["--set", o]
    p = subprocess.run(cmd, cwd=run_dir.parent, env={**os.environ, **ENV}, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{stem}: exit {p.returncode}\n{' '.join(cmd)}\n{p.stderr[-3000:]}")


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def normalise(run_dir: Path, dest: Path) -> None:
    """Write the normalised metrics.jsonl and results.json of `run_dir` into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (dest / "metrics.jsonl").write_text(
        "".join(json.dumps(_strip(json.loads(s)), sort_keys=True) + "\n" for s in lines if s.strip()))
    results = json.loads((run_dir / "results.json").read_text())
    (dest / "results.json").write_text(json.dumps(_strip(results), sort_keys=True, indent=1) + "\n")


def produce(stem: str, dest: Path) -> float:
    """Run one config in a temp folder and write its normalised files into `dest`; seconds taken."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"regress-{stem}-") as tmp:
        run_dir = Path(tmp) / "run"
        run(stem, run_dir)
        normalise(run_dir, dest)
    return time.perf_counter() - t0


# Floats agree within this (relative or absolute): the last bits of a sum move with the CPU's BLAS
# kernels. Measured: round-0 TKL, a difference of two equal log-probabilities, reads -2.8e-08 on
# one 2-core machine and -2.8e-10 on another. Strings, integers, keys and list lengths: exact.
FLOAT_TOL = 1e-6


def _close(x, y) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_close(x[k], y[k]) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(u, v) for u, v in zip(x, y))
    if isinstance(x, float) and isinstance(y, float):
        return math.isclose(x, y, rel_tol=FLOAT_TOL, abs_tol=FLOAT_TOL) or (math.isnan(x) and math.isnan(y))
    return type(x) is type(y) and x == y


def _same(g: Path, f: Path) -> bool:
    """Equal files, or equal JSON up to FLOAT_TOL (per line for .jsonl)."""
    if g.read_bytes() == f.read_bytes():
        return True
    try:
        if g.suffix == ".jsonl":
            gl, fl = g.read_text().splitlines(), f.read_text().splitlines()
            return len(gl) == len(fl) and all(_close(json.loads(a), json.loads(b)) for a, b in zip(gl, fl))
        return _close(json.loads(g.read_text()), json.loads(f.read_text()))
    except ValueError:
        return False


def first_difference(golden: Path, fresh: Path) -> str | None:
    """None when both folders hold the same FILES (floats within FLOAT_TOL); else where they
    first differ."""
    for name in FILES:
        g, f = golden / name, fresh / name
        if not g.is_file():
            return f"{name}: no golden file {g}"
        if _same(g, f):
            continue
        if not name.endswith(".jsonl"):  # one indented document: name the field, not a line of it
            return f"{name}{_first_field(g.read_text(), f.read_text()) or ': differs'}"
        gl, fl = g.read_text().splitlines(), f.read_text().splitlines()
        for i in range(max(len(gl), len(fl))):
            a = gl[i] if i < len(gl) else "<end of file>"
            b = fl[i] if i < len(fl) else "<end of file>"
            if a != b and not _close_text(a, b):
                where = _first_field(a, b)
                return f"{name} line {i + 1}{where}:\n  golden: {a}\n  now:    {b}"
        return f"{name}: differs in line endings or trailing bytes"
    return None


def _close_text(a: str, b: str) -> bool:
    try:
        return _close(json.loads(a), json.loads(b))
    except ValueError:
        return False


def _first_field(a: str, b: str) -> str:
    """', field KEY.PATH (golden X, now Y)' for two JSON texts, or '' when not both JSON."""
    try:
        x, y = json.loads(a), json.loads(b)
    except ValueError:
        return ""

    def walk(x, y, path):
        if isinstance(x, dict) and isinstance(y, dict):
            for k in sorted(set(x) | set(y)):
                found = walk(x.get(k, "<absent>"), y.get(k, "<absent>"), f"{path}.{k}")
                if found:
                    return found
        elif isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                found = walk(u, v, f"{path}[{i}]")
                if found:
                    return found
        elif not _close(x, y):
            field = path.lstrip(".") or "(whole value)"
            return f", field {field} (golden {json.dumps(x)[:200]}, now {json.dumps(y)[:200]})"
        return ""

    return walk(x, y, "")


def check_one(stem: str, golden_dir: Path) -> str | None:
    """Run `stem` now and compare it with its golden folder: None when identical, else why not."""
    if not (golden_dir / stem).is_dir():
        return f"no golden folder {golden_dir / stem} (record the set again)"
    with tempfile.TemporaryDirectory(prefix="regress-check-") as tmp:
        produce(stem, Path(tmp) / stem)
        return first_difference(golden_dir / stem, Path(tmp) / stem)


def cmd_record(args) -> int:
    out = Path(args.out_dir)
    t0 = time.perf_counter()
    failed = 0
    for stem in args.only or stems():
        try:
            print(f"{stem:32s} {produce(stem, out / stem):6.1f}s", flush=True)
        except RuntimeError as e:
            failed += 1
            print(f"{stem:32s} FAILED\n{e}", flush=True)
    print(f"recorded {len(args.only or stems()) - failed} configs into {out} in {time.perf_counter() - t0:.0f}s")
    return 1 if failed else 0


def cmd_check(args) -> int:
    golden = Path(args.golden)
    t0 = time.perf_counter()
    bad = 0
    recorded = sorted(p.name for p in golden.iterdir() if p.is_dir()) if golden.is_dir() else []
    for stem in args.only or stems():
        t1 = time.perf_counter()
        try:
            diff = check_one(stem, golden)
        except RuntimeError as e:
            diff = f"FAILED\n{e}"
        bad += diff is not None
        status = "same" if diff is None else ("FAILED" if diff.startswith("FAILED") else "DIFF")
        print(f"{stem:32s} {status:6s} {time.perf_counter() - t1:6.1f}s", flush=True)
        if diff is not None:
            print("  " + diff.replace("\n", "\n  ").removeprefix("FAILED\n  "), flush=True)
    if not args.only:
        for stem in sorted(set(recorded) - set(stems())):
            bad += 1
            print(f"{stem:32s} DIFF   golden folder without a config (record the set again)")
    print(f"{'all same' if not bad else f'{bad} differ'} ({time.perf_counter() - t0:.0f}s)")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run every config and write the normalised outputs")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--only", action="append", metavar="STEM", help="just this config (repeatable)")
    r.set_defaults(fn=cmd_record)
    c = sub.add_parser("check", help="run every config and compare with a recorded set")
    c.add_argument("--golden", required=True)
    c.add_argument("--only", action="append", metavar="STEM", help="just this config (repeatable)")
    c.set_defaults(fn=cmd_check)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
