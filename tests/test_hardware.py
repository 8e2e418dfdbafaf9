"""Issue 14 on a CPU: device resolution and placement, mixed precision (bf16 / fp16 autocast with
fp32 masters, a gradient scaler for fp16), `model.dtype`, a quantized base (bitsandbytes, which
runs on a CPU at the pinned version), a missing quantization backend, gradient checkpointing.
Speed lives in benchmarks/precision.py, never here."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.model.device import resolve_device, resolve_precision
from fedsplice.runtimes.inprocess import run_rounds

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def _run(cfg) -> tuple[object, list[dict]]:
    exp, records = build(cfg), []
    run_rounds(exp, MemoryStore(), records.append)
    return exp, records


def _linear_dtypes(model, texts) -> set:
    """The dtypes the backbone's Linear layers compute in during one training forward."""
    seen, hooks = set(), []
    for m in model.backbone.modules():
        if isinstance(m, torch.nn.Linear):
            hooks.append(m.register_forward_hook(lambda mod, a, out: seen.add(out.dtype)))
    try:
        model.train()
        with model.autocast():
            model(texts)
    finally:
        for h in hooks:
            h.remove()
    return seen


# ----------------------------------------------------------------------------- device


def test_auto_resolves_to_what_the_machine_has():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        want = "mps"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == torch.device("cpu")


@no_cuda
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_a_missing_cuda_device_is_a_one_line_error(name):
    with pytest.raises(ConfigError, match=r"runtime.device = 'cuda.*no CUDA device") as e:
        resolve_device(name)
    assert "\n" not in str(e.value)


@no_cuda
def test_cli_refuses_cuda_on_this_machine(tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(), ["runtime.device=cuda"], "runtime.device = 'cuda': this machine has no CUDA device")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "CPU", ""])
def test_a_misspelt_device_is_refused_at_load(tiny_cfg, bad):
    with pytest.raises(ConfigError, match="runtime.device"):
        tiny_cfg(runtime__device=f'"{bad}"')
    with pytest.raises(ConfigError, match=r"runtime.devices\[1\]"):
        tiny_cfg(runtime__devices=f'["cpu", "{bad}"]')


def test_model_and_uploads_live_where_they_should(tiny_cfg):
    exp, _ = _run(tiny_cfg(runtime__device='"cpu"'))
    assert exp.model.device == torch.device("cpu")
    assert {p.device.type for p in exp.model.parameters()} == {"cpu"}
    assert all(t.device.type == "cpu" for t in exp.init_params.values())
    assert exp.model.amp_dtype == torch.float32  # runtime.precision defaults to fp32


# ----------------------------------------------------------------------------- precision


def test_auto_precision_follows_the_cpu_flags_and_the_models_width(monkeypatch, tmp_path):
    """bf16 on a CPU with native bf16 for a model at least CPU_BF16_MIN_WIDTH (192) wide, and
    for a run that trains LoRA on a CPU with AMX at least AMX_LORA_MIN_WIDTH (768), where a
    training step measured faster (benchmarks/bf16_width.py, docs/performance.md); narrower (the
    tiny test models), or without the units, fp32. An unknown width counts as wide. The kind is
    read off /proc/cpuinfo's flags, AMX first."""
    import fedsplice.model.device as D

    assert D.CPU_BF16_MIN_WIDTH == {"avx512": 192, "amx": 192} and D.AMX_LORA_MIN_WIDTH == 768
    cpu = torch.device("cpu")
    bf, f32 = torch.bfloat16, torch.float32
    for kind, width, lora, want in (("avx512", None, True, bf), ("avx512", 192, True, bf), ("avx512", 384, False, bf),
                                    ("avx512", 191, False, f32), ("avx512", 32, True, f32), ("amx", 384, True, f32),
                                    ("amx", 767, True, f32), ("amx", 768, True, bf), ("amx", None, True, bf),
                                    ("amx", 384, False, bf), ("amx", 191, False, f32), (None, 384, False, f32),
                                    (None, None, True, f32)):
        monkeypatch.setattr(D, "cpu_bf16", lambda kind=kind: kind)
        assert resolve_precision("auto", cpu, width, lora) == want, (kind, width, lora)
        assert resolve_precision("fp32", cpu, width, lora) == torch.float32  # only "auto" looks
    assert resolve_precision("fp16", cpu, 32) == torch.float16
    monkeypatch.undo()
    real = D.Path
    for flags, kind in (("fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16", "amx"),
                        ("fpu avx2 avx512f avx512_bf16", "avx512"), ("fpu avx2 fma", None)):
        info = tmp_path / "cpuinfo"
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(D, "Path", lambda p, info=info: info if p == "/proc/cpuinfo" else real(p))
        assert D.cpu_bf16() == kind, flags
        monkeypatch.undo()


