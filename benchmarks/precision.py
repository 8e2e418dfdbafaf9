"""fp32 against bf16 autocast (`runtime.precision`), per backbone: local-training step time,
evaluation time, and the accuracy a short run reaches.

    python benchmarks/precision.py [--quick] [--only minilm|smollm2] [--reps N]

Per backbone, one fresh process builds the experiment twice, once per precision (the same
config but `runtime.precision`), then:
  1. a short run of each (the round loop, `fedsplice.runtimes.inprocess.run_rounds`): GM / PM
     accuracy after it;
  2. step time: `--reps` timed calls of the one client driver (`tasks.train_client`, a few
     steps on the same client) per precision, interleaved fp32 / bf16 / fp32 / ... so both see
     the same load on a shared machine; the median of seconds per step (the first call of each
     is a warm-up, not counted);
  3. evaluation: `TaskModel.predict` on the global test set, interleaved the same way.
`--quick` uses the tiny random BERT and Llama of the test suite (a smoke run: times mean nothing).
Whether bf16 pays depends on the CPU: with AVX-512 BF16 (or AMX) matmuls run natively in bf16;
with AVX2 alone they are emulated and slower (`grep -o avx512_bf16 /proc/cpuinfo`).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import child_or_main, interleaved_args, run_script_child  # noqa: E402

if TYPE_CHECKING:
    from fedsplice.federation.experiment import Experiment

PRECISIONS = ("fp32", "bf16")
WORKLOADS = {
    # FedAvg-LoRA on MiniLM (dual encoder): 3 rounds of 4 clients, 10 steps of 16
    "minilm": {"config": "fedavg-lora-minilm.toml",
               "set": ["server.rounds=3", "eval.every=100", "eval.cold_start_epochs=0"],
               "steps": 3},
    # SmolLM2-135M (causal LM, verbalizer): 1 round, 2 clients, 2 steps of 8 on a small test set
    "smollm2": {"config": "pfadapter-smollm2.toml",
                "set": ["server.rounds=1", "server.clients_per_round=2", "client.max_steps=2", "client.batch_size=8",
                        "data.num_clients=3", "data.holdout_clients=0", "data.test_per_class=3",
                        "data.local_test_size=10", "eval.cold_start_epochs=0"],
                "steps": 1},
}
QUICK_SET = ["server.rounds=1", "server.clients_per_round=2", "client.max_steps=2", "data.num_clients=3",
             "data.holdout_clients=0", "data.test_per_class=2", "data.local_test_size=6", "data.max_per_class=10",
             "eval.cold_start_epochs=0"]


# ----------------------------------------------------------------------------- the child
def child(job: dict) -> None:
    import dataclasses

    import torch

    from fedsplice.federation import build, make_store, tasks
    from fedsplice.federation.train import Step
    from fedsplice.federation.validate import load_config
    from fedsplice.runtimes.inprocess import run_rounds

    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    exps: dict[str, Experiment] = {}
    per: dict[str, dict[str, object]] = {}  # precision -> its measurements
    for prec in PRECISIONS:
        cfg = load_config(Path(job["config"]), job["set"] + [f"runtime.precision='{prec}'"])
        t0 = time.perf_counter()
        exps[prec] = build(cfg)
        per[prec] = {"build_s": time.perf_counter() - t0,
                     "amp_dtype": str(getattr(exps[prec].model, "amp_dtype", "n/a"))}
    # 1. accuracy after a short run
    for prec, exp in exps.items():
        records: list[dict] = []
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            run_rounds(exp, make_store("memory", Path(tmp) / "store"), records.append)
            per[prec]["run_s"] = time.perf_counter() - t0
        last = records[-1]
        per[prec].update(gm_accuracy=last["gm"]["accuracy"], pm_accuracy=last["pm"]["accuracy"],
                         train_loss=last.get("train_loss"))
    # 2. step time, interleaved; 3. predict time, interleaved
    steps, reps = job["steps"], job["reps"]
    step_s: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    step_cpu: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    pred_s: dict[str, list[float]] = {p: [] for p in PRECISIONS}
    for rep in range(reps + 1):  # rep 0: warm-up
        order = PRECISIONS if rep % 2 == 0 else PRECISIONS[::-1]
        for prec in order:
            exp = exps[prec]
            cid = exp.train_ids[0]
            exp.model.load_params(dict(exp.init_params))
            cc = dataclasses.replace(exp.cfg.client, max_steps=steps, local_epochs=max(exp.cfg.client.local_epochs, 1))
            t0, c0 = time.perf_counter(), time.process_time()
            _, st = tasks.train_client(exp, cid, rnd=1, torch_round=1, ctx=tasks.train_context(exp, cid),
                                       step=Step.of(exp.recipe), client_cfg=cc)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if rep:
                step_s[prec].append(dt / st["steps"])
                step_cpu[prec].append(dc / st["steps"])
            texts = exp.data.test_texts[:exp.data.global_test_size]
            t0 = time.perf_counter()
            exp.model.predict(texts, exp.cfg.eval.batch_size)
            if rep:
                pred_s[prec].append((time.perf_counter() - t0) / max(len(texts), 1) * 100)
    for prec in PRECISIONS:
        per[prec].update(step_s=statistics.median(step_s[prec]), step_s_all=step_s[prec],
                         step_cpu_s=statistics.median(step_cpu[prec]),
                         predict_s_per_100=statistics.median(pred_s[prec]), batch=exp.cfg.client.batch_size,
                         eval_batch=exp.cfg.eval.batch_size)
    out = {**per, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "threads": torch.get_num_threads()}
    print(json.dumps(out))


# ----------------------------------------------------------------------------- the parent
def main() -> None:
    from benchmarks._common import ROOT, chosen, report
    from fedsplice.data import zoo

    args = interleaved_args(__doc__, WORKLOADS, "precision")
    reps = args.reps
    bf16_cpu = "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else False
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, w, sets in chosen(args, WORKLOADS, Path(tmp), QUICK_SET, {"minilm": zoo.tiny_bert,
                                                                            "smollm2": zoo.tiny_llama}):
            t_load = os.getloadavg()[0]
            r, _ = run_script_child(__file__, {"config": str(ROOT / "configs" / w["config"]), "set": sets,
                                               "steps": w["steps"], "reps": reps, "threads": args.threads})
            base = r["fp32"]
            for prec in PRECISIONS:
                x = r[prec]
                rows.append({"backbone": name + (" (tiny)" if args.quick else ""), "precision": prec,
                             "step_s": x["step_s"], "step_speedup": base["step_s"] / x["step_s"],
                             "step_cpu_s": x["step_cpu_s"], "cpu_speedup": base["step_cpu_s"] / x["step_cpu_s"],
                             "predict_s_per_100": x["predict_s_per_100"],
                             "predict_speedup": base["predict_s_per_100"] / x["predict_s_per_100"],
                             "gm_accuracy": x["gm_accuracy"], "pm_accuracy": x["pm_accuracy"],
                             "gm_diff_pts": 100 * (x["gm_accuracy"] - base["gm_accuracy"]),
                             "run_s": x["run_s"], "load_1min": f"{t_load:.1f}"})
            print(f"  {name}: fp32 {base['step_s']:.3f} s/step, bf16 {r['bf16']['step_s']:.3f} s/step "
                  f"(all: {r['fp32']['step_s_all']} / {r['bf16']['step_s_all']}), threads {r['threads']}", flush=True)
    notes = [
        f"CPU {'has' if bf16_cpu else 'lacks'} avx512_bf16; {os.cpu_count()} cpus; load average (1 min) "
        f"{load0:.1f} at start, {os.getloadavg()[0]:.1f} at the end (a shared machine: compare the rows of one "
        "backbone, measured interleaved in one process, rather than absolute seconds).",
        "step_s: median seconds per local step (`tasks.train_client`, forward + backward + AdamW, the config's "
        f"batch size), over {reps} interleaved calls per precision after a warm-up; step_cpu_s: the same in "
        "process CPU seconds (all threads; less sensitive to other processes than wall time); predict_s_per_100: "
        "TaskModel.predict on the global test set, seconds per 100 texts (eval.batch_size).",
        "Accuracy: after a short run of each (minilm: configs/fedavg-lora-minilm.toml, 3 rounds of 4 clients × "
        "10 steps; smollm2: configs/pfadapter-smollm2.toml, 1 round of 2 clients × 2 steps of 8, 3 test texts "
        "a class); gm_diff_pts against fp32. Trainable tensors stay fp32 under autocast (master copies).",
    ]
    report("precision", rows, ["backbone", "precision", "step_s", "step_speedup", "step_cpu_s", "cpu_speedup",
                               "predict_s_per_100", "predict_speedup", "gm_accuracy", "pm_accuracy", "gm_diff_pts",
                               "run_s", "load_1min"], args.quick, notes)


if __name__ == "__main__":
    child_or_main(child, main)
