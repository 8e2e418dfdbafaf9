"""Utilisation: the useful FLOP/s of a training step and of an evaluation pass, divided by this
machine's measured matmul rate at the same precision.

    python benchmarks/utilisation.py [--quick] [--reps N] [--threads N]

Useful work counts real tokens only (padding is not useful), on the backbone's matmuls: N is the
weights of its linear layers (LoRA's A and B included, embeddings excluded), so a forward is 2·N
FLOPs a real token, plus attention's 4·n·d a token and layer for a sequence of n real tokens.
Training adds the backward: input gradients through every layer (2·N again; LoRA sits in every
layer, so they reach the bottom) and the trainable weights' gradients (2·N_trainable), attention
twice more. Tokens are counted where the model pads a batch (the tokenizer's `pad`, called once
per forward), so the class prompts a step encodes count too.

The peak: the median rate of a 2048 x 2048 x 2048 matmul at fp32 and at bf16 on torch's threads.
Rows: PFAdapter on MiniLM (configs/pfadapter-minilm.toml), `runtime.unpad` on and off (off pads
each batch to its longest member, as the tutorial-style loop of benchmarks/flower_tutorial.py
does), at fp32 and bf16 autocast; evaluation is `TaskModel.predict` on the global test set.
With `runtime.unpad` on, a third row trains the round's first 4 clients together
(`runtime.batch_train`, federation.batched_train: one forward and backward over the union of
their batches a step), the same steps each.
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

WORKLOADS = {"minilm": {"config": "pfadapter-minilm.toml", "set": ["server.rounds=1"], "steps": 4}}
TOGETHER = 4  # clients trained together in the batched row
SETTINGS = [("fp32", "off"), ("fp32", "on"), ("bf16", "off"), ("bf16", "on")]
QUICK_SET = ["server.rounds=1", "server.clients_per_round=2", "client.max_steps=2", "data.num_clients=3",
             "data.holdout_clients=0", "data.test_per_class=2", "data.local_test_size=6", "data.max_per_class=10",
             "eval.cold_start_epochs=0"]


def peak(dtype, reps: int = 5, n: int = 2048) -> float:
    """Measured FLOP/s of an n x n x n matmul (the median of `reps`)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(times)


class Counter:
    """Real and padded tokens, and attention's Σ n² over sequences, of every padded batch."""

    def __init__(self, tokenizer):
        self.real = self.rows = self.sq = 0
        real_pad = tokenizer.pad

        def pad(*a, **k):
            enc = real_pad(*a, **k)
            m = enc["attention_mask"]
            self.real += int(m.sum())
            self.rows += m.numel()
            self.sq += int((m.sum(1) ** 2).sum())
            return enc
        tokenizer.pad = pad

    def reset(self) -> None:
        self.real = self.rows = self.sq = 0


def shape(model) -> tuple[int, int, int, int]:
    """(N linear weights, N trainable linear weights, hidden size, layers) of the backbone."""
    import torch

    lin = [m for m in model.backbone.modules() if isinstance(m, torch.nn.Linear)]
    n = sum(m.weight.numel() for m in lin)
    nt = sum(m.weight.numel() for m in lin if m.weight.requires_grad)
    cfg = model.backbone.config
    return n, nt, cfg.hidden_size, cfg.num_hidden_layers


def trained(count: Counter, dims: tuple[int, int, int, int], secs: float, clients: int = 1) -> dict:
    """A training row: the tokens `count` saw, the useful FLOPs of a backbone of `dims` (`shape`)."""
    n, nt, d, layers = dims
    return {"real": count.real, "rows": count.rows, "clients": clients,
            "flops": count.real * (4 * n + 2 * nt) + 3 * 4 * d * layers * count.sq, "s": secs}


def together(exp, count: Counter, reps: int) -> tuple[float, int]:
    """(median seconds, clients) of the round's first TOGETHER clients trained together
    (federation.fit_together, each from the initial tensors, the config's client.max_steps)."""
    from fedsplice.core import wire
    from fedsplice.federation import fit_together
    from fedsplice.federation.store import MemoryStore

    cids, init = exp.train_ids[:TOGETHER], dict(exp.init_params)
    down = wire.encode({n: init[n] for n in exp.global_names})
    times = []
    for rep in range(reps + 1):  # rep 0: warm-up
        exp.model.load_params(init)
        count.reset()
        t0 = time.perf_counter()
        fit_together(exp, MemoryStore(), cids, 1, down)
        if rep:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), len(cids)