def test_auto_is_the_default_and_reads_the_widest_tower(tiny_cfg, tmp_path, monkeypatch):
    """runtime.precision defaults to "auto"; the width is the widest hidden size of the model's
    towers, read from config.json (a CLIP's text and vision configs; a VLM's vision tower too)."""
    import json

    import fedsplice.model.device as D
    from fedsplice.config import ExperimentConfig
    from fedsplice.model.loading import model_width, run_precision

    assert ExperimentConfig().runtime.precision == "auto"
    cfg = tiny_cfg()
    assert cfg.runtime.precision == "auto" and model_width(cfg) == 32
    monkeypatch.setattr(D, "cpu_bf16", lambda: "avx512")
    assert run_precision(cfg, torch.device("cpu")) == torch.float32  # hidden 32: bf16 measured slower
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({"model_type": "clip",
                                                  "text_config": {"hidden_size": 128, "num_attention_heads": 4},
                                                  "vision_config": {"hidden_size": 256, "num_attention_heads": 4}}))
    cfg.model.name = str(wide)
    assert model_width(cfg) == 256 and run_precision(cfg, torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(D, "cpu_bf16", lambda: "amx")  # LoRA on a CPU with AMX: bf16 from 768 wide
    assert cfg.peft.type == "lora" and run_precision(cfg, torch.device("cpu")) == torch.float32
    cfg.peft.type = "prompt"
    assert run_precision(cfg, torch.device("cpu")) == torch.bfloat16
    cfg.peft.type = "lora"
    monkeypatch.setattr(D, "cpu_bf16", lambda: "avx512")
    cfg.model.name = str(tmp_path / "missing")
    assert model_width(cfg) is None


def test_loading_a_model_bounds_the_kernel_caches_unless_the_user_set_them(tiny_cfg, monkeypatch):
    """Both oneDNN kernel caches get KERNEL_CACHE entries when a model loads (they read their
    variables at first use, so the load is the last moment); a value the user set stays."""
    import os

    from fedsplice.model.device import KERNEL_CACHE, KERNEL_CACHE_VARS
    from fedsplice.model.loading import load_pretrained

    onednn, ideep = KERNEL_CACHE_VARS
    monkeypatch.delenv(onednn, raising=False)
    monkeypatch.setenv(ideep, "7")
    load_pretrained(tiny_cfg())
    assert os.environ[onednn] == str(KERNEL_CACHE) == "64" and os.environ[ideep] == "7"


def test_auto_precision_on_cuda_asks_that_device_for_native_bf16(monkeypatch):
    """Capability 8.0+ (Ampere on) has bf16 units; a V100 (7.0) or T4 (7.5) only emulates bf16,
    which torch.cuda.is_bf16_supported() counts, and which is slower than fp32. The device asked
    for is the one checked, not GPU 0 (no CUDA needed: the query is stubbed)."""
    asked = []

    def capability(device=None):
        asked.append(device)
        return {0: (7, 5), 1: (9, 0)}[device.index]

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # emulation counts there
    before = torch.backends.cuda.matmul.fp32_precision  # a process-wide switch: put back below
    try:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        assert resolve_precision("fp32", torch.device("cuda:0")) == torch.float32
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"  # an explicit fp32 stays IEEE
        assert resolve_precision("auto", torch.device("cuda:0")) == torch.float32
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # auto: fp32 matmuls may use TF32
        assert resolve_precision("auto", torch.device("cuda:1")) == torch.bfloat16
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    assert [d.index for d in asked] == [0, 1]


def test_bf16_autocast_runs_the_matmuls_in_bf16_with_fp32_masters(tiny_cfg):
    exp = build(tiny_cfg(runtime__precision='"bf16"'))
    assert torch.bfloat16 in _linear_dtypes(exp.model, ["play the ball", "the moon"])
    assert {p.dtype for p in exp.model.trainable().values()} == {torch.float32}
    assert exp.model.predict(["play the ball"], 4).dtype == torch.float32


@pytest.mark.parametrize("precision, tol, ptol", [("bf16", 0.05, 0.1), ("fp16", 0.01, 0.03)])
def test_mixed_precision_run_lands_near_fp32(tiny_cfg, precision, tol, ptol):
    """The same tiny run in fp32 and under autocast: the training losses agree to `tol`
    (bf16 keeps 8 bits of mantissa, fp16 11), and the uploads stay fp32 on the CPU. The final
    GLOBAL tensors' update is the fp32 run's to `ptol` (relative distance; measured on this CPU:
    0.024 under bf16, 0.0062 under fp16)."""
    exp0, ref = build(tiny_cfg(algorithm='"lora"', method="{}")), []
    theta_ref = run_rounds(exp0, MemoryStore(), ref.append)["global_params"]
    exp, got = build(tiny_cfg(algorithm='"lora"', method="{}", runtime__precision=f'"{precision}"')), []
    theta = run_rounds(exp, MemoryStore(), got.append)["global_params"]
    assert exp.model.amp_dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for a, b in zip(ref[1:], got[1:]):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=tol)
        assert b["train_loss"] != a["train_loss"]  # autocast really ran in lower precision
    # the model it lands on: the update (final - initial GLOBAL tensors) is the fp32 run's, to `ptol`
    flat = lambda d: torch.cat([d[n].flatten() for n in exp.global_names])  # noqa: E731
    moved = flat(theta_ref) - flat(exp0.init_params)
    assert float(moved.norm()) > 0 and float((flat(theta) - flat(theta_ref)).norm()) <= ptol * float(moved.norm())


