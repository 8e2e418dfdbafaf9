"""Padded against unpadded batches (`runtime.unpad`), per backbone: token rows pushed through the
layers, local-training step time, evaluation time, and the accuracy a short run reaches.

    python benchmarks/unpad.py [--quick] [--only minilm|clip|smollm2] [--reps N] [--threads N]

Per backbone, one fresh process builds the experiment twice (`runtime.unpad` "off" and "on"),
then: a short run of each (GM / PM accuracy); step time, `--reps` timed calls of the client driver
(`tasks.train_client`) per setting, interleaved off / on / off / ... so both see the same load,
the median seconds per step after a warm-up call; evaluation (`TaskModel.predict` on the global
test set), interleaved the same way. `rows_per_token`: token rows a training batch pushes through
each layer per real token, over 200 batches drawn from the training texts at the config's batch
size. For MiniLM, a sweep of the call cost `CPU_OVERHEAD` (fedsplice.model.unpad) that cuts the
batch. `--quick`: the tiny random BERT / CLIP / Llama of the test suite (times mean nothing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import FP32, child_or_main, interleaved_args  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from fedsplice.federation.experiment import Experiment

SETTINGS = ("off", "on")
SHORT = ["server.rounds=2", "eval.every=100", "eval.cold_start_epochs=0"]
WORKLOADS = {
    "minilm": {"config": "pfadapter-minilm.toml", "set": SHORT, "steps": 3, "sweep": [0, 16, 64, 128, 512]},
    "minilm-bf16": {"config": "pfadapter-minilm.toml", "set": SHORT + ["runtime.precision='bf16'"], "steps": 3,
                    "sweep": [0, 64, 256, 1024]},
    "clip": {"config": "cliplora-fortunes.toml", "set": SHORT, "steps": 3},
    "smollm2": {"config": "pfadapter-smollm2.toml",
                "set": ["server.rounds=1", "server.clients_per_round=2", "client.max_steps=2", "client.batch_size=8",
                        "data.num_clients=3", "data.holdout_clients=0", "data.test_per_class=3",
                        "data.local_test_size=10", "eval.cold_start_epochs=0"], "steps": 1},
}
QUICK_SET = ["server.rounds=1", "server.clients_per_round=2", "client.max_steps=2", "data.num_clients=3",
             "data.holdout_clients=0", "data.test_per_class=2", "data.local_test_size=6", "data.max_per_class=10",
             "eval.cold_start_epochs=0"]


def rows_per_token(exp: Experiment, batches: int = 200) -> tuple[float, float]:
    """(padded, unpadded) token rows per real token of random training batches."""
    from fedsplice.model.unpad import CPU_OVERHEAD, groups

    texts = [t for t in exp.data.train_texts if isinstance(t, str)]
    tok = cast("PreTrainedTokenizerBase", exp.model.tokenizer)  # a backbone's tokenizer is typed `object`
    cap = exp.cfg.model.max_length
    lengths = [len(ids) for ids in tok(texts, truncation=True, max_length=cap)["input_ids"]]
    rng, b = random.Random(0), min(exp.cfg.client.batch_size, len(lengths))
    real = padded = unpadded = 0
    for _ in range(batches):
        ls = [lengths[i] for i in rng.sample(range(len(lengths)), b)]
        real += sum(ls)
        padded += len(ls) * max(ls)
        unpadded += sum(len(g) * max(ls[i] for i in g) for g in groups(ls, CPU_OVERHEAD))
    return padded / real, unpadded / real


def step_time(exp: Experiment, steps: int) -> float:
    from fedsplice.federation import tasks
    from fedsplice.federation.train import Step

    cid = exp.train_ids[0]
    exp.model.load_params(dict(exp.init_params))
    cc = dataclasses.replace(exp.cfg.client, max_steps=steps, local_epochs=max(exp.cfg.client.local_epochs, 1))
    t0 = time.perf_counter()
    _, st = tasks.train_client(exp, cid, rnd=1, torch_round=1,
                               ctx=tasks.train_context(exp, cid),
                               step=Step.of(exp.recipe), client_cfg=cc)
    return (time.perf_counter() - t0) / st["steps"]


def child(job: dict) -> None:
    import torch

    from fedsplice.federation import build, make_store
    from fedsplice.federation.validate import load_config
    from fedsplice.model import taskmodel
    from fedsplice.runtimes.inprocess import run_rounds

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    exps = {s: build(load_config(Path(job["config"]), FP32 + job["set"] + [f"runtime.unpad='{s}'"])) for s in SETTINGS}
    per: dict[str, dict[str, float]] = {s: {} for s in SETTINGS}
    for s, exp in exps.items():
        records: list[dict] = []
        with tempfile.TemporaryDirectory() as tmp:
            run_rounds(exp, make_store("memory", Path(tmp) / "store"), records.append)
        per[s].update(gm=records[-1]["gm"]["accuracy"], pm=records[-1]["pm"]["accuracy"])
    step: dict[str, list[float]] = {s: [] for s in SETTINGS}
    pred: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for rep in range(job["reps"] + 1):  # rep 0: warm-up
        for s in (SETTINGS if rep % 2 == 0 else SETTINGS[::-1]):
            exp = exps[s]
            dt = step_time(exp, job["steps"])
            texts = exp.data.test_texts[:exp.data.global_test_size]
            t0 = time.perf_counter()
            exp.model.predict(texts, exp.cfg.eval.batch_size)
            if rep:
                step[s].append(dt)
                pred[s].append((time.perf_counter() - t0) / max(len(texts), 1) * 100)
    for s in SETTINGS:
        per[s].update(step_s=statistics.median(step[s]), predict_s_per_100=statistics.median(pred[s]))
    padding = rows_per_token(exps["on"])
    sweep: dict[int, float] = {}
    for ov in job.get("sweep", []):  # the call cost that cuts a batch: the constant's measurement
        taskmodel.CPU_OVERHEAD = ov
        exps["on"].model.train()
        sweep[ov] = statistics.median(step_time(exps["on"], job["steps"]) for _ in range(job["reps"] + 1))
    out = {**per, "rows_per_token": padding, "sweep": sweep, "threads": torch.get_num_threads()}
    print(json.dumps(out))


def main() -> None:
    from benchmarks._common import report, workload_children
    from fedsplice.data import zoo

    args = interleaved_args(__doc__, WORKLOADS, "setting")
    rows, sweeps, load0 = [], [], os.getloadavg()[0]
    tiny = {"minilm": zoo.tiny_bert, "minilm-bf16": zoo.tiny_bert, "clip": zoo.tiny_clip, "smollm2": zoo.tiny_llama}
    for name, _, r in workload_children(__file__, args, WORKLOADS, QUICK_SET, tiny, steps=lambda w: w["steps"],
                                        sweep=lambda w: w.get("sweep", [])):
        off = r["off"]
        for s in SETTINGS:
            x = r[s]
            rows.append({"backbone": name + (" (tiny)" if args.quick else ""), "unpad": s,
                         "rows_per_token": r["rows_per_token"][SETTINGS.index(s)],
                         "step_s": x["step_s"], "step_speedup": off["step_s"] / x["step_s"],
                         "predict_s_per_100": x["predict_s_per_100"],
                         "predict_speedup": off["predict_s_per_100"] / x["predict_s_per_100"],
                         "gm_accuracy": x["gm"], "pm_accuracy": x["pm"], "threads": r["threads"]})
        sweeps += [f"{name}: CPU_OVERHEAD {ov} -> {s:.3f} s/step" for ov, s in r["sweep"].items()]
    notes = [f"{os.cpu_count()} cpus; load average (1 min) {load0:.1f} at start, {os.getloadavg()[0]:.1f} at the "
             "end (compare the rows of one backbone, measured interleaved in one process).",
             "rows_per_token: token rows through every layer per real token (1.0: no padding); step_s: median "
             f"seconds per local step over {args.reps} interleaved calls; predict_s_per_100: TaskModel.predict on the "
             "global test set (it already scores shortest first), seconds per 100 inputs. Accuracy after 2 rounds "
             "(smollm2: 1 round of 2 clients x 2 steps of 8).",
             "clip: CLIP-LoRA (configs/cliplora-fortunes.toml) trains with LoRA dropout "
             "0.25, where `auto` keeps training batches padded; this row forces `on`.", *sweeps]
    report("unpad", rows, ["backbone", "unpad", "rows_per_token", "step_s", "step_speedup", "predict_s_per_100",
                           "predict_speedup", "gm_accuracy", "pm_accuracy", "threads"], args.quick, notes)


if __name__ == "__main__":
    child_or_main(child, main)
