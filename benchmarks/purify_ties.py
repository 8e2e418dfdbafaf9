"""How often purification's tie rule triggers on real runs, and whether it changes any decision
that is not rounding noise (docs/fidelity.md "purification ties"; `fedsplice.core.purify`).

    python benchmarks/purify_ties.py [--quick] [--rounds R] [--tie-tol T]

Each FedPuReL config runs at its own local budget for R rounds (phase 2, cold start and the
evaluations off: only phase 1 purifies), once per CPU setting, each in its own process:
  default  the machine's kernels;
  avx2     torch, MKL and oneDNN held to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS,
           ONEDNN_MAX_CPU_ISA), as on a CPU without AVX-512.
Every projection the run asks for is recorded: ‖g_align‖/‖g_task‖, cos(g_task, g_align), the
exact sign rule's decision (the paper's and the official code's: project iff the product < 0)
and the tie rule's. The runs follow the tie rule at --tie-tol (default: the shipped one), so both
settings take the same path and the exact rule's decisions can be compared projection by
projection: a decision that flips between the two CPUs is rounding noise. --tie-tol 0 runs the
exact rule (the settings' paths then part at the first flip; the flip count is up to there).
--quick: a smoke run: one config on the tiny random model, 2 rounds of 2 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import FP32, ROOT, quick_sets, report  # noqa: E402

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# (config, granularity): "flat" is the paper's Eq. 5 (the configs' default), "tensor" the
# official code's; a prompt is one tensor, so both are the same there.
WORKLOADS = [("fedpurel-lora-fortunes", "flat"), ("fedpurel-lora-fortunes", "tensor"),
             ("fedpurel-prompt-fortunes", "flat"), ("fedpurel-adapter-fortunes", "flat"),
             ("fedpurel-adapter-fortunes", "tensor"), ("fedpurel-lora-fmnist", "flat")]


def child() -> None:
    """One run; prints one JSON line: every projection's (ratio, cos, exact, tie)."""
    job = json.loads(sys.stdin.read())
    import fedsplice
    from fedsplice.core import purify

    calls, original = [], purify.project

    def recording(g_task, g_align, tie_tol=purify.TIE_TOL):
        dot, nt, na = float((g_task * g_align).sum()), float(g_task.norm()), float(g_align.norm())
        calls.append({"ratio": na / nt if nt > 0 else math.inf,
                      "cos": dot / (nt * na) if nt > 0 and na > 0 else 0.0,
                      "exact": dot < 0 and na > 0,
                      "tie": na > 0 and purify.is_tie(dot, nt, na, job["tie_tol"])})
        return original(g_task, g_align, tie_tol)

    purify.project = recording  # the transform looks `project` up at call time
    cfg = fedsplice.load_config(ROOT / "configs" / f"{job['config']}.toml", FP32 + job["set"])
    with tempfile.TemporaryDirectory() as tmp:
        fedsplice.run(cfg, Path(tmp) / "run", overwrite=True, quiet=True)
    print(json.dumps(calls))


def one(config: str, granularity: str, isa: str, rounds: int, tie_tol: float, tiny: list[str]) -> list[dict]:
    sets = tiny + [f"server.rounds={rounds}", "eval.every=1000", "eval.cold_start_epochs=0", "runtime.threads=1",
            "method.personal_rounds=0", f'method.granularity="{granularity}"', f"method.tie_tol={tie_tol}"]
    env = {**os.environ, **(AVX2 if isa == "avx2" else {})}
    p = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(
        {"config": config, "set": sets, "tie_tol": tie_tol}), env=env, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{config} ({granularity}, {isa}): exit {p.returncode}\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def row(config: str, granularity: str, runs: dict[str, list[dict]], tie_tol: float) -> dict:
    d, a = runs["default"], runs["avx2"]
    n = min(len(d), len(a))
    ties = [c for c in d if c["tie"]]
    rest = [c for c in d if not c["tie"] and c["ratio"] > 0 and c["ratio"] != math.inf]
    flips = [i for i in range(n) if d[i]["exact"] != a[i]["exact"]]
    sci = lambda v: "-" if v is None else f"{v:.1e}"  # noqa: E731
    return {"config": config, "granularity": granularity,
            "projections": len(d) if len(d) == len(a) else f"{len(d)} / {len(a)}",
            "conflicts (exact rule)": sum(c["exact"] for c in d),
            "ties (norm / cos)": f"{sum(c['ratio'] <= tie_tol for c in ties)} / "
                                 f"{sum(c['ratio'] > tie_tol for c in ties)}",
            "decisions changed": sum(c["exact"] for c in ties),
            "ratio at ties, max": sci(max((c["ratio"] for c in ties), default=None)),
            "ratio elsewhere, min": sci(min((c["ratio"] for c in rest), default=None)),
            "abs cos elsewhere, min": sci(min((abs(c["cos"]) for c in rest), default=None)),
            "exact rule: CPUs disagree": len(flips),
            "of which ties": sum(d[i]["tie"] or a[i]["tie"] for i in flips),
            "tie rule: CPUs disagree": sum((d[i]["exact"] and not d[i]["tie"]) != (a[i]["exact"] and not a[i]["tie"])
                                           for i in range(n))}


def main() -> None:
    if "--child" in sys.argv:
        return child()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tie-tol", type=float, default=None, help="default: the shipped TIE_TOL")
    args = ap.parse_args()
    from fedsplice.core.purify import TIE_TOL

    tie_tol = TIE_TOL if args.tie_tol is None else args.tie_tol
    workloads, rounds = (WORKLOADS[:1], 2) if args.quick else (WORKLOADS, args.rounds)
    tmp = Path(tempfile.mkdtemp(prefix="purify-ties-quick-"))
    tiny = {c: quick_sets(ROOT / "configs" / f"{c}.toml", tmp) if args.quick else [] for c, _ in workloads}
    jobs = [(c, g, isa) for c, g in workloads for isa in ("default", "avx2")]

    def run_job(job: tuple[str, str, str]) -> list[dict]:
        config, granularity, isa = job
        return one(config, granularity, isa, rounds, tie_tol, tiny[config])

    with ThreadPoolExecutor(max_workers=max(1, min(2, os.cpu_count() or 1))) as pool:  # 1 thread a run
        out = dict(zip(jobs, pool.map(run_job, jobs)))
    rows = [row(c, g, {isa: out[(c, g, isa)] for isa in ("default", "avx2")}, tie_tol) for c, g in workloads]
    cols = list(rows[0])
    notes = [f"tie rule at tie_tol = {tie_tol:g}: a tie is ‖g_align‖ <= tie_tol·‖g_task‖ or |cos| <= tie_tol; "
             f"{rounds} rounds of each config's local budget, phase 1 only, one torch thread per run",
             "ties (norm / cos): by ‖g_align‖ <= tie_tol·‖g_task‖ / by |cos| <= tie_tol alone; "
             "ratio = ‖g_align‖/‖g_task‖ of one projection (a whole step when flat, one tensor when per tensor); "
             "'elsewhere' = the projections that are not ties (a zero g_align, e.g. LoRA A while B = 0, is neither)",
             "decisions changed: ties where the exact rule would have projected; 'CPUs disagree': projections "
             "whose decision differs between the default kernels and AVX2 (the same projection of the same path)"]
    report("purify_ties", rows, cols, args.quick, notes)


if __name__ == "__main__":
    main()
