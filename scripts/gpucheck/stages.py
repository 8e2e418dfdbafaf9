"""The first stages of scripts/gpu_check.py (preflight, parity, precision, quantization, workers);
gpucheck.scale holds the ones at scale. Each takes the Ctx and returns Rows; every run goes
through fedsplice's own entry points (`fedsplice.run`, or `build` + `run_rounds` where a stage
must look at the model's tensors)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch

from gpucheck import fixtures as fx
from gpucheck.measure import Row, peak_flops, skipped, verdict
from gpucheck.runs import BF16_TOL, FP32_TOL, Ctx, loss_text, losses, max_diff, timed, utilisation

# ----------------------------------------------------------------------------- preflight


def preflight(ctx: Ctx) -> list[Row]:
    """Versions, what `auto` resolves to, and the achievable matmul rate in bf16 and fp32."""
    import peft
    import transformers

    from fedsplice.model.device import resolve_precision

    bnb = importlib.util.find_spec("bitsandbytes")
    vers = (f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
            f"peft {peft.__version__}, bitsandbytes {'present' if bnb else 'absent'}")
    n = 512 if ctx.small else (8192 if ctx.cuda else 2048)
    rows = []
    if ctx.cuda:
        tf32 = torch.backends.cuda.matmul.fp32_precision
        auto = resolve_precision("auto", ctx.dev)  # sets TF32 process-wide: put back for the parity stages
        torch.backends.cuda.matmul.fp32_precision = tf32
        cap = torch.cuda.get_device_capability(ctx.dev)
        want = torch.bfloat16 if cap[0] >= 8 else torch.float32
        where = f"{torch.cuda.get_device_name(ctx.dev)}, compute capability {cap[0]}.{cap[1]}"
        text, ok = verdict(auto == want, f"{where}; auto -> {auto} (want {want}) + TF32; {vers}")
    else:
        text, ok = verdict(True, f"CPU; {vers}")
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        ctx.peak[name] = peak_flops(ctx.dev, dtype, n)
        rows.append(Row("preflight", f"{n}^3 matmul", ctx.device, name, rate=ctx.peak[name] / 1e12,
                        unit="TFLOP/s", check=text, ok=ok))
    return rows


# ----------------------------------------------------------------------------- parity


def parity(ctx: Ctx) -> list[Row]:
    """Tiny BERT, Llama and CLIP, 1 round: CUDA fp32 against CPU fp32; on a CPU, bf16 autocast
    against fp32 instead (identical is a FAIL: autocast did not act)."""
    from fedsplice.data.tiny import tiny_bert, tiny_clip, tiny_llama

    m = ctx.work / "models"
    builds = {"tiny BERT": (lambda: tiny_bert(m / "tiny-bert"), fx.bert_config, ctx.text(), 32),
              "tiny Llama": (lambda: tiny_llama(m / "tiny-llama"), fx.lm_config, ctx.text(), 32),
              "tiny CLIP": (lambda: tiny_clip(m / "tiny-clip"), fx.clip_config, ctx.images(32), 32)}
    return [parity_row(ctx, name, ctx.once(name, make), conf, data, width)
            for name, (make, conf, data, width) in builds.items()]


def parity_row(ctx: Ctx, name: str, model: Path, conf, data: Path, width: int) -> Row:
    other = (ctx.device, "fp32") if ctx.cuda else ("cpu", "bf16")
    tol = FP32_TOL if ctx.cuda else BF16_TOL
    args = (lambda dev, p: (model, data, dev, p, "fp32")) if conf is not fx.bert_config else (
        lambda dev, p: (model, data, dev, p))
    slug = name.replace(" ", "-")
    ref, _, _ = timed(conf(*args("cpu", "fp32")), ctx.work / f"parity-{slug}-cpu", width)
    res, s, _ = timed(conf(*args(*other)), ctx.work / f"parity-{slug}", width, per_token="CLIP" not in name)
    d = max_diff(ref, res)
    inert = not ctx.cuda and d == 0.0
    text, ok = verdict(d <= tol and not inert, f"max diff {d:.2e} {'<=' if d <= tol else '>'} {tol:g}"
                       + (" (identical: bf16 had no effect)" if inert else ""))
    what = f"{other[0]} {other[1]} vs cpu fp32"
    return Row("parity", f"{name}, {res.method}", what, other[1], s["step_s"], s["rate"],
               "tok/s" if "CLIP" not in name else "img/s", peak_bytes=s["peak"], check=text, ok=ok)


# ----------------------------------------------------------------------------- precision


def precision(ctx: Ctx) -> list[Row]:
    """The real shapes in the run's precision (Llama of Qwen2-1.5B under PFAdapter, CLIP of
    ViT-B/16 under FedPuReL, 2 rounds: finite losses, tokens/s and utilisation), then fp16 on the
    Llama, whose gradient scaler must let optimizer steps through."""
    p, shape = ctx.precision, ctx.llama_shape()
    kw: fx.Budget = {"rounds": 2, "steps": ctx.steps, "batch": ctx.batch, "small": ctx.small}
    clip_shape = fx.SMALL_CLIP if ctx.small else fx.VIT_B16
    clip = ctx.once("clip", lambda: fx.clip(ctx.work / "models", "clip", clip_shape, ctx.device))
    size = clip_shape["vision"]["image_size"]
    rows = [finite_row(ctx, "Llama", fx.lm_config(ctx.llama(), ctx.text(), ctx.device, p, p, **kw),
                       shape["hidden_size"], True, shape),
            finite_row(ctx, "CLIP", fx.clip_config(clip, ctx.images(size), ctx.device, p, p, **kw),
                       clip_shape["vision"]["hidden_size"], False, None)]
    one_round: fx.Budget = {**kw, "rounds": 1}
    cfg = fx.lm_config(ctx.llama(), ctx.text(), ctx.device, "fp16", "fp16", **one_round)
    res, s, _ = timed(cfg, ctx.work / "fp16", shape["hidden_size"])
    want = cfg.server.clients_per_round * cfg.client.max_steps
    ok = s["steps"] * 2 >= want and all(math.isfinite(v) for v in losses(res))
    text, ok = verdict(ok, f"{s['steps']} of {want} optimizer steps taken (the scaler skips a step on an "
                           f"overflow), loss {loss_text(losses(res))}")
    rows.append(Row("precision", f"{label(ctx, 'Llama')}, pfadapter", ctx.device, "fp16 (base fp16)", s["step_s"],
                    s["rate"], "tok/s", peak_bytes=s["peak"], check=text, ok=ok))
    return rows


def label(ctx: Ctx, family: str) -> str:
    real = {"Llama": "Qwen2-1.5B shape", "CLIP": "ViT-B/16 shape"}[family]
    return f"{family}, {'--small shape' if ctx.small else real}"


def finite_row(ctx: Ctx, family: str, cfg, width: int, per_token: bool, shape: dict | None) -> Row:
    """One timed run; its check: every round ran with a finite training loss."""
    res, s, _ = timed(cfg, ctx.work / f"run-{family}", width, per_token)
    ls = losses(res)
    text, ok = verdict(len(ls) == cfg.server.rounds and all(math.isfinite(v) for v in ls),
                       f"{len(ls)} rounds, loss {loss_text(ls)}")
    prec = cfg.runtime.precision
    return Row("precision", f"{label(ctx, family)}, {cfg.algorithm}", ctx.device, f"{prec} (base {cfg.model.dtype})",
               s["step_s"], s["rate"], "tok/s" if per_token else "img/s",
               utilisation(ctx, s["rate"], shape, prec) if shape else None, peak_bytes=s["peak"], check=text, ok=ok)


# ----------------------------------------------------------------------------- quantization


def quant(ctx: Ctx) -> list[Row]:
    """nf4 and int8 bases (bitsandbytes), PFAdapter, 1 round: LoRA A and B both move, the trainable
    tensors' names equal the unquantized model's, and a round trip (the trained tensors loaded
    into a fresh quantized model) gives the same tensors and bit-identical predictions."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return [skipped("quant", f"{q} base", ctx.device, "bitsandbytes is not installed") for q in ("nf4", "int8")]
    from fedsplice.federation.experiment import build

    kw: fx.Budget = {"rounds": 1, "steps": 2, "batch": 8, "small": ctx.small}
    plain = build(fx.lm_config(ctx.llama(), ctx.text(), ctx.device, "bf16", "bf16", **kw))
    names = set(plain.model.trainable())
    del plain
    return [quant_row(ctx, q, names, kw) for q in ("nf4", "int8")]


