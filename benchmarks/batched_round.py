"""Batched clients, measured (issue 50): a round's training and the PM evaluation, one client
after another against all clients together (runtime.batch_train, runtime.batch_eval).

    python benchmarks/batched_round.py [--quick] [--reps N] [--threads N] [--only NAME]

Workloads: PFAdapter and FedAvg-LoRA on MiniLM (LoRA: each row through its client's factors),
PromptFL on fortunes (a CoOp context: every client's class side in one forward), PFAdapter on
SmolLM2-135M (a causal LM's verbalizer: each prompt and its continuations through its client's
factors). One child
process builds the shipped config once, then runs `rounds` rounds of the in-process
round loop per setting, the settings interleaved rep by rep after a warm-up run (so both see the
same warm caches): training time per round (the round records' time_s) and the PM evaluation's
time (every training client, the in-process runtime's evaluate task), and the accuracies each
setting reaches. The numbers are what `runtime.batch_train = "on"` / `batch_eval = "auto"`
gain against "off" on this machine (the measurement behind batch_train's "auto":
batching.train_slower). `--quick`: the tiny random BERT or Llama (the numbers then mean nothing).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import child_or_main, interleaved_args  # noqa: E402

WORKLOADS = {
    "pfadapter-minilm": {"config": "pfadapter-minilm.toml", "set": ["server.rounds=3", "eval.every=3"]},
    "lora-minilm": {"config": "fedavg-lora-minilm.toml", "set": ["server.rounds=3", "eval.every=3"]},
    "promptfl-fortunes": {"config": "promptfl-fortunes.toml", "set": ["server.rounds=3", "eval.every=3"]},
    "pfadapter-smollm2": {"config": "pfadapter-smollm2.toml", "set": ["server.rounds=3", "eval.every=3"]},
}
PRECISIONS = ("fp32", "bf16")
QUICK_SET = ["data.num_clients=8", "data.holdout_clients=0", "data.test_per_class=2", "data.local_test_size=6",
             "data.max_per_class=10", "eval.cold_start_epochs=0", "client.max_steps=2"]


def one_run(exp, together: bool, eval_too: bool) -> dict:
    """The round loop of `exp` with its clients batched or not: median training s per round,
    the PM evaluations' s, and the final GM / PM accuracy."""
    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.inprocess import InProcess, run_rounds

    exp.batch_train, exp.batch_eval = together, together and eval_too
    exp.model.load_params(exp.init_params)  # the round loop starts from the model as it holds it
    records: list[dict] = []
    pm_s: list[float] = []
    run = InProcess.run

    def timed_run(self, task, cids, down):
        t0 = time.perf_counter()
        out = run(self, task, cids, down)
        if task == "evaluate":
            pm_s.append(time.perf_counter() - t0)
        return out

    InProcess.run = timed_run  # type: ignore[method-assign]
    try:
        run_rounds(exp, MemoryStore(), records.append)
    finally:
        InProcess.run = run  # type: ignore[method-assign]
    last = records[-1]
    return {"train_s": statistics.median(r["time_s"] for r in records[1:]), "pm_eval_s": statistics.median(pm_s[1:]),
            "gm_accuracy": last["gm"]["accuracy"], "pm_accuracy": last["pm"]["accuracy"]}


def child(job: dict) -> None:
    import json

    import torch

    from fedsplice.federation import build
    from fedsplice.federation.validate import load_config

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    rows = []
    for prec in PRECISIONS:
        exp = build(load_config(Path(job["config"]), job["set"] + [f"runtime.precision='{prec}'",
                                                                  "runtime.batch_train='on'",
                                                                  "runtime.batch_eval='auto'"]))
        assert exp.batch_train, "the workload must batch (runtime.batch_train = 'on')"
        eval_too = exp.batch_eval  # a prompt method's PM is scored one client at a time either way
        one_run(exp, False, eval_too)  # warm-up: tokens, prefix rows
        got: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(job["reps"]):
            for together in (False, True):
                got[together].append(one_run(exp, together, eval_too))
        for together, runs in got.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            rows.append({"precision": prec, "clients": ("together" if together else "one after another"),
                         "pm_batched": "yes" if together and eval_too else "no",
                         "per_round": len(exp.sampling[1]), "pm_clients": len(exp.train_ids), **med})
    print(json.dumps({"rows": rows, "threads": torch.get_num_threads()}))


def main() -> None:
    from benchmarks._common import report, workload_children
    from fedsplice.data import zoo

    args = interleaved_args(__doc__, WORKLOADS, "setting")
    args.reps = args.reps if "--reps" in sys.argv else (1 if args.quick else 3)
    out = []
    tiny = {name: zoo.tiny_llama if "smollm2" in name else zoo.tiny_bert for name in WORKLOADS}
    for name, _, r in workload_children(__file__, args, WORKLOADS, QUICK_SET, tiny):
        base = {x["precision"]: x for x in r["rows"] if x["clients"] != "together"}
        for x in r["rows"]:
            b = base[x["precision"]]
            out.append({"workload": name + (" (tiny)" if args.quick else ""), **x, "threads": r["threads"],
                        "train_speedup": b["train_s"] / x["train_s"],
                        "pm_eval_speedup": b["pm_eval_s"] / x["pm_eval_s"]})
    notes = [f"{os.cpu_count()} cpus, torch threads {out[0]['threads'] if out else '?'}; the shipped configs, "
             f"3 rounds, PM evaluated after round 0 and round 3; medians of {args.reps} interleaved runs.",
             "train_s: the median round's training (records' time_s, rounds 1-3); pm_eval_s: the PM evaluation of "
             "every training client after round 3.",
             "together: runtime.batch_train = 'on', runtime.batch_eval = 'auto' (pm_batched: whether it applies; "
             "not to a prompt method); one after another: 'off'."]
    report("batched_round", out, ["workload", "precision", "clients", "pm_batched", "per_round", "pm_clients",
                                  "train_s", "train_speedup", "pm_eval_s", "pm_eval_speedup", "gm_accuracy",
                                  "pm_accuracy"],
           args.quick, notes)


if __name__ == "__main__":
    child_or_main(child, main)
