"""Speed candidates of issue 14, item 7, side by side in one process on one experiment:
evaluation batches (the texts' given order against shortest-first, eval batch 64 against 256,
torch.inference_mode against no_grad) and the training step (eager against torch.compile).

    python benchmarks/candidates.py [--quick] [--compile] [--reps N]

Evaluation variants are interleaved and timed in process CPU seconds at one thread (the work
done, robust to a loaded machine); the LoRA tensors are perturbed from their init first so the
adapters matter. `--compile` also times 3-step client rounds (`tasks.train_client`) eager, then
with the backbone compiled in place (`nn.Module.compile(dynamic=True)`; it cannot be undone, so
eager runs first), and reports the compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after _common: the offline environment is set first)

from benchmarks._common import FP32, ROOT, quick_sets, report  # noqa: E402

if TYPE_CHECKING:
    from fedsplice.federation.experiment import Experiment
    from fedsplice.model.taskmodel import TaskModel


def scored(m: TaskModel, texts: list[str], bs: int, sort: bool, inference: bool) -> torch.Tensor:
    """Logits of `texts` in their order, scored in the given or shortest-first order."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i])) if sort else list(range(len(texts)))
    was = m.training
    m.eval()
    with (torch.inference_mode() if inference else torch.no_grad()), m.autocast():
        ce = m.class_embeddings() if m.task == "dual_encoder" else None
        out = torch.cat([m([texts[j] for j in order[i:i + bs]], ce).float() for i in range(0, len(order), bs)])
    m.train(was)
    res = torch.empty_like(out)
    res[torch.as_tensor(order)] = out
    return res


def eval_rows(exp: Experiment, reps: int) -> list[dict]:
    m, texts = exp.model, exp.data.test_texts[:exp.data.global_test_size]
    variants = {"eval: given order, batch 64": (64, False, False),
                "eval: shortest first, batch 64": (64, True, False),
                "eval: given order, batch 256": (256, False, False),
                "eval: shortest first, batch 256": (256, True, False),
                "eval: shortest first, batch 64, inference_mode": (64, True, True)}
    ref = scored(m, texts, 64, False, False)
    times: dict[str, list[float]] = {k: [] for k in variants}
    diff: dict[str, float] = {}
    for rep in range(reps):
        for k in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
            t0 = time.process_time()
            out = scored(m, texts, *variants[k])
            times[k].append(time.process_time() - t0)
            diff[k] = float((out - ref).abs().max())
    base = statistics.median(times["eval: given order, batch 64"])
    return [{"candidate": k, "seconds": statistics.median(v), "unit": f"CPU s / {len(texts)} texts",
             "gain": base / statistics.median(v), "max_abs_logit_diff": diff[k], "compile_s": None}
            for k, v in times.items()]


def compile_rows(exp: Experiment, reps: int, steps: int) -> list[dict]:
    from fedsplice.federation import tasks
    from fedsplice.federation.train import Step

    cid = exp.train_ids[0]
    cc = dataclasses.replace(exp.cfg.client, max_steps=steps)

    def step() -> float:
        exp.model.load_params(dict(exp.init_params))
        t0 = time.perf_counter()
        _, st = tasks.train_client(exp, cid, rnd=1, torch_round=1, ctx=tasks.train_context(exp, cid),
                                   step=Step.of(exp.recipe), client_cfg=cc)
        return (time.perf_counter() - t0) / st["steps"]

    step()  # warm-up
    eager = statistics.median([step() for _ in range(reps)])
    t0 = time.perf_counter()
    exp.model.backbone.compile(dynamic=True)
    step()  # compiles here
    took = time.perf_counter() - t0
    comp = statistics.median([step() for _ in range(reps)])
    unit = f"wall s / step ({torch.get_num_threads()} threads)"
    return [{"candidate": "train: eager", "seconds": eager, "unit": unit, "gain": 1.0, "max_abs_logit_diff": None,
             "compile_s": None},
            {"candidate": "train: torch.compile(backbone, dynamic=True)", "seconds": comp, "unit": unit,
             "gain": eager / comp, "max_abs_logit_diff": None, "compile_s": took}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: the tiny random model, 1 rep")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the training step")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    from fedsplice.federation import build
    from fedsplice.federation.validate import load_config

    config = ROOT / "configs" / "fedavg-lora-minilm.toml"
    sets = quick_sets(config, Path(tempfile.mkdtemp(prefix="candidates-quick-"))) if args.quick else []
    exp = build(load_config(config, FP32 + sets))
    with torch.no_grad():  # a trained-like state: LoRA B nonzero, so the adapters act
        gen = torch.Generator().manual_seed(0)
        for p in exp.model.trainable().values():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    reps = 1 if args.quick else args.reps
    torch.set_num_threads(1)
    rows = eval_rows(exp, reps)
    if args.compile:
        torch.set_num_threads(os.cpu_count() or 1)
        rows += compile_rows(exp, reps, 3)
    report("candidates", rows, ["candidate", "seconds", "unit", "gain", "max_abs_logit_diff", "compile_s"],
           args.quick, ["configs/fedavg-lora-minilm.toml (MiniLM, fortunes): its global test set; LoRA tensors "
                        "perturbed by N(0, 0.01²) from their init.",
                        "Evaluation rows: interleaved, median of the reps, process CPU seconds at 1 thread; "
                        "gain against the given order at batch 64; max_abs_logit_diff against it too.",
                        f"load average at the end: {os.getloadavg()[0]:.1f} (1 min)."])


if __name__ == "__main__":
    main()
