"""Seconds per round and peak RSS: fedsplice (caches on) vs fedsplice (caches off) vs the same
algorithm written Flower-tutorial style (benchmarks/flower_tutorial.py, Flower's simulation
engine), same data, model, rounds and seed, with the accuracy each reached.

    python benchmarks/round_time.py [--quick] [--only NAME]

Workloads: the shipped text configs (PFAdapter and FedPuReL-LoRA: LoRA in every layer, so no
layer is frozen below the adapters), FedPuReL-prompt (the input side is frozen whole), and
PFAdapter with LoRA in the last 2 of 6 layers (a frozen prefix of 4 layers to cache). A round's
time is its training plus its evaluation when it has one (eval.every of the config), from the
end of round 0's zero-shot evaluation to the end of the last round, averaged; setup (model
load, the caches' first fill for fedsplice, starting Ray for Flower) is reported apart; wall_s
is the whole run as a user waits for it (its process from start to exit: imports, setup, every
round, evaluation). Target (issues 8, 14): fedsplice at its best settings for the machine
≥ 5× faster than the tutorial style per round and in wall time (issue 14: for a 10-round run,
`--rounds 10`), at the same accuracy (within 0.5 points), with peak RSS no higher.

"fedsplice (best)" is fedsplice with the settings that won on this machine (BEST below):
caches on, runtime.precision = "auto" (bf16 where the CPU has it), one process with torch's
threads. On this idle 2-core CPU runtime.workers = 2 × 1 thread was slower than 1 × 2 threads
(docs/performance.md, Parallel clients), and torch.compile lost: neither is among them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT, in_subprocess, quick_sets, report  # noqa: E402

BEST = ["runtime.precision=auto"]
IMPLS = ("fedsplice (caches on)", "fedsplice (caches off)", "fedsplice (best)", "Flower tutorial style")

WORKLOADS = {
    "PFAdapter": ("pfadapter-minilm.toml", []),
    "PFAdapter, LoRA in layers 4-5": ("pfadapter-minilm.toml", ["peft.layers=[4, 5]"]),
    # phase 2 off: no branch trained, in the rounds or after them (the tutorial style trains none)
    "FedPuReL-LoRA": ("fedpurel-lora-fortunes.toml", ["method.phase2=after", "method.personal_rounds=0"]),
    "FedPuReL-prompt": ("fedpurel-prompt-fortunes.toml", ["method.phase2=after", "method.personal_rounds=0"]),
}


def timed(fn, *a) -> dict:
    """fn(*a) (a run in its own process) with its wall time from process start to exit."""
    t0 = time.perf_counter()
    out = fn(*a)
    return {**out, "wall_s": time.perf_counter() - t0}


def tutorial(cfg: str, sets: list[str], rounds: int) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "flower_tutorial.py"), cfg, "--rounds", str(rounds)]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=7200)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError("flower_tutorial.py failed: " + " | ".join((p.stderr or p.stdout).splitlines()[-5:]))
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: tiny random models, 2 rounds of 2 steps, one workload")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per run (default 3, quick 2)")
    ap.add_argument("--only", action="append", default=[], help="run only these workloads (repeatable)")
    ap.add_argument("--impl", action="append", default=[], choices=IMPLS,
                    help="run only these implementations (repeatable; the tutorial style always runs)")
    args = ap.parse_args()
    impls = set(args.impl or IMPLS) | {"Flower tutorial style"}
    rounds = args.rounds or (2 if args.quick else 3)
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="round-time-quick-"))
    for name, (cfg_name, extra) in WORKLOADS.items():
        if args.only and name not in args.only or args.quick and name != "PFAdapter":
            continue
        cfg = str(ROOT / "configs" / cfg_name)
        sets = extra + [f"server.rounds={rounds}", "eval.cold_start_epochs=0"]
        if args.quick:  # the tiny model and budget for both implementations; the rounds stay this script's
            sets = quick_sets(cfg, tmp) + sets
        jobs = {"fedsplice (caches on)": sets, "fedsplice (caches off)": sets + ["runtime.cache=false"],
                "fedsplice (best)": sets + BEST}
        runs = {impl: timed(in_subprocess, "_run", {"config": cfg, "set": s}) for impl, s in jobs.items()
                if impl in impls}
        t = timed(tutorial, cfg, sets, rounds)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        runs["Flower tutorial style"] = {"mean_round_s": mean(t["seconds_per_round_with_eval"]),
                                         "mean_train_s": mean(t["seconds_per_round"]), "setup_s": t["setup_s"],
                                         "gm_accuracy": t["gm_accuracy"], "pm_accuracy": t["pm_accuracy"],
                                         "peak_rss_mb": t["peak_rss_mb_main"] + t["peak_rss_mb_worker"],
                                         "wall_s": t["wall_s"]}
        slow = runs["Flower tutorial style"]
        for impl, r in runs.items():
            rows.append({"workload": name, "implementation": impl, "round_s": r["mean_round_s"],
                         "train_s": r["mean_train_s"], "setup_s": r["setup_s"], "wall_s": r["wall_s"],
                         "speedup_vs_tutorial": slow["mean_round_s"] / r["mean_round_s"],
                         "train_speedup": slow["mean_train_s"] / r["mean_train_s"],
                         "wall_speedup": slow["wall_s"] / r["wall_s"],
                         "gm_accuracy": r["gm_accuracy"], "pm_accuracy": r["pm_accuracy"],
                         "gm_diff_pts": 100 * (r["gm_accuracy"] - slow["gm_accuracy"]),
                         "peak_rss_mb": r["peak_rss_mb"]})
            print(f"  {name} / {impl}: {r['mean_round_s']:.1f} s/round, GM {r['gm_accuracy']:.3f}", flush=True)
    for r in rows:
        if r["implementation"] != "Flower tutorial style":
            r["target"] = verdict(r, next(x for x in rows if x["workload"] == r["workload"]
                                          and x["implementation"] == "Flower tutorial style"))
    report("round_time", rows, ["workload", "implementation", "round_s", "train_s", "setup_s", "wall_s",
                                "speedup_vs_tutorial", "train_speedup", "wall_speedup",
                                "gm_accuracy", "pm_accuracy", "gm_diff_pts", "peak_rss_mb", "target"],
           args.quick, [
        f"{rounds} rounds, 4 clients per round, the configs' local steps" + (" (tiny)" if args.quick else "")
        + "; FedPuReL's phase 2 and cold start are off in all three (the tutorial style has neither).",
        "Flower tutorial style: Flower's simulation engine (Ray), a fresh model per client call, no caches of "
        "frozen work, GLOBAL tensors averaged by Flower's FedAvg; its peak RSS is the driver's peak plus one "
        "Ray worker's (two workers run at once, so the true total is higher; Ray's own daemons are not counted).",
        "round_s: training + that round's evaluation (speedup_vs_tutorial); train_s: training only (train_speedup).",
        "gm_diff_pts: GM accuracy points against the tutorial-style run.",
        "wall_s: the run's process from start to exit; wall_speedup: the tutorial's wall_s / this one's.",
        "fedsplice (best): " + ", ".join(BEST) + " (with runtime.workers > 1 its peak RSS would be the main "
        "process's plus each worker's, as the tutorial's is its driver's plus a Ray worker's).",
        "target: ≥5× per round and in wall time, GM within 0.5 points, peak RSS ≤ the tutorial's; "
        "otherwise what misses, by how much."])


def verdict(r: dict, slow: dict) -> str:
    """Whether a row meets the target against its workload's tutorial-style row, and if not, by how much."""
    miss = []
    if r["speedup_vs_tutorial"] < 5:
        miss.append(f"round {r['speedup_vs_tutorial']:.1f}×")
    if r["wall_speedup"] < 5:
        miss.append(f"wall {r['wall_speedup']:.1f}×")
    if abs(r["gm_diff_pts"]) > 0.5:
        miss.append(f"GM {r['gm_diff_pts']:+.1f} pts")
    if r["peak_rss_mb"] > slow["peak_rss_mb"]:
        miss.append(f"RSS {r['peak_rss_mb'] / slow['peak_rss_mb']:.2f}×")
    return "yes" if not miss else "no: " + ", ".join(miss)


if __name__ == "__main__":
    main()
