"""Unpadded batches (fedsplice.model.unpad): the grouping's exact cuts, and the same logits and
gradients as the padded batch on every backbone family (BERT-style, CLIP, Llama-style, VLM)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsplice.config import DataConfig, ExperimentConfig, ModelConfig, PeftConfig, RuntimeConfig
from fedsplice.data import zoo
from fedsplice.data.samples import Sample
from fedsplice.model import taskmodel
from fedsplice.model.taskmodel import TaskModel
from fedsplice.model.unpad import CPU_OVERHEAD, by_length, groups

CLASSES = ["circle", "square", "triangle"]
# lengths from 2 to about 30 tokens: a padded batch of them is mostly padding
TEXTS = ["a", "the moon is up and it is a good day to study the earth and the plant system",
         "play", "song of the sea", "a b c d e f g h i j k l m n o p q r s t u v w x y z",
         "team win", "listen to the sound of the note", "run"]


def test_groups_cut_where_the_padding_saved_pays_for_a_call():
    # sorted [5, 5, 60, 60]: one group costs 4*60 + 64 = 304, two cost 2*5 + 64 + 2*60 + 64 = 258
    assert groups([60, 5, 60, 5], 64) == [[1, 3], [0, 2]]
    assert groups([60, 5, 60, 5], 200) == [[1, 3, 0, 2]]  # 304 + ... < 258 + 136: one call
    # no call cost: every distinct length alone; equal lengths share a call
    assert groups([3, 1, 2, 1], 0) == [[1, 3], [2], [0]]
    assert groups([7], 0) == [[0]]


def test_by_length_returns_rows_in_order_with_their_gradient():
    x = torch.arange(6.0, requires_grad=True)
    lengths = [9, 1, 9, 1, 5, 5]
    calls = []

    def fn(idx):
        calls.append(idx)
        return x[idx] * torch.tensor([float(lengths[i]) for i in idx])

    out = by_length(lengths, fn, 0)
    assert calls == [[1, 3], [4, 5], [0, 2]]
    assert out.tolist() == [0.0, 1.0, 18.0, 3.0, 20.0, 25.0]
    out.sum().backward()
    assert x.grad.tolist() == [9.0, 1.0, 9.0, 1.0, 5.0, 5.0]
    calls.clear()
    assert by_length(lengths, fn, None).tolist() == out.tolist() and calls == [list(range(6))]
    calls.clear()  # one group (no cut pays): one call, the rows in their own order
    assert by_length(lengths, fn, 10**6).tolist() == out.tolist() and calls == [list(range(6))]
    # `within` (a batched round's owners): each call's rows ordered by it, the result in order still
    calls.clear()
    assert by_length(lengths, fn, 0, within=[0, 1, 0, 0, 1, 0]).tolist() == out.tolist()
    assert calls == [[3, 1], [5, 4], [0, 2]]
    calls.clear()
    assert by_length(lengths, fn, None, within=[1, 1, 0, 0, 1, 0]).tolist() == out.tolist()
    assert calls == [[2, 3, 5, 0, 1, 4]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("m")
    return {"bert": str(zoo.tiny_bert(d / "bert")), "clip": str(zoo.tiny_clip(d / "clip")),
            "llama": str(zoo.tiny_llama(d / "llama")), "vit": str(zoo.tiny_vit(d / "vit"))}


def build(models, family: str, unpad: str = "auto", device: str = "cpu", precision: str = "fp32", **peft) -> TaskModel:
    if family == "clip":
        peft.setdefault("tower", "text_model")  # the inputs are texts: the image tower gets no gradient
    model = {"bert": ModelConfig(name=models["bert"], task="encoder_head"),
             "clip": ModelConfig(name=models["clip"], logit_scale=100.0),
             "llama": ModelConfig(name=models["llama"], task="causal_lm", input_template="q: {text} a:"),
             "vlm": ModelConfig(name=models["llama"], task="vlm", vision=models["vit"],
                                input_template="q: {text} a:")}[family]
    cfg = ExperimentConfig(model=model, peft=PeftConfig(**peft),
                           runtime=RuntimeConfig(device=device, precision=precision, unpad=unpad),
                           data=DataConfig(class_prompt="a photo of a {label}."))
    cfg.check()
    m = TaskModel(cfg, CLASSES)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at 0: move every tensor so every gradient is non-zero
        for p in m.trainable().values():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return m


def inputs(family: str) -> list:
    if family != "vlm":
        return TEXTS
    g = np.random.default_rng(0)
    return [Sample(f"toy/{i}", g.integers(0, 256, (20, 24, 3), dtype=np.uint8) if i % 3 else None, t)
            for i, t in enumerate(TEXTS)]


def logits_and_grads(m: TaskModel, items: list):
    """Logits of `items` and the gradients of a loss of them, as float32 CPU tensors."""
    m.train()
    m.zero_grad()
    with m.autocast():
        out = m(items)
    (out.float().logsumexp(-1) * torch.arange(1.0, len(items) + 1, device=out.device)).sum().backward()
    return out.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in m.trainable().items()}


@pytest.mark.parametrize("family", ["bert", "clip", "llama", "vlm"])
def test_unpadded_equals_padded(models, family, monkeypatch):
    items = inputs(family)
    padded, g_pad = logits_and_grads(build(models, family, unpad="off"), items)
    monkeypatch.setattr(taskmodel, "CPU_OVERHEAD", 0)  # no call cost: every distinct length alone
    m = build(models, family, unpad="on")
    assert m._text.overhead == 0
    unpadded, g_unp = logits_and_grads(m, items)
    scale = padded.abs().max()
    assert scale > 0 and torch.allclose(unpadded, padded, rtol=1e-5, atol=1e-5 * scale)
    assert g_pad.keys() == g_unp.keys() and len(g_pad) > 0
    for n, g in g_pad.items():
        assert g.abs().max() > 0, n
        assert torch.allclose(g_unp[n], g, rtol=1e-4, atol=1e-5 * g.abs().max()), n


def test_the_batch_really_splits(models, monkeypatch):
    m = build(models, "bert")
    seen = []
    real = m._text._mean_pooled
    monkeypatch.setattr(m._text, "_mean_pooled", lambda ts: (seen.append(len(ts)), real(ts))[1])
    logits_and_grads(m, TEXTS)
    lengths = m._tok.lengths(TEXTS)
    assert seen == [len(g) for g in groups(lengths, CPU_OVERHEAD)] and len(seen) > 1
    pushed = sum(len(g) * max(lengths[i] for i in g) for g in groups(lengths, CPU_OVERHEAD))
    assert pushed < len(TEXTS) * max(lengths)


@pytest.mark.parametrize("unpad,dropout,train,evaluate", [
    ("auto", 0.0, CPU_OVERHEAD, CPU_OVERHEAD),
    ("auto", 0.25, None, CPU_OVERHEAD),  # LoRA dropout trains: its masks follow the padded batch
    ("on", 0.25, CPU_OVERHEAD, CPU_OVERHEAD),
    ("off", 0.0, None, None),
])
def test_auto_resolves_per_mode(models, unpad, dropout, train, evaluate):
    m = build(models, "llama", unpad=unpad, dropout=dropout)
    assert m.train()._text.overhead == train and m._scorer.overhead == train
    assert m.eval()._text.overhead == evaluate and m._scorer.overhead == evaluate
