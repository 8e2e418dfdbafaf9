"""The stages of scripts/gpu_check.py at scale: gradient checkpointing with a multi-token answer,
a throughput sweep over batch x length on the Qwen2-1.5B shape with its real vocabulary, and the
shipped 7B nf4 VLM config under a memory cap."""

from __future__ import annotations

import math

import torch

from gpucheck import fixtures as fx
from gpucheck.measure import Row, verdict
from gpucheck.runs import BF16_TOL, FP32_TOL, Ctx, loss_text, losses, max_diff, timed, utilisation

SWEEP = ((8, 256), (16, 512), (32, 512))  # (batch, length): 2k, 8k and 16k tokens a step
SMALL_SWEEP = ((4, 32), (8, 64))
TARGET = 0.40  # issue 27: LoRA on the 1.5B shape at >= 8k tokens a batch, bf16, H200


def checkpointing(ctx: Ctx) -> list[Row]:
    """The Llama with the real vocabulary, answers of two words (so several tokens: the verbalizer
    scores them through its full path under checkpointing), 1 round with gradient checkpointing
    off and on: the same losses and metrics, and on CUDA less peak memory with it on."""
    shape = ctx.llama_shape(vocab=True)
    data = ctx.once("long-labels", lambda: fx.write_text_data(ctx.work / "data", 24 if ctx.small else 64,
                                                              labels=fx.LONG_LABELS, name="long-labels.csv"))
    p = ctx.precision
    runs = []
    for on in (False, True):
        cfg = fx.lm_config(ctx.llama(vocab=True), data, ctx.device, p, p, rounds=1, steps=ctx.steps,
                           batch=ctx.batch, small=ctx.small, **{"model.gradient_checkpointing": on})
        runs.append(timed(cfg, ctx.work / f"ckpt-{on}", shape["hidden_size"]))
    (off, s_off, _), (on_, s_on, _) = runs
    tol = FP32_TOL if p == "fp32" else BF16_TOL
    d = max_diff(off, on_)
    less = s_on["peak"] < s_off["peak"] if ctx.cuda else True
    text, ok = verdict(d <= tol and less, f"max diff {d:.2e} (<= {tol:g}) against checkpointing off"
                       + (f"; peak memory {'below' if less else 'NOT below'} off's" if ctx.cuda else "")
                       + "; tokens: the full path's B x C sequences, not comparable with off's")
    what = f"Llama{' + real vocab' if not ctx.small else ''}, 2-word answers, pfadapter"
    return [Row("checkpointing", f"{what}, off", ctx.device, p, s_off["step_s"], s_off["rate"], "tok/s",
                utilisation(ctx, s_off["rate"], shape, p), peak_bytes=s_off["peak"], check="reference"),
            Row("checkpointing", f"{what}, on", ctx.device, p, s_on["step_s"], s_on["rate"], "tok/s",
                utilisation(ctx, s_on["rate"], shape, p), peak_bytes=s_on["peak"], check=text, ok=ok)]


def throughput(ctx: Ctx) -> list[Row]:
    """LoRA training (PFAdapter) on the Llama with the real vocabulary, one client a round, texts
    of exactly `length` tokens (no padding): tokens/s, utilisation against the preflight's matmul
    rate, CUDA syncs per step from the profiler (the first point only: profiling slows the run)."""
    shape, p = ctx.llama_shape(vocab=True), ctx.precision
    rows = []
    for i, (batch, length) in enumerate(SMALL_SWEEP if ctx.small else SWEEP):
        data = ctx.once(f"len{length}", lambda n=length, b=batch: fx.write_text_data(
            ctx.work / "data", 3 * b if ctx.small else 128, words=(n, n + 8), name=f"len{n}.csv"))
        cfg = fx.lm_config(ctx.llama(vocab=True), data, ctx.device, p, p, rounds=1, steps=3 if ctx.small else 6,
                           batch=batch, small=ctx.small, max_length=length, **{"server.clients_per_round": 1})
        res, s, syncs = timed(cfg, ctx.work / f"sweep-{batch}x{length}", shape["hidden_size"], profile=i == 0)
        u = utilisation(ctx, s["rate"], shape, p)
        ls = losses(res)
        note = ""
        if ctx.cuda and not ctx.small and batch * length >= 8192 and u is not None:
            note = f"; target {TARGET:.0%}: {'met' if u >= TARGET else 'MISSED'}"
        text, ok = verdict(bool(ls) and all(math.isfinite(v) for v in ls), f"loss {loss_text(ls)}{note}")
        rows.append(Row("throughput", f"batch {batch} x {length} tokens, pfadapter", ctx.device, p, s["step_s"],
                        s["rate"], "tok/s", u, syncs, s["peak"], text, ok))
    return rows


def memory(ctx: Ctx) -> list[Row]:
    """configs/pfadapter-qwen2-7b-nf4.toml on random weights of its shapes (Qwen2-7B with its
    vocabulary, SigLIP-so400m as a CLIP vision tower: 729 patches + CLS at 384 px), capped at
    `mem_cap_gib` of GPU memory: 1 round of 2 clients, 2 steps of the config's batch of 16.
    --small runs the same code on the small Llama and vision tower, with no cap on a CPU."""
    shape = fx.SMALL_LLAMA if ctx.small else fx.QWEN2_7B
    vis = fx.SMALL_VISION if ctx.small else fx.SO400M
    models = ctx.work / "models"
    lm = ctx.once("7b", lambda: fx.llama(models, "qwen2-7b-shape", shape, ctx.device))
    tower = ctx.once("so400m", lambda: fx.vision_tower(models, "so400m-shape", vis, ctx.device))
    vqa = ctx.once("vqa", lambda: fx.write_vqa_data(ctx.work / "vqa", 12 if ctx.small else 24, vis["image_size"]))
    cfg = fx.vlm_config(lm, tower, vqa, ctx.device, steps=2, small=ctx.small)
    cap = None
    if ctx.cuda:
        torch.cuda.empty_cache()  # what building the models left cached would count against the cap
        total = torch.cuda.get_device_properties(ctx.dev).total_memory
        cap = min(1.0, ctx.mem_cap_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(cap, ctx.dev)
    try:
        res, s, _ = timed(cfg, ctx.work / "qwen2-7b-nf4", shape["hidden_size"])
        ls = losses(res)
        under = s["peak"] is None or s["peak"] <= ctx.mem_cap_gib * 2**30
        text, ok = verdict(bool(ls) and all(math.isfinite(v) for v in ls) and under,
                           f"loss {loss_text(ls)}" + (f"; peak {'within' if under else 'OVER'} {ctx.mem_cap_gib:g} GiB"
                                           if ctx.cuda else "; no cap on a CPU"))
    except torch.OutOfMemoryError as e:
        s, text, ok = {"step_s": None, "rate": None, "peak": None}, f"FAIL: out of memory under the cap: " \
            f"{str(e).splitlines()[0]}", False
    finally:
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, ctx.dev)
    what = "VLM --small shapes" if ctx.small else "Qwen2-7B + so400m shapes"
    return [Row("memory", f"{what}, nf4, checkpointing, pfadapter", ctx.device, "bf16 (base nf4)", s["step_s"],
                s["rate"], "tok/s", peak_bytes=s["peak"], check=text, ok=ok)]