def test_fp16_scaler_with_a_grad_transform(tiny_cfg):
    """FedPuReL purifies per-loss gradients: under fp16 they are computed scaled and unscaled
    exactly before the transform (its statistics match the fp32 run's)."""
    _, ref = _run(tiny_cfg(algorithm='"fedpurel"', method="{}", peft__type='"prompt"'))
    _, got = _run(tiny_cfg(algorithm='"fedpurel"', method="{}", peft__type='"prompt"', runtime__precision='"fp16"'))
    for k in ("train_loss", "task_loss", "purified_steps"):
        assert got[1][k] == pytest.approx(ref[1][k], rel=0.02), k
    # the KL to the zero-shot logits is ~1e-3 here: fp16's logits (scale 20) move it by about that
    assert got[1]["align_loss"] == pytest.approx(ref[1]["align_loss"], abs=5e-3)
    assert got[-1]["gm"]["accuracy"] == pytest.approx(ref[-1]["gm"]["accuracy"], abs=0.1)


def test_backward_unscales_exactly_for_a_transform():
    """With a scaler the transform sees the unscaled gradients bit for bit, and the gradients
    it leaves are scaled again for scaler.step (which divides them back)."""
    from fedsplice.federation.train import backward

    w = torch.nn.Parameter(torch.tensor([0.3, -1.7, 2.5]))
    seen = []

    def transform(grads):
        seen.append({k: [g.clone() for g in v] for k, v in grads.items()})
        return [grads["task"][0] + grads["align"][0]], {}

    def losses():
        return {"task": (w ** 2).sum(), "align": (3 * w).sum()}

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for sc in (None, scaler):
        ls = losses()
        backward(ls, sum(ls.values()), [w], transform, {}, sc)
        if sc is None:
            plain = w.grad.clone()
    assert torch.equal(seen[0]["task"][0], seen[1]["task"][0])
    assert torch.equal(seen[0]["align"][0], seen[1]["align"][0])
    assert torch.equal(w.grad, plain * 2.0 ** 10)


