"""Where a batched round's training time goes (issue 50): the round's first 4 clients trained one
after another (`tasks.train_client`) and together (`federation.fit_together`), timed, then once
each under `torch.profiler`, CPU time summed by kind of op.

    python benchmarks/batched_ops.py [--quick] [--steps N] [--reps N] [--precision fp32|bf16]

PFAdapter on MiniLM (configs/pfadapter-minilm.toml), unpadded batches, `--steps` local steps a
client. Kinds: matrix products (aten::mm, addmm, bmm), attention (scaled_dot_product kernels),
joins and copies (cat, copy_, index_select: what batching adds around each grouped layer),
elementwise and the rest. The wall times are the median of `--reps` after a warm-up, the two ways
interleaved; the profiled pass is one more of each (the profiler slows it, so compare its kinds
as shares). `--quick`: the tiny random BERT, 2 steps, 1 rep (a smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._common import quick_sets, report  # noqa: E402

CONFIG = ROOT / "configs" / "pfadapter-minilm.toml"
CLIENTS = 4
KINDS = {"matrix products": ("aten::mm", "aten::addmm", "aten::bmm"),
         "attention": ("aten::_scaled_dot_product",),
         "joins and copies": ("aten::cat", "aten::copy_", "aten::index_select", "aten::stack")}


def kind_of(name: str) -> str:
    return next((k for k, prefixes in KINDS.items() if name.startswith(prefixes)), "elementwise and the rest")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the tiny random BERT, 2 steps, 1 rep (a smoke run)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    args = p.parse_args()
    from fedsplice.core import wire
    from fedsplice.federation import build, fit_together, tasks
    from fedsplice.federation.store import MemoryStore
    from fedsplice.federation.train import Step
    from fedsplice.federation.validate import load_config

    steps, reps = (2, 1) if args.quick else (args.steps, args.reps)
    sets = quick_sets(CONFIG, Path(tempfile.mkdtemp(prefix="batched-ops-"))) if args.quick else []
    exp = build(load_config(CONFIG, sets + ["server.rounds=1", f"runtime.precision={args.precision}",
                                            "runtime.unpad=on", f"client.max_steps={steps}", "runtime.batch_train=on"]))
    cids, init = exp.train_ids[:CLIENTS], dict(exp.init_params)
    down = wire.encode({n: init[n] for n in exp.global_names})
    cc = dataclasses.replace(exp.cfg.client, max_steps=steps, local_epochs=max(exp.cfg.client.local_epochs, 1))

    def apart() -> None:
        for cid in cids:
            exp.model.load_params(init)
            tasks.train_client(exp, cid, rnd=1, torch_round=1, ctx=tasks.train_context(exp, cid),
                               step=Step.of(exp.recipe), client_cfg=cc)

    def together() -> None:
        exp.model.load_params(init)
        fit_together(exp, MemoryStore(), cids, 1, down)

    ways = {"one after another": apart, "together": together}
    wall: dict[str, list[float]] = {w: [] for w in ways}
    for rep in range(reps + 1):  # rep 0: warm-up
        for w, f in ways.items():
            t0 = time.perf_counter()
            f()
            if rep:
                wall[w].append(time.perf_counter() - t0)
    rows = []
    for w, f in ways.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            f()
        cpu: dict[str, float] = {}
        for ev in prof.key_averages():
            cpu[kind_of(ev.key)] = cpu.get(kind_of(ev.key), 0.0) + ev.self_cpu_time_total / 1e6
        rows.append({"clients": w, "wall s": statistics.median(wall[w]), **{f"{k} s": v for k, v in cpu.items()},
                     "profiled CPU s": sum(cpu.values())})
    cols = ["clients", "wall s", *[f"{k} s" for k in (*KINDS, "elementwise and the rest")], "profiled CPU s"]
    report("batched_ops", rows, cols, args.quick,
           [f"PFAdapter on {'the tiny BERT' if args.quick else 'MiniLM'}, {CLIENTS} clients x {steps} steps, "
            f"{args.precision}, unpadded; wall: median of {reps} interleaved after a warm-up",
            "kinds: CPU time (all threads) of one profiled pass each, by op name (the script's docstring)"])


if __name__ == "__main__":
    main()
