"""The `clients` stage of scripts/gpu_check.py (issue 50): many clients through one base model.
PFAdapter on the Qwen2-1.5B shape (random weights, the tiny tokenizer, verbalizer scoring: a
causal LM), every client in every round, at 8, 32 and 128 clients a round (--small: 2, 4, 8 on
the small Llama), trained one after another (runtime.batch_train = "off") and together ("on":
one forward and backward over the frozen base a step, each row through its own client's LoRA,
batched_train.CHUNK clients a pass): clients trained per hour, peak memory and the memory each
added client costs. The two ways must agree (losses and accuracies, the parity stage's
tolerances)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gpucheck import fixtures as fx
from gpucheck.measure import Row, verdict
from gpucheck.runs import BF16_TOL, FP32_TOL, Ctx, max_diff

CLIENTS, SMALL_CLIENTS = (8, 32, 128), (2, 4, 8)


def _run(ctx: Ctx, data: Path, m: int, together: bool) -> tuple[object, float, int | None]:
    """One round of m clients: (RunResult, training seconds, peak GPU bytes or None on a CPU)."""
    import fedsplice

    steps = 2 if ctx.small else ctx.steps
    sets: dict[str, Any] = {"data.num_clients": m, "server.clients_per_round": m, "data.partition": "iid",
                                  "data.local_test_size": 8, "runtime.batch_train": "on" if together else "off"}
    cfg = fx.lm_config(ctx.llama(), data, ctx.device, ctx.precision, ctx.precision, steps=steps, batch=ctx.batch,
                       small=ctx.small, **sets)
    if ctx.cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(ctx.dev)
    res = fedsplice.run(cfg, ctx.work / f"clients-{m}-{'on' if together else 'off'}")
    train_s = sum(r["time_s"] for r in res.records() if r.get("round", 0) > 0)
    return res, train_s, torch.cuda.max_memory_allocated(ctx.dev) if ctx.cuda else None


def clients(ctx: Ctx) -> list[Row]:
    """Each m: one after another, then together; clients trained per hour, the batched run's
    agreement with the sequential one, and (CUDA) the memory per client added since the first m."""
    ms = SMALL_CLIENTS if ctx.small else CLIENTS
    per_class = max(ms) * (2 if ctx.small else ctx.steps) * ctx.batch // 4 + 16  # every client its steps' worth
    data = ctx.once("clients-data", lambda: fx.write_text_data(ctx.work / "data", per_class, name="clients.csv"))
    tol = FP32_TOL if ctx.precision == "fp32" else BF16_TOL
    rows: list[Row] = []
    first: dict[bool, tuple[int, int | None]] = {}
    for m in ms:
        apart, together = _run(ctx, data, m, False), _run(ctx, data, m, True)
        d = max_diff(apart[0], together[0])
        for (_, secs, peak), on in ((apart, False), (together, True)):
            first.setdefault(on, (m, peak))
            m0, p0 = first[on]
            per = f"; {(peak - p0) / (m - m0) / 2**20:,.1f} MiB per client added since {m0}" \
                if peak is not None and p0 is not None and m > m0 else ""
            how = "together" if on else "one after another"
            what = f"{'small Llama' if ctx.small else 'Qwen2-1.5B shape'}, pfadapter, {m} clients a round, {how}"
            text, ok = verdict(not on or d <= tol, (f"max diff {d:.2e} (<= {tol:g}) against one after another"
                                                    if on else "reference") + per)
            rows.append(Row("clients", what, ctx.device, ctx.precision, None, 3600 * m / secs, "clients/h",
                            peak_bytes=peak, check=f"{text}; training {secs:.1f} s", ok=ok))
    return rows