def quant_row(ctx: Ctx, q: str, names: set, kw: fx.Budget) -> Row:
    from fedsplice.federation.experiment import build
    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.inprocess import run_rounds

    sets: dict[str, Any] = {"model.quantization": q}  # a dotted config key: one of lm_config's **extra
    cfg = fx.lm_config(ctx.llama(), ctx.text(), ctx.device, "bf16", "bf16", **kw, **sets)
    exp = build(cfg)
    recs: list[dict] = []
    before = {n: t.detach().cpu().clone() for n, t in exp.init_params.items()}
    run_rounds(exp, MemoryStore(), recs.append)
    after = {n: t.detach().cpu().clone() for n, t in exp.model.trainable().items()}
    moved = {k: [n for n in before if k in n and not torch.equal(before[n], after[n])] for k in ("lora_A", "lora_B")}
    texts = [line.split(",", 1)[1] for line in ctx.text().read_text().splitlines()[1:9]]
    logits = exp.model.predict(texts, 8)
    fresh = build(cfg)
    fresh.model.load_params(after)
    back = {n: t.detach().cpu() for n, t in fresh.model.trainable().items()}
    same = all(torch.equal(after[n], back[n]) for n in after) and torch.equal(logits, fresh.model.predict(texts, 8))
    ok = bool(moved["lora_A"] and moved["lora_B"]) and set(after) == names and same
    text, ok = verdict(ok, f"{len(moved['lora_A'])} A / {len(moved['lora_B'])} B tensors moved; names "
                           f"{'equal' if set(after) == names else 'DIFFER from'} the unquantized model's; "
                           f"round trip {'exact' if same else 'NOT exact'}; loss {loss_text([recs[-1]['train_loss']])}")
    return Row("quant", f"{label(ctx, 'Llama')}, {q} base, pfadapter", ctx.device, "bf16", check=text, ok=ok)


# ----------------------------------------------------------------------------- workers


def workers(ctx: Ctx) -> list[Row]:
    """The tiny Llama, PFAdapter, 2 rounds with runtime.workers = 2 on the one device against
    workers = 1: the same metrics (client c always trains on worker c % workers)."""
    from fedsplice.data.tiny import tiny_llama

    model = ctx.once("tiny Llama", lambda: tiny_llama(ctx.work / "models" / "tiny-llama"))
    kw: fx.Budget = {"rounds": 2, "steps": 2, "batch": 8, "small": True}
    one, _, _ = timed(fx.lm_config(model, ctx.text(), ctx.device, "fp32", "fp32", **kw), ctx.work / "w1", 32)
    two, s, _ = timed(fx.lm_config(model, ctx.text(), ctx.device, "fp32", "fp32", **kw,
                                   **{"runtime.workers": 2}), ctx.work / "w2", 32)
    d = max_diff(one, two)
    text, ok = verdict(d <= 1e-5, f"max diff against workers = 1: {d:.2e} (<= 1e-5); {two.time_s:.1f} s "
                                  f"against {one.time_s:.1f} s")
    return [Row("workers", "tiny Llama, pfadapter, workers = 2", ctx.device, "fp32", check=text, ok=ok)]
