"""Regression set: short runs of every shipped config, recorded once and compared exactly (floats
within a tolerance measured across CPUs' kernels: FLOAT_TOL below).

    python scripts/regression.py record --out-dir tests/regression/golden
    python scripts/regression.py check --golden tests/regression/golden [--only STEM ...] [--isa avx2]
    python scripts/regression.py spread DIR_A DIR_B   # the float differences of two recorded sets

Each config in configs/*.toml (the top-level folder only) and the embedded default (`fedsplice
run` with no CONFIG, stem "default") is run through `python -m fedsplice run` with the
interpreter running this script, on a tiny budget given by `--set` overrides (OVERRIDES below).
Whichever `fedsplice` that interpreter imports is the code under test: the installed package,
or another checkout through PYTHONPATH=<checkout>/src.

A run's metrics.jsonl and results.json are normalised (the wall-clock fields in VOLATILE are
dropped, then every record is re-serialised with json.dumps(sort_keys=True): one line per round
in metrics.jsonl, indent=1 in results.json so that a difference shows as one line; NaN stays
NaN) and written as <dir>/<stem>/metrics.jsonl and <dir>/<stem>/results.json. `record` writes
them into --out-dir (`--isa`: with which kernels). `check` runs every config under each kernel
set in ISAS (this CPU's own, and AVX2 as on a CPU without AVX-512), both at once, writes them
into a temp folder, compares each with --golden (every key, string, integer and length exactly;
floats within the config's tolerance, relative or absolute), prints one row per config (same /
DIFF / FAILED) with the first differing line and field, and exits 1 on any difference.
Stdlib only.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
DEFAULT = "default"  # stem of the embedded default config (no CONFIG argument)
# What the overrides depend on, of the embedded default (src/fedsplice/defaults/default.toml;
# not read from there, as the package layout may change under the set); typed as a parsed TOML table.
DEFAULT_TABLE: dict[str, Any] = {"algorithm": "pfadapter", "model": {"name": "zoo:minilm"}}
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
    "runtime.precision": "fp32",  # the default "auto" picks bf16 on a CPU with native bf16: the goldens are fp32's
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
# model.task = "generate" (free-text answers): no cold start (refused there), answers of 4 tokens,
# 40 training records (10 clients need them).
GENERATE_OVERRIDES = {"eval.cold_start_epochs": "0", "eval.max_new_tokens": "4", "data.max_per_class": "10"}
# Only for algorithms that take the key (method.* is validated per algorithm).
METHOD_OVERRIDES = {"fedpurel": {"method.personal_rounds": "1"}}

# Keys dropped at any depth: they differ between two runs of the same config.
VOLATILE = {"time_s", "cpu_s", "setup"}

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "MPLBACKEND": "Agg"}
# The CPU kernels a run may use: "default" (whatever this CPU has), "avx2" (torch's ATen, MKL,
# oneDNN and numpy held to AVX2, as on a CPU without AVX-512). The same golden holds for both:
# `check` runs each config under every ISA given, at once (each run uses one thread).
ISAS = {"default": {},
        "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                 "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"}}


def stems() -> list[str]:
    """Every config of the set: the embedded default, then configs/*.toml by name, but those
    that name a CUDA device (they need a GPU and the hub: pfadapter-qwen2-7b-nf4) or read their
    model or data from the hub (fedpurel-prompt-cifar100lt): this set runs offline."""
    return [DEFAULT] + sorted(p.stem for p in CONFIGS.glob("*.toml") if not needs_gpu(p) and not needs_hub(p))


def needs_gpu(path: Path) -> bool:
    return str(tomllib.loads(path.read_text()).get("runtime", {}).get("device", "")).startswith("cuda")


def needs_hub(path: Path) -> bool:
    """A model that is neither the zoo's nor a local folder, or an hf: data set that is not one."""
    table = tomllib.loads(path.read_text())
    model = str(table.get("model", {}).get("name", "zoo:"))
    data = str(table.get("data", {}).get("dataset", ""))
    hub_model = not model.startswith("zoo:") and not Path(model).expanduser().exists()
    hub_data = data.startswith("hf:") and not Path(data[3:].partition(":")[0]).expanduser().exists()
    return hub_model or hub_data


def overrides(stem: str) -> list[str]:
    """The --set overrides (KEY=VALUE) of one config."""
    table = DEFAULT_TABLE if stem == DEFAULT else tomllib.loads((CONFIGS / f"{stem}.toml").read_text())
    chosen = dict(OVERRIDES)
    if table.get("model", {}).get("name") == "zoo:smollm2":
        chosen.update(SMOLLM2_OVERRIDES)
    if table.get("model", {}).get("task") == "generate":
        chosen.update(GENERATE_OVERRIDES)
    chosen.update(METHOD_OVERRIDES.get(table.get("algorithm", ""), {}))
    return [f"{k}={v}" for k, v in chosen.items()]


def run(stem: str, run_dir: Path, isa: str = "default") -> None:
    """`python -m fedsplice run [CONFIG] --out RUN_DIR` on the tiny budget; raises on failure."""
    cmd = [sys.executable, "-m", "fedsplice", "run"]
    if stem != DEFAULT:
        cmd.append(str(CONFIGS / f"{stem}.toml"))
    cmd += ["--out", str(run_dir), "--overwrite", "--quiet"]
    for o in overrides(stem):
        cmd += ["--set", o]
    p = subprocess.run(cmd, cwd=run_dir.parent, env={**os.environ, **ENV, **ISAS[isa]}, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{stem} ({isa} kernels): exit {p.returncode}\n{' '.join(cmd)}\n{p.stderr[-3000:]}")


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


def produce(stem: str, dest: Path, isa: str = "default") -> float:
    """Run one config in a temp folder and write its normalised files into `dest`; seconds taken."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"regress-{stem}-") as tmp:
        run_dir = Path(tmp) / "run"
        run(stem, run_dir, isa)
        normalise(run_dir, dest)
    return time.perf_counter() - t0


# Floats agree within a tolerance set from measured cross-CPU differences: `spread` between the
# set recorded with the default kernels and with "avx2" on one AVX-512 machine (2026-12-02; the
# avx2 runs reproduced an AVX2-only EPYC's numbers to the last digit). The kernels differ in
# ATen's vectorised softmax / log_softmax / attention (8 vs 16 lanes: another summation order,
# ~1e-7 relative; matmuls, exp and plain sums came out bitwise equal). Measured, the largest
# difference |x − y| / max(|x|, |y|, 1) over every float of the 29 text and CLIP configs: 4.1e-7
# (cliplora-grab-fortunes, task_loss); FLOAT_TOL leaves 25x room for other CPUs and libraries.
# Strings, integers, keys and list lengths: exact.
FLOAT_TOL = 1e-5
# vlm configs (SmolLM2 behind a freshly initialised projector): at this budget round 2 is
# unstable (task loss 4.65 -> 6.9 under AdamW at lr 1e-3) and grows round 1's 1.7e-6 into
# 2.2e-4 (gm.tkl of fedavg-lora-easyvqa) by the end of the run; 20x room.
VLM_TOL = 5e-3
# Left out of a vlm config's comparison, their keys and lengths still exact: the cold start's
# accuracies. Its held-out clients have 2 test samples each and, after that drift, one answer
# flipped between the two kernels (fedavg-lora-easyvqa: per_client [0.5, 1.0] vs [0.5, 0.5]).
VLM_LEFT_OUT = frozenset({"cold_start"})
# Left out of a generate config's comparison (keys and lengths still exact): the scores of greedy
# text, which one near-tie of two tokens' logits between the kernels turns into another answer.
# The response loss, a float of every reference token, is compared within FLOAT_TOL.
GENERATE_LEFT_OUT = frozenset({"exact_match", "token_f1", "rouge_l", "choice_parsed", "client_rouge_l"})
# FedPuReL's purification geometry (core/purify.py `geometry`): cos(g_task, g_align) and ‖g̃‖/‖g‖
# carry g_align's relative error, and at this budget g_align is small (LoRA a step from zero-shot:
# align loss ~2e-6), so the kernels' 1e-7 noise in f − z is ~1e-4 of it. Measured between the
# default and avx2 kernels: 3.2e-5 (purify_cos) and 5.4e-6 (purify_norm_ratio) of
# fedpurel-lora-fortunes; 30x room. (Where g_align is rounding noise alone, cos is reported as 0.)
FIELD_TOL = {"purify_cos": 1e-3, "purify_norm_ratio": 1e-3}


def tolerance(stem: str) -> tuple[float, frozenset]:
    """(float tolerance, keys whose values are left out) of one config."""
    table = DEFAULT_TABLE if stem == DEFAULT else tomllib.loads((CONFIGS / f"{stem}.toml").read_text())
    if table.get("model", {}).get("task") == "vlm":
        return VLM_TOL, VLM_LEFT_OUT
    if table.get("model", {}).get("task") == "generate":
        return FLOAT_TOL, GENERATE_LEFT_OUT
    return FLOAT_TOL, frozenset()


def _close(x, y, tol: float = FLOAT_TOL) -> bool:
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_close(x[k], y[k], max(tol, FIELD_TOL.get(k, 0.0))) for k in x)
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_close(u, v, tol) for u, v in zip(x, y))
    if isinstance(x, float) and isinstance(y, float):
        return (math.isclose(x, y, rel_tol=tol, abs_tol=tol) or (math.isnan(x) and math.isnan(y))
                or (tol == math.inf and math.isinf(x) and math.isinf(y)))
    return type(x) is type(y) and x == y


def _skeleton(x):
    """Keys, lengths and types of a JSON value, without its values."""
    if isinstance(x, dict):
        return {k: _skeleton(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_skeleton(v) for v in x]
    return type(x).__name__


def _mask(x, left_out: frozenset):
    """x with the values under the `left_out` keys (at any depth) replaced by their skeleton."""
    if isinstance(x, dict):
        return {k: _skeleton(v) if k in left_out else _mask(v, left_out) for k, v in x.items()}
    if isinstance(x, list):
        return [_mask(v, left_out) for v in x]
    return x


def _docs(path: Path) -> list:
    """The JSON documents of a normalised file: one per line of a .jsonl, else one."""
    text = path.read_text()
    return [json.loads(s) for s in text.splitlines()] if path.suffix == ".jsonl" else [json.loads(text)]


def first_difference(golden: Path, fresh: Path, tol: float = FLOAT_TOL,
                     left_out: frozenset = frozenset()) -> str | None:
    """None when both folders hold the same FILES (floats within `tol`, the values under
    `left_out` keys not compared); else where they first differ."""
    for name in FILES:
        g, f = golden / name, fresh / name
        if not g.is_file():
            return f"{name}: no golden file {g}"
        if g.read_bytes() == f.read_bytes():
            continue
        try:
            gd, fd = ([_mask(d, left_out) for d in _docs(p)] for p in (g, f))
        except ValueError as e:
            return f"{name}: not JSON ({e})"
        for i in range(max(len(gd), len(fd))):
            a = gd[i] if i < len(gd) else "<end of file>"
            b = fd[i] if i < len(fd) else "<end of file>"
            if not _close(a, b, tol):
                where = f" line {i + 1}" if name.endswith(".jsonl") else ""
                show = (f":\n  golden: {json.dumps(a, sort_keys=True)[:1500]}"
                        f"\n  now:    {json.dumps(b, sort_keys=True)[:1500]}"
                        if name.endswith(".jsonl") else "")
                return f"{name}{where}{_first_field(a, b, tol) or ': differs'}{show}"
    return None


def _first_field(x, y, tol: float = FLOAT_TOL) -> str:
    """', field KEY.PATH (golden X, now Y)' of the first value where two JSON values differ."""

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
        elif not _close(x, y, tol):
            field = path.lstrip(".") or "(whole value)"
            return f", field {field} (golden {json.dumps(x)[:200]}, now {json.dumps(y)[:200]})"
        return ""

    return walk(x, y, "")


def _floats(x, path=""):
    """(path, value) of every finite float in a JSON value, depth first."""
    if isinstance(x, dict):
        for k in sorted(x):
            yield from _floats(x[k], f"{path}.{k}")
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _floats(v, f"{path}[{i}]")
    elif isinstance(x, float) and math.isfinite(x):
        yield path.lstrip("."), x


def spread(a: Path, b: Path, left_out: frozenset = frozenset()) -> tuple[float, str, int]:
    """The largest difference |x − y| / max(|x|, |y|, 1) between the floats of two runs' normalised
    files (relative above 1, absolute below: the tolerances' measure), where it is, and how many
    records differ beyond their floats (keys, lengths, integers, strings)."""
    worst, where, other = 0.0, "-", 0
    for name in FILES:
        for i, (x, y) in enumerate(zip(*([_mask(d, left_out) for d in _docs(p / name)] for p in (a, b)))):
            fx, fy = list(_floats(x)), list(_floats(y))
            if [p for p, _ in fx] != [p for p, _ in fy]:
                other += 1
                continue
            for (p, u), (_, v) in zip(fx, fy):
                rel = abs(u - v) / max(abs(u), abs(v), 1.0)
                if rel > worst:
                    worst, where = rel, f"{name}:{i + 1} {p}"
            other += not _close(x, y, math.inf)
    return worst, where, other


def check_one(stem: str, golden_dir: Path, isas: tuple[str, ...] = tuple(ISAS)) -> str | None:
    """Run `stem` now under each of `isas` (at once: each run uses one thread) and compare every
    run with its golden folder: None when all agree, else where each does not."""
    if not (golden_dir / stem).is_dir():
        return f"no golden folder {golden_dir / stem} (record the set again)"
    tol, left_out = tolerance(stem)
    with tempfile.TemporaryDirectory(prefix="regress-check-") as tmp:
        def one(isa: str) -> str | None:
            produce(stem, Path(tmp) / isa / stem, isa)
            return first_difference(golden_dir / stem, Path(tmp) / isa / stem, tol, left_out)

        with ThreadPoolExecutor(max_workers=len(isas)) as pool:
            diffs = dict(zip(isas, pool.map(one, isas)))
    bad = [f"[{isa} kernels] {d}" for isa, d in diffs.items() if d is not None]
    return "\n".join(bad) if bad else None


def cmd_record(args) -> int:
    out = Path(args.out_dir)
    t0 = time.perf_counter()
    failed = 0
    for stem in args.only or stems():
        try:
            print(f"{stem:32s} {produce(stem, out / stem, args.isa):6.1f}s", flush=True)
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
            diff = check_one(stem, golden, tuple(args.isa or ISAS))
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


def cmd_spread(args) -> int:
    """Per config recorded in both folders: the largest float difference and where."""
    a, b = Path(args.a), Path(args.b)
    worst = 0.0
    for stem in sorted(p.name for p in a.iterdir() if (b / p.name).is_dir()):
        tol, left_out = tolerance(stem) if stem in stems() else (FLOAT_TOL, frozenset())
        rel, where, other = spread(a / stem, b / stem, left_out)
        worst = max(worst, rel)
        print(f"{stem:32s} {rel:9.2e} (tol {tol:g})  {where}"
              + (f"  ({other} records differ beyond floats)" if other else ""))
    print(f"largest difference {worst:.2e}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run every config and write the normalised outputs")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--only", action="append", metavar="STEM", help="just this config (repeatable)")
    r.add_argument("--isa", choices=list(ISAS), default="default", help="the kernels to record with")
    r.set_defaults(fn=cmd_record)
    c = sub.add_parser("check", help="run every config and compare with a recorded set")
    c.add_argument("--golden", required=True)
    c.add_argument("--only", action="append", metavar="STEM", help="just this config (repeatable)")
    c.add_argument("--isa", action="append", choices=list(ISAS),
                   help="kernels to check under (repeatable; default all)")
    c.set_defaults(fn=cmd_check)
    d = sub.add_parser("spread", help="the largest float difference between two recorded sets, per config")
    d.add_argument("a")
    d.add_argument("b")
    d.set_defaults(fn=cmd_spread)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