def child(job: dict) -> None:
    import dataclasses
    import json

    import torch

    from fedsplice.federation import build, tasks
    from fedsplice.federation.train import Step
    from fedsplice.federation.validate import load_config

    torch.set_num_threads(job["threads"] or torch.get_num_threads())
    peaks = {p: peak(d) for p, d in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    rows: list[dict] = []
    for prec, unpad in SETTINGS:
        exp = build(load_config(Path(job["config"]), job["set"] + [
            f"runtime.precision='{prec}'", f"runtime.unpad='{unpad}'", f"client.max_steps={job['steps']}",
            "runtime.batch_train='on'"]))
        count = Counter(exp.model.tokenizer)
        n, nt, d, layers = shape(exp.model)
        cid, init = exp.train_ids[0], dict(exp.init_params)
        cc = dataclasses.replace(exp.cfg.client, max_steps=job["steps"],
                                 local_epochs=max(exp.cfg.client.local_epochs, 1))
        train_s: list[float] = []
        texts = exp.data.test_texts[:exp.data.global_test_size]
        for rep in range(job["reps"] + 1):  # rep 0: warm-up
            exp.model.load_params(init)
            count.reset()
            t0 = time.perf_counter()
            _, st = tasks.train_client(exp, cid, rnd=1, torch_round=1, ctx=tasks.train_context(exp, cid),
                                       step=Step.of(exp.recipe), client_cfg=cc)
            if rep:
                train_s.append(time.perf_counter() - t0)
        train = trained(count, (n, nt, d, layers), statistics.median(train_s))
        joint = trained(count, (n, nt, d, layers), *together(exp, count, job["reps"])) if unpad == "on" else None
        count.reset()
        t0 = time.perf_counter()
        exp.model.predict(texts, exp.cfg.eval.batch_size)
        ev = {"real": count.real, "rows": count.rows, "flops": count.real * 2 * n + 4 * d * layers * count.sq,
              "s": time.perf_counter() - t0}
        rows.append({"precision": prec, "unpad": unpad, "train": train, "eval": ev, "steps": st["steps"],
                     **({"train together": joint} if joint else {})})
    out = {"peak": peaks, "rows": rows, "threads": torch.get_num_threads()}
    print(json.dumps(out))


def main() -> None:
    from benchmarks._common import report, workload_children
    from fedsplice.data import zoo

    args = interleaved_args(__doc__, WORKLOADS, "setting")
    rows = []
    for name, _, r in workload_children(__file__, args, WORKLOADS, QUICK_SET, {"minilm": zoo.tiny_bert},
                                        steps=lambda w: w["steps"]):
        for x in r["rows"]:
            for phase in ("train", "train together", "eval"):
                if phase not in x:
                    continue
                p = x[phase]
                rate = p["flops"] / p["s"]
                rows.append({"backbone": name + (" (tiny)" if args.quick else ""), "phase": phase,
                             "clients": p.get("clients", 1),
                             "precision": x["precision"], "unpad": x["unpad"],
                             "rows_per_token": p["rows"] / p["real"],
                             "useful_gflops": rate / 1e9, "peak_gflops": r["peak"][x["precision"]] / 1e9,
                             "utilisation": rate / r["peak"][x["precision"]], "seconds": p["s"],
                             "threads": r["threads"]})
    notes = [f"{os.cpu_count()} cpus, torch threads {rows[0]['threads'] if rows else '?'}; peak: a 2048^3 matmul "
             "at that precision (median of 5).",
             "train: the seconds of one client's local training (the config's batch, a few steps), median over "
             f"{args.reps} calls after a warm-up; eval: one TaskModel.predict over the global test set.",
             "rows_per_token: token rows through each layer per real token (1.0: no padding).",
             f"train together: the round's first {TOGETHER} clients' local training in one joint loop "
             "(runtime.batch_train = 'on'), seconds of the whole call, median likewise."]
    report("utilisation", rows, ["backbone", "phase", "clients", "precision", "unpad", "rows_per_token",
                                 "useful_gflops", "peak_gflops", "utilisation", "seconds"], args.quick, notes)


if __name__ == "__main__":
    child_or_main(child, main)