def test_bf16_base_weights_halve_memory_and_keep_fp32_adapters(tiny_cfg):
    exp = build(tiny_cfg(model__dtype='"bf16"', runtime__precision='"bf16"'))
    frozen = {p.dtype for p in exp.model.backbone.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert {p.dtype for p in exp.model.trainable().values()} == {torch.float32}
    records = []
    run_rounds(exp, MemoryStore(), records.append)
    assert torch.isfinite(torch.tensor(records[-1]["train_loss"]))


def test_bf16_base_needs_autocast(tiny_cfg):
    with pytest.raises(ConfigError, match="model.dtype = 'bf16'.*runtime.precision"):
        build(tiny_cfg(model__dtype='"bf16"'))


# ----------------------------------------------------------------------------- quantization


def test_missing_quantization_backend_exits_2(tiny_cfg, cli_refuses, monkeypatch, tiny_llama_dir, cfg_factory,
                                              toy_jsonl):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    cfg = cfg_factory(tiny_llama_dir, toy_jsonl, model__task='"causal_lm"')
    cli_refuses(cfg, ["model.quantization=nf4"], "model.quantization = 'nf4' needs bitsandbytes")


def test_quantization_needs_lora(tiny_cfg):
    with pytest.raises(ConfigError, match="model.quantization = 'int8'.*peft.type = 'lora'"):
        tiny_cfg(model__quantization='"int8"', algorithm='"promptfl"', peft__type='"prompt"')


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_qlora_trains_on_a_quantized_base(cfg_factory, tiny_llama_dir, toy_jsonl, quant):
    import bitsandbytes as bnb

    cfg = cfg_factory(tiny_llama_dir, toy_jsonl, model__task='"causal_lm"', model__quantization=f'"{quant}"',
                      runtime__precision='"bf16"', algorithm='"lora"', method="{}")
    exp = build(cfg)  # builds the zero-shot caches first: a no-grad eval forward before training
    kind = bnb.nn.Linear4bit if quant == "nf4" else bnb.nn.Linear8bitLt
    assert any(isinstance(m, kind) for m in exp.model.backbone.modules())
    before = {n: t.clone() for n, t in exp.model.trainable().items()}
    records = []
    run_rounds(exp, MemoryStore(), records.append)
    after = exp.model.trainable()
    moved = [n for n in before if "lora_A" in n and not torch.equal(before[n], after[n].detach().cpu())]
    assert moved, "no LoRA A tensor changed: the quantized base passed no gradient"
    assert torch.isfinite(torch.tensor(records[-1]["train_loss"]))


# ----------------------------------------------------------------------------- graphs freed


@pytest.mark.parametrize("algorithm", ["fedpurel", "pfadapter"])
def test_a_steps_graph_is_freed_before_the_next_step(cfg_factory, tiny_bert_dir, toy_jsonl, algorithm):
    """Every activation a training step's forward made is gone when the next step's forward runs:
    no graph outlives its step. FedPuReL takes one gradient per loss (autograd.grad) and keeps the
    graph for the next loss only; PFAdapter sums its losses. (With retain_graph on the last loss
    the graph lived until the next step: about 2x activation memory.)"""
    import weakref

    from torch.optim.optimizer import register_optimizer_step_post_hook

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, algorithm=f'"{algorithm}"', client__max_steps=3, server__rounds=1)
    exp = build(cfg)
    layer = next(m for m in exp.model.backbone.modules() if type(m).__name__ == "BertLayer")
    current, finished, alive, steps = [], [], [], []

    def forward(module, args, out):
        if torch.is_grad_enabled():
            alive.extend(r for r in finished if r() is not None)
            finished.clear()
            current.append(weakref.ref(out[0] if isinstance(out, tuple) else out))

    def step(*_):
        steps.append(1)
        finished.extend(current)
        current.clear()

    hooks = [layer.register_forward_hook(forward), register_optimizer_step_post_hook(step)]
    try:
        run_rounds(exp, MemoryStore(), lambda r: None)
    finally:
        for h in hooks:
            h.remove()
    assert len(steps) >= 4 and not alive, (len(steps), len(alive))


