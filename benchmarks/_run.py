"""One measured fedsplice run (a worker of the benchmark scripts, in its own process).

stdin: {"config": path, "set": [k=v, ...], "env": {VAR: value, ...} (optional)}; stdout, last
line: JSON with the setup time, the wall time of every round (training + its evaluation, round
0's zero-shot evaluation excluded), the final GM/PM accuracy (job "skip_round0_eval": true leaves
round 0's evaluation out), bytes up per round, this process's peak RSS and its RSS once the run
is built, and the files and bytes the store holds at the end (none in memory).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import FP32, quick_sets  # also sets up the offline environment


def main() -> None:
    job = json.loads(sys.stdin.read())
    os.environ.update(job.get("env", {}))  # e.g. a kernel cache's capacity, before torch runs a kernel
    from fedsplice.federation.experiment import build
    from fedsplice.federation.store import make_store
    from fedsplice.federation.validate import load_config
    from fedsplice.runtimes.inprocess import run_rounds

    sets = job.get("set", [])
    if job.get("quick"):  # a script's --quick smoke run: the tiny model and budget first, the script's own sets win
        sets = quick_sets(job["config"], Path(tempfile.mkdtemp(prefix="bench-quick-"))) + sets
    cfg = load_config(Path(job["config"]), FP32 + sets)
    t0 = time.perf_counter()
    exp = build(cfg)
    setup = time.perf_counter() - t0
    built_rss = current_rss_mb()  # data, clients, model and caches built, nothing trained yet
    stamps, records = [], []

    def on_round(r: dict) -> None:
        records.append(r)
        stamps.append(time.perf_counter())

    start = None
    if job.get("skip_round0_eval"):  # start "from round 0": no zero-shot evaluation before round 1
        from fedsplice.federation.checkpoint import RoundState

        params = exp.model.trainable()
        gp = {n: params[n].detach().clone() for n in exp.global_names}
        start = RoundState(0, gp, exp.server_opt.init(gp), 0, 0)
        stamps.append(time.perf_counter())
    with tempfile.TemporaryDirectory() as tmp:
        store = make_store(cfg.runtime.store, Path(tmp) / "store")
        if cfg.runtime.workers > 1:  # parallel clients, as `fedsplice run` does (app.runner.client_side)
            from fedsplice.runtimes.workers import Workers

            with Workers(exp, store) as pool:
                run_rounds(exp, pool.store, on_round, start=start, transport=pool)
        else:
            run_rounds(exp, store, on_round, start=start)
        # what the disk store holds at the end (PRIVATE tensors and their optimizer state)
        files = [f for f in (Path(tmp) / "store").rglob("*") if f.is_file()]
        store_bytes, store_files = sum(f.stat().st_size for f in files), len(files)
    if start is not None:
        records.insert(0, {})
    last = records[-1]
    per_round = [b - a for a, b in zip(stamps, stamps[1:])]
    print(json.dumps({
        "setup_s": setup, "round_s": per_round,
        "mean_train_s": sum(r["time_s"] for r in records[1:]) / max(len(records) - 1, 1),
        "mean_round_s": sum(per_round) / max(len(per_round), 1),
        "gm_accuracy": last.get("gm", {}).get("accuracy"), "pm_accuracy": last.get("pm", {}).get("accuracy"),
        "dp_epsilon": last.get("dp_epsilon"),  # only with [privacy]
        # DP-SGD: the largest ε any client spent (ε only grows: the max over the rounds' worst clients)
        "dp_local_epsilon": max((r["dp_local_epsilon"] for r in records if "dp_local_epsilon" in r), default=None),
        "up_bytes_per_round": sum(r.get("up_bytes", 0) for r in records[1:]) / max(len(records) - 1, 1),
        # workers: this process's peak plus each worker's, bounded by the largest reaped child's
        "peak_rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                        + (cfg.runtime.workers if cfg.runtime.workers > 1 else 0)
                        * resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024,
        "built_rss_mb": built_rss, "store_bytes": store_bytes, "store_files": store_files,
        "cache": exp.model.cache_stats()}))


def current_rss_mb() -> float | None:
    """This process's resident memory now (Linux; None elsewhere)."""
    try:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024


if __name__ == "__main__":
    main()
