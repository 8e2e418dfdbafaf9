"""Batched clients, the bound (issue 50): what one training step over m clients' batches at once
would cost per client on this machine, against m steps of one client's batch each.

    python benchmarks/batched_clients.py [--quick] [--reps N] [--threads N]

A batched round runs the frozen base once over the rows of a round's m clients, each client's
rows through its own adapters. Its speed-up is bounded by how much cheaper a row is in a batch
m times as large: this script times one step (forward, cross-entropy, backward, AdamW step on the
LoRA tensors) over m·B rows, B = client.batch_size of configs/pfadapter-minilm.toml, divided by
m, against the step over B rows. The adapters' own grouped matmuls (m small ones per layer) are
not in it: a real batched round is slower than this bound, never faster. Evaluation likewise:
one TaskModel.predict over the union of m local test sets against m predicts over one each.
`--quick` uses the tiny random BERT of the test suite (the numbers then mean nothing).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import child_or_main, interleaved_args  # noqa: E402

WORKLOADS = {"minilm": {"config": "pfadapter-minilm.toml", "set": ["server.rounds=1"]}}
CLIENTS = (1, 2, 4, 8)
PRECISIONS = ("fp32", "bf16")
QUICK_SET = ["data.num_clients=8", "data.holdout_clients=0", "data.test_per_class=2", "data.local_test_size=6",
             "data.max_per_class=10", "eval.cold_start_epochs=0"]


def timed(fn, reps: int) -> float:
    """The median seconds of `reps` calls of fn, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(exp, reps: int) -> list[dict]:
    """The rows of one built experiment (one precision): a step and the evaluations at each m."""
    import torch
    import torch.nn.functional as F

    model, d, b, bs = exp.model, exp.data, exp.cfg.client.batch_size, exp.cfg.eval.batch_size
    opt = torch.optim.AdamW(list(model.trainable().values()), lr=1e-4)
    local = [[d.test_texts[i] for i in exp.clients[c].test_idx] for c in exp.train_ids]

    def step(texts: list[str], y: torch.Tensor) -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        with model.autocast():
            loss = F.cross_entropy(model(texts), y)
        loss.backward()
        opt.step()

    rows = []
    for m in CLIENTS:
        rows_at = [i % len(d.train_texts) for i in range(m * b)]
        texts, y = [d.train_texts[i] for i in rows_at], torch.as_tensor(d.train_labels[rows_at], dtype=torch.long)
        sets = local[:m]
        union = [t for ts in sets for t in ts]
        rows.append({"clients": m, "rows": m * b, "step_s": timed(lambda t=texts, yy=y: step(t, yy), reps),
                     "eval_apart_s": timed(lambda ss=sets: [model.predict(ts, bs) for ts in ss], reps),
                     "eval_union_s": timed(lambda u=union: model.predict(u, bs), reps), "eval_rows": len(union)})
    return rows


def child(job: dict) -> None:
    import json

    import torch

    from fedsplice.federation import build
    from fedsplice.federation.validate import load_config

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    rows = []
    for prec in PRECISIONS:
        exp = build(load_config(Path(job["config"]), job["set"] + [f"runtime.precision='{prec}'"]))
        rows += [{"precision": prec, **r} for r in measure(exp, job["reps"])]
    print(json.dumps({"rows": rows, "threads": torch.get_num_threads(), "batch": exp.cfg.client.batch_size}))


def main() -> None:
    from benchmarks._common import report, workload_children
    from fedsplice.data import zoo

    args = interleaved_args(__doc__, WORKLOADS, "size")
    out = []
    for name, _, r in workload_children(__file__, args, WORKLOADS, QUICK_SET, {"minilm": zoo.tiny_bert}):
        one = {x["precision"]: x["step_s"] for x in r["rows"] if x["clients"] == 1}
        for x in r["rows"]:
            per_client = x["step_s"] / x["clients"]
            out.append({"backbone": name + (" (tiny)" if args.quick else ""), **x,
                        "step_s_per_client": per_client, "train_bound": one[x["precision"]] / per_client,
                        "eval_bound": x["eval_apart_s"] / x["eval_union_s"], "threads": r["threads"],
                        "batch": r["batch"]})
    notes = [f"{os.cpu_count()} cpus, torch threads {out[0]['threads'] if out else '?'}; runtime.unpad at its "
             f"default; B = {out[0]['batch'] if out else '?'} rows a client's step.",
             "step_s: one step over `rows` = clients x B rows (median of the reps after a warm-up); "
             "train_bound: step_s at 1 client / (step_s / clients), the most a batched round's training can gain.",
             "eval_apart_s: one predict per client's local test set; eval_union_s: one predict over their union; "
             "eval_bound: their ratio."]
    report("batched_clients", out, ["backbone", "precision", "clients", "rows", "step_s", "step_s_per_client",
                                     "train_bound", "eval_rows", "eval_apart_s", "eval_union_s", "eval_bound"],
           args.quick, notes)


if __name__ == "__main__":
    child_or_main(child, main)
