"""Peak RSS and seconds per round against the capacity of torch's CPU kernel caches.

    python benchmarks/kernel_cache.py [--quick] [--rounds N] [--only WORKLOAD]

Under bf16 autocast a CPU matmul runs through oneDNN, and torch keeps two caches of its kernels
("primitives"): oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and ideep's (LRU_CACHE_CAPACITY),
each 1,024 entries by default, each entry holding its shape's reordered weights and scratch.
Unpadded batches (runtime.unpad) give every sequence length a shape of its own, so both caches
fill. fedsplice bounds both (fedsplice.model.device.KERNEL_CACHE, unless the variables are set);
this script measures what that costs and saves: each row is one run in its own process (its own
peak RSS), with both variables set to the row's capacity ("1024": torch's default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import ROOT, in_subprocess, quick_sets, report  # noqa: E402

WORKLOADS = {"PFAdapter": "pfadapter-minilm.toml", "FedPuReL-prompt": "fedpurel-prompt-fortunes.toml"}
CAPACITIES = (1024, 256, 64)
VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny random models, one workload")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per run (default 3, quick 1)")
    ap.add_argument("--only", action="append", default=[], choices=list(WORKLOADS))
    ap.add_argument("--precision", action="append", default=[], choices=["auto", "fp32"],
                    help="only these precisions (repeatable; default both)")
    ap.add_argument("--reps", type=int, default=1, help="runs per row, the capacities interleaved (median)")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    tmp = Path(tempfile.mkdtemp(prefix="kernel-cache-"))
    rows = []
    for name, cfg_name in WORKLOADS.items():
        if args.only and name not in args.only or args.quick and name != "PFAdapter":
            continue
        cfg = str(ROOT / "configs" / cfg_name)
        base = (quick_sets(cfg, tmp) if args.quick else []) + [f"server.rounds={rounds}", "eval.cold_start_epochs=0"]
        for precision in args.precision or ("auto", "fp32"):
            caps = CAPACITIES[:2] if args.quick else CAPACITIES
            runs: dict[int, list[dict]] = {cap: [] for cap in caps}
            for _ in range(args.reps):
                for cap in caps:
                    r = in_subprocess("_run", {"config": cfg, "set": base + [f"runtime.precision={precision}"],
                                               "env": {v: str(cap) for v in VARS}})
                    runs[cap].append(r)
                    print(f"  {name} / {precision} / {cap}: {r['mean_round_s']:.2f} s/round, "
                          f"{r['peak_rss_mb']:.0f} MB", flush=True)
            for cap, rs in runs.items():
                med = lambda k, rs=rs: statistics.median(r[k] for r in rs)  # noqa: E731
                rows.append({"workload": name, "precision": precision, "kernel_cache": cap,
                             "round_s": med("mean_round_s"),
                             "round_s_runs": " ".join(f"{r['mean_round_s']:.2f}" for r in rs),
                             "setup_s": med("setup_s"), "peak_rss_mb": med("peak_rss_mb"),
                             "gm_accuracy": rs[0]["gm_accuracy"]})
    report("kernel_cache", rows, ["workload", "precision", "kernel_cache", "round_s", "round_s_runs", "setup_s",
                                  "peak_rss_mb", "gm_accuracy"], args.quick, [
        f"{rounds} rounds of the shipped config (fp32 is the benchmarks' base; precision auto is bf16 on a CPU "
        "with native bf16, see the cpu line), round_s from the end of round 0's evaluation, the median of --reps "
        "runs (each in its own process, the capacities interleaved; round_s_runs lists them); peak_rss_mb "
        "their median.",
        "kernel_cache: both variables' capacity (1024 is torch's default; fedsplice's is "
        "fedsplice.model.device.KERNEL_CACHE). An fp32 matmul runs in MKL's sgemm, outside both caches."])


if __name__ == "__main__":
    main()
