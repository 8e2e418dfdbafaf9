"""The `clients` stage of scripts/gpu_check.py (issue 50): many clients through one base model.
PFAdapter on a BERT-base-shaped encoder (random weights, the tiny tokenizer), every client in
every round, at 8, 32 and 128 clients a round (--small: 2, 4, 8), trained one after another
(runtime.batch_train = "off") and together ("on": one forward and backward over the frozen base
a step, each row through its own client's LoRA): clients trained per hour, peak memory and the
memory each added client costs. The two ways must agree (losses and accuracies, the parity
stage's tolerances).

The issue names the Qwen2-1.5B shape: batched training covers text encoders and CoOp contexts,
not causal LMs yet, so a causal LM here would train one client after another either way."""

from __future__ import annotations

from pathlib import Path

import torch

from gpucheck import fixtures as fx
from gpucheck.measure import Row, verdict
from gpucheck.runs import BF16_TOL, FP32_TOL, Ctx, max_diff

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
SMALL_BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
CLIENTS, SMALL_CLIENTS = (8, 32, 128), (2, 4, 8)


def bert(work: Path, name: str, shape: dict, device: str) -> Path:
    """A random BERT of `shape` with the tiny tokenizer (built on CUDA when there: fast init)."""
    from transformers import BertConfig, BertModel

    from fedsplice.data.tiny import build_seeded, tiny_tokenizer

    out = work / name
    tok = tiny_tokenizer(style="bert")
    cfg = BertConfig(vocab_size=len(tok), max_position_embeddings=512, type_vocab_size=2,
                     pad_token_id=tok.pad_token_id, **shape)
    model = build_seeded(lambda: BertModel(cfg), 0, device if device.startswith("cuda") else None)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def _run(ctx: Ctx, model: Path, data: Path, m: int, together: bool) -> tuple[object, float, int | None]:
    """One round of m clients: (RunResult, training seconds, peak GPU bytes or None on a CPU)."""
    import fedsplice

    steps = 2 if ctx.small else ctx.steps
    cfg = fx.bert_config(model, data, ctx.device, ctx.precision, **{
        "data.num_clients": m, "server.clients_per_round": m, "data.partition": "iid",
        "client.max_steps": steps, "client.batch_size": ctx.batch, "data.local_test_size": 8,
        "runtime.batch_train": "on" if together else "off"})
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
    model = ctx.once("bert-base", lambda: bert(ctx.work / "models", "bert-shape", SMALL_BERT if ctx.small
                                               else BERT_BASE, ctx.device))
    per_class = max(ms) * (2 if ctx.small else ctx.steps) * ctx.batch // 4 + 16  # every client its steps' worth
    data = ctx.once("clients-data", lambda: fx.write_text_data(ctx.work / "data", per_class, name="clients.csv"))
    tol = FP32_TOL if ctx.precision == "fp32" else BF16_TOL
    rows: list[Row] = []
    first: dict[bool, tuple[int, int | None]] = {}
    for m in ms:
        apart, together = _run(ctx, model, data, m, False), _run(ctx, model, data, m, True)
        d = max_diff(apart[0], together[0])
        for (_, secs, peak), on in ((apart, False), (together, True)):
            first.setdefault(on, (m, peak))
            m0, p0 = first[on]
            per = f"; {(peak - p0) / (m - m0) / 2**20:,.1f} MiB per client added since {m0}" \
                if peak is not None and p0 is not None and m > m0 else ""
            how = "together" if on else "one after another"
            what = f"{'small BERT' if ctx.small else 'BERT-base shape'}, pfadapter, {m} clients a round, {how}"
            text, ok = verdict(not on or d <= tol, (f"max diff {d:.2e} (<= {tol:g}) against one after another"
                                                    if on else "reference") + per)
            rows.append(Row("clients", what, ctx.device, ctx.precision, None, 3600 * m / secs, "clients/h",
                            peak_bytes=peak, check=f"{text}; training {secs:.1f} s", ok=ok))
    return rows
