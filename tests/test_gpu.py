"""CUDA parity, `make test-gpu` (FEDSPLICE_TEST_GPU=1 on a machine with a CUDA GPU; deselected
everywhere else): the device computes what the CPU computes. fp32 on CUDA (IEEE: `fp32` keeps
TF32 off) equals the CPU's fp32 within 1e-4 relative; bf16 autocast stays within 3e-2 of the
logits' scale with gradients pointing the same way (cosine > 0.99); unpadded batches equal
padded ones on the device; fp16's gradient scaler lets steps through; many clients through one
base (model.grouped, federation.batched_train) equal each client alone on the device. Tiny random
models of each backbone family (tests/test_unpad.py builds them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_unpad import build, inputs, logits_and_grads

from fedsplice.model import taskmodel

pytestmark = pytest.mark.gpu
FAMILIES = ["bert", "clip", "llama", "vlm"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from fedsplice.data import zoo

    d = tmp_path_factory.mktemp("m")
    return {"bert": str(zoo.tiny_bert(d / "bert")), "clip": str(zoo.tiny_clip(d / "clip")),
            "llama": str(zoo.tiny_llama(d / "llama")), "vit": str(zoo.tiny_vit(d / "vit"))}


def assert_close(got, want, rtol: float) -> None:
    (lg, gg), (lw, gw) = got, want
    scale = lw.abs().max()
    assert scale > 0 and (lg - lw).abs().max() <= rtol * scale, float((lg - lw).abs().max() / scale)
    for n, g in gw.items():
        assert (gg[n] - g).abs().max() <= rtol * g.abs().max().clamp_min(1e-12), n


@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_fp32_equals_cpu_fp32(models, family):
    items = inputs(family)
    cpu = logits_and_grads(build(models, family, unpad="off"), items)
    cuda = logits_and_grads(build(models, family, unpad="off", device="cuda"), items)
    assert_close(cuda, cpu, 1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_autocast_stays_near_fp32(models, family):
    items = inputs(family)
    (l32, g32) = logits_and_grads(build(models, family, unpad="off"), items)
    (l16, g16) = logits_and_grads(build(models, family, unpad="off", device="cuda", precision="bf16"), items)
    assert (l16 - l32).abs().max() <= 3e-2 * l32.abs().max()
    for n, g in g32.items():
        assert torch.nn.functional.cosine_similarity(g16[n].flatten(), g.flatten(), dim=0) > 0.99, n


@pytest.mark.parametrize("family", FAMILIES)
def test_unpadded_equals_padded_on_cuda(models, family, monkeypatch):
    items = inputs(family)
    padded = logits_and_grads(build(models, family, unpad="off", device="cuda"), items)
    monkeypatch.setattr(taskmodel, "CPU_OVERHEAD", 0)  # every distinct length alone
    assert_close(logits_and_grads(build(models, family, unpad="on", device="cuda"), items), padded, 1e-4)


def test_fp16_scaler_steps(cfg_factory, tiny_bert_dir, toy_jsonl):
    from fedsplice.federation import build as build_exp
    from fedsplice.federation import tasks

    exp = build_exp(cfg_factory(tiny_bert_dir, toy_jsonl, runtime__device='"cuda"', runtime__precision='"fp16"',
                                algorithm='"lora"', method="{}"))
    cid = exp.train_ids[0]
    init = {n: t.clone() for n, t in exp.init_params.items()}
    exp.model.load_params(init)
    cc = dataclasses.replace(exp.cfg.client, max_steps=4, local_epochs=4)
    _, st = tasks.train_client(exp, cid, rnd=1, torch_round=1, ctx=tasks.train_context(exp, cid),
                               client_cfg=cc)
    moved = [n for n, p in exp.model.trainable().items() if not torch.equal(p.detach().cpu(), init[n].cpu())]
    assert st["steps"] == 4 and torch.isfinite(torch.tensor(st["loss"])) and moved



@pytest.fixture
def cuda_cfg(text_cfg):
    """text_cfg on the CUDA device: the CPU tests of model.grouped run through it unchanged."""
    return lambda **kw: text_cfg(runtime__device='"cuda"', **kw)


@pytest.mark.parametrize("model", [{}, dict(model__task='"causal_lm"')], ids=["encoder", "causal_lm"])
def test_grouped_lora_on_cuda_equals_each_client_alone(cuda_cfg, model):
    """model.grouped's segments (Rows.apply) on the device (issue 50): one predict over several clients'
    rows equals each client's model alone there, and the batched PM of a trained round equals
    the per-client one, within the CPU tests' tolerances."""
    import test_grouped as G

    G.test_each_row_through_its_clients_factors_equals_each_client_alone(cuda_cfg, model)
    G.test_batched_pm_equals_each_client_alone(cuda_cfg, "true", model)
    if model:  # the verbalizer's continuation and full layouts
        for method in ("cache", "full"):
            G.test_a_causal_lms_verbalizer_names_each_rows_owner_in_every_call(cuda_cfg, method)


@pytest.mark.parametrize("algo", [dict(algorithm='"pfadapter"'), dict(algorithm='"promptfl"', method="{}",
                                                                       peft__type='"prompt"'),
                                  dict(algorithm='"pfadapter"', model__task='"causal_lm"')])
def test_training_together_on_cuda_equals_one_client_after_another(cuda_cfg, algo):
    """federation.batched_train on the device: a round's clients trained together (LoRA through
    the grouped forward, on an encoder and a causal LM's verbalizer; PromptFL's class sides in one
    forward) equal one after another there."""
    import test_batched_train as T

    T.test_training_together_equals_one_client_after_another(cuda_cfg, algo, "sgd")