# ----------------------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_engages_and_changes_nothing(tiny_cfg, monkeypatch):
    from transformers.modeling_layers import GradientCheckpointingLayer

    _, ref = _run(tiny_cfg(algorithm='"lora"', method="{}"))
    cfg = tiny_cfg(algorithm='"lora"', method="{}", model__gradient_checkpointing=True)
    exp, calls = build(cfg), []
    for m in exp.model.backbone.modules():
        if isinstance(m, GradientCheckpointingLayer):
            fn = m._gradient_checkpointing_func
            m._gradient_checkpointing_func = lambda *a, fn=fn, **k: (calls.append(1), fn(*a, **k))[1]
    got = []
    run_rounds(exp, MemoryStore(), got.append)
    assert calls, "no layer was checkpointed"
    for a, b in zip(ref, got):
        assert b["gm"]["accuracy"] == pytest.approx(a["gm"]["accuracy"], abs=1e-6)
        if "train_loss" in a:
            assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)


def test_the_run_says_what_auto_resolved_to(tiny_cfg, monkeypatch):
    import fedsplice.model.device as D
    from fedsplice.app.summary import hardware_line

    monkeypatch.setattr(D, "cpu_bf16", lambda: "avx512")
    monkeypatch.setattr(D, "CPU_BF16_MIN_WIDTH", {"avx512": 32})  # the tiny model counts as wide here
    cfg = tiny_cfg(runtime__device='"cpu"', runtime__precision='"auto"', model__gradient_checkpointing=True)
    exp = build(cfg)
    assert exp.model.amp_dtype == torch.bfloat16
    assert hardware_line(cfg, exp) == "device cpu, bf16 autocast (auto), gradient checkpointing"
    monkeypatch.setattr(D, "CPU_BF16_MIN_WIDTH", {"avx512": 192})
    exp = build(cfg)
    assert exp.model.amp_dtype == torch.float32
    assert hardware_line(cfg, exp) == "device cpu, fp32 (auto), gradient checkpointing"


def test_caches_take_bf16_rows_and_weights():
    """Under bf16 autocast a cached row can come out of a Linear in bf16, and a bf16 base is
    fingerprinted: both are stored / hashed as their bytes (numpy has no bf16)."""
    from fedsplice.model.cache import FrozenCache, fingerprint

    w = torch.randn(4, 3)
    assert fingerprint([w]) != fingerprint([w.bfloat16()])
    cache = FrozenCache({"kind": "t"}, 1 << 20)
    rows = cache.rows(["a", "b"], lambda ts: [torch.ones(2, dtype=torch.bfloat16) * len(t) for t in ts])
    again = cache.rows(["a", "b"], lambda ts: pytest.fail("cached rows were computed again"))
    assert [r.dtype for r in rows] == [r.dtype for r in again] == [torch.float32] * 2
    assert all(torch.equal(x, y) for x, y in zip(rows, again))


def test_cosine_logits_are_fp32_under_bf16_autocast():
    """At CLIP's scale 100 a bf16 product rounds logits by up to ~0.25; the scorers' last step runs
    in fp32 outside autocast, bit for bit the fp32 result."""
    from fedsplice.model.scorers import cosine_logits

    g = torch.Generator().manual_seed(0)
    x, ce = torch.randn(64, 512, generator=g), torch.nn.functional.normalize(torch.randn(10, 512, generator=g), dim=-1)
    ref = 100.0 * torch.nn.functional.normalize(x, dim=-1) @ ce.T
    assert torch.equal(cosine_logits(100.0, x, ce), ref)  # fp32: unchanged
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = cosine_logits(100.0, x, ce)
        naive = 100.0 * torch.nn.functional.normalize(x, dim=-1) @ ce.T
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    assert naive.dtype == torch.bfloat16 and (naive.float() - ref).abs().max() > 0.01  # what it avoids


def test_an_accelerator_gets_the_weights_as_they_load(tiny_cfg, monkeypatch):
    """On a GPU the base loads straight onto it (transformers' device_map): no second copy of the
    weights on the host. On the CPU no device_map is passed (the plain load). The call is stubbed:
    this machine has no GPU."""
    import transformers

    from fedsplice.model.loading import load_pretrained

    seen, real = [], transformers.AutoModel.from_pretrained
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained",
                        lambda path, **kw: (seen.append(kw.get("device_map")), real(path))[1])
    cfg = tiny_cfg()
    load_pretrained(cfg, torch.device("cuda:1"))
    load_pretrained(cfg, torch.device("cpu"))
    assert seen == [{"": "cuda:1"}, None]
