"""PEFT types besides LoRA (docs/design.md §2, §3.2 baselines): CoOp prompts, the FedCLIP feature adapter,
the zero_shot() context, the baselines built on them (promptfl, promptfolio, fedclip, zeroshot),
and logit adjustment. Tiny BERT as a dual encoder."""

import dataclasses
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsplice.algorithms import logit_adjustment as LA
from fedsplice.algorithms.registry import display_name
from fedsplice.core.context import cross_entropy
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.federation.tasks import start_switches, train_context
from fedsplice.federation.train import cross_entropy_objective, local_train
from fedsplice.model.taskmodel import TaskModel
from fedsplice.runtimes.inprocess import run_rounds

CLASSES = ["sports", "science", "music"]


@pytest.fixture(scope="module")
def texts(toy_jsonl):
    rows = [json.loads(s) for s in toy_jsonl.read_text().splitlines()[:24]]
    return [r["text"] for r in rows], torch.tensor([CLASSES.index(r["label"]) for r in rows])


@pytest.fixture
def cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        return cfg_factory(tiny_bert_dir, toy_jsonl, **kw)
    return make


def _model(cfg, **kw) -> TaskModel:
    return TaskModel(cfg(**kw), CLASSES)


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _zero_shot(model, texts):
    with model.zero_shot():
        return model.predict(texts, 64)


PEFTS = {
    "lora": dict(algorithm='"lora"'),
    "lora-class-side": dict(algorithm='"lora"', model__class_side_adapters=True),
    # template init: round 0 is zero-shot exactly (the tests of the identity start below)
    "prompt": dict(algorithm='"promptfl"', peft__type='"prompt"', peft__prompt_init='"template"'),
    "prompt-class-specific": dict(algorithm='"promptfl"', peft__type='"prompt"', peft__class_specific=True,
                                  peft__prompt_init='"template"'),
    "promptfolio": dict(algorithm='"promptfolio"', peft__type='"prompt"', method="{theta = 0.2}",
                        peft__prompt_init='"template"'),
    "adapter": dict(algorithm='"fedclip"', peft__type='"adapter"', peft__adapter_init='"zero"'),
    "adapter-narrow": dict(algorithm='"fedclip"', peft__type='"adapter"', peft__adapter_hidden=8,
                           peft__adapter_init='"zero"'),
}


@pytest.mark.parametrize("kind", list(PEFTS))
def test_init_equals_zero_shot_and_zero_shot_ignores_peft(kind, cfg, texts):
    x, _ = texts
    model = _model(cfg, **PEFTS[kind])
    zs = _zero_shot(model, x)
    assert zs.shape == (len(x), 3)
    logits = model.predict(x, 64)
    assert torch.allclose(logits, zs, atol=1e-5), (logits - zs).abs().max()
    # and through the training-mode forward (no dropout) too
    _no_dropout(model)
    model.train()
    with torch.no_grad():
        assert torch.allclose(model(x), zs, atol=1e-5)
    # move every PEFT tensor: the model's logits change, zero_shot()'s do not
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.trainable().values():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    model._classes.frozen_emb = None  # recompute the frozen class side too: it must not see the PEFT
    moved = model.predict(x, 64)
    assert (moved - zs).abs().max() > 1e-2
    assert torch.allclose(_zero_shot(model, x), zs, atol=1e-5)


def test_prompt_context_initialized_from_template_words(cfg):
    model = _model(cfg, **PEFTS["prompt"])
    tok = model.tokenizer
    ids = tok("a quote about", add_special_tokens=False)["input_ids"]
    emb = model.backbone.get_input_embeddings().weight
    assert model.prompt.ctx.shape == (len(ids), emb.shape[1])
    assert torch.equal(model.prompt.ctx.detach(), emb[ids].detach())
    # the class sequences: [CLS] ctx <label> . [SEP], padded, with the mask over the real tokens
    embeds, mask = model.prompt.inputs(model.backbone.get_input_embeddings())
    full = tok([f"a quote about {c}." for c in CLASSES], padding=True, return_tensors="pt")
    assert embeds.shape[:2] == mask.shape == (3, full["input_ids"].shape[1])
    assert torch.equal(mask, full["attention_mask"])
    assert torch.allclose(embeds * mask[..., None], emb[full["input_ids"]] * mask[..., None])


def test_prompt_class_specific_shape(cfg):
    model = _model(cfg, **PEFTS["prompt-class-specific"])
    emb = model.backbone.get_input_embeddings().weight
    n = len(model.tokenizer("a quote about", add_special_tokens=False)["input_ids"])
    assert model.prompt.ctx.shape == (3, n, emb.shape[1])
    for c in range(3):  # every class starts from the same template words
        assert torch.equal(model.prompt.ctx[c], model.prompt.ctx[0])


def test_prompt_n_ctx_random_init(cfg, texts):
    x, _ = texts
    rand = {**PEFTS["prompt"], "peft__prompt_init": '"random"'}
    a = _model(cfg, **rand)  # n_ctx 0 with random init: the paper's 4 tokens
    b = _model(cfg, **rand, peft__n_ctx=4)
    other = _model(cfg, **rand, seed=1)
    template = _model(cfg, **PEFTS["prompt"])
    ctx = a.prompt.ctx.detach()
    assert ctx.shape == (4, 32)
    assert 0.01 < float(ctx.std()) < 0.03 and abs(float(ctx.mean())) < 0.01  # N(0, 0.02²)
    assert torch.equal(ctx, b.prompt.ctx.detach())  # seeded by cfg.seed
    assert not torch.equal(ctx, other.prompt.ctx.detach())
    emb = a.backbone.get_input_embeddings().weight.detach()
    assert all(float((emb - v).abs().amax(1).min()) > 1e-3 for v in ctx)  # no word's embedding
    # four random words replace the template: no longer the zero-shot predictions
    assert (a.predict(x, 64) - _zero_shot(a, x)).abs().max() > 1e-3
    # class_specific with n_ctx = 4: [C, 4, d]
    assert template.prompt.ctx.shape[0] == len(
        template.tokenizer("a quote about", add_special_tokens=False)["input_ids"])
    cs = _model(cfg, **{**PEFTS["prompt-class-specific"], "peft__prompt_init": '"random"'}, peft__n_ctx=4)
    assert cs.prompt.ctx.shape == (3, 4, 32)
    with pytest.raises(ConfigError, match=r"peft.n_ctx = 5: peft.prompt_init = 'template' "
                                          r"takes one context vector per token"):
        _model(cfg, **PEFTS["prompt"], peft__n_ctx=5)


@pytest.mark.parametrize("kind,owner", [("prompt", {"prompt.ctx"}),
                                        ("prompt-class-specific", {"prompt.ctx"}),
                                        ("promptfolio", {"prompt.ctx", "prompt_local.ctx"}),
                                        ("adapter", {"adapter.fc1.weight", "adapter.fc1.bias",
                                                     "adapter.fc2.weight", "adapter.fc2.bias"})])
def test_gradients_reach_only_the_peft(kind, owner, cfg, texts):
    x, y = texts
    model = _model(cfg, **PEFTS[kind])
    assert set(model.trainable()) == owner
    for n, p in model.named_parameters():
        if n not in owner:
            assert not p.requires_grad, n
    model.train()
    F.cross_entropy(model(x), y).backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad == owner
    for n in owner:
        g = dict(model.named_parameters())[n].grad
        # fc1 gets no gradient while fc2 is zero (the adapter's identity start), everything else does
        if n.startswith("adapter.fc1"):
            assert float(g.abs().sum()) == 0.0
        else:
            assert float(g.abs().sum()) > 0, n
    if kind == "prompt-class-specific":  # each class's context is moved by its own row
        g = model.prompt.ctx.grad
        assert all(float(g[c].abs().sum()) > 0 for c in range(3))


def test_promptfolio_split(cfg):
    exp = build(cfg(**PEFTS["promptfolio"]))
    assert exp.global_names == ["prompt.ctx"]
    assert exp.private_names == ["prompt_local.ctx"]


@pytest.mark.parametrize("kw,needs", [
    (dict(algorithm='"fedclip"'), "adapter"),
    (dict(algorithm='"fedclip"', peft__type='"prompt"'), "adapter"),
    (dict(algorithm='"promptfl"'), "prompt"),
    (dict(algorithm='"promptfl"', peft__type='"adapter"'), "prompt"),
    (dict(algorithm='"promptfolio"'), "prompt"),
])
def test_baselines_refuse_wrong_peft_type(kw, needs, cfg):
    match = f"peft.type = '{needs}'"
    with pytest.raises(ConfigError, match=match):
        build(cfg(**kw))


def test_prompt_needs_a_dual_encoder(cfg, cfg_factory, tiny_llama_dir, toy_jsonl):
    with pytest.raises(ConfigError, match="model.task = 'dual_encoder'"):
        _model(cfg, peft__type='"prompt"', model__task='"encoder_head"')
    for peft in ("prompt", "adapter"):
        c = cfg_factory(tiny_llama_dir, toy_jsonl, peft__type=f'"{peft}"', model__task='"causal_lm"')
        with pytest.raises(ConfigError, match="peft.type = 'lora'"):
            TaskModel(c, CLASSES)


# ----------------------------------------------------------------------------- zero-shot baseline


class _Stop(Exception):
    pass


def test_zeroshot_run_no_rounds_no_bytes_equals_round0(cfg, tmp_path):
    from fedsplice.app.runner import run_experiment

    zs = run_experiment(cfg(algorithm='"zeroshot"', data__holdout_clients=0), tmp_path / "zs", quiet=True)
    assert zs["algorithm"] == "zeroshot" and zs["rounds"] == 0
    assert zs["communication"]["up_bytes"] == 0 and zs["communication"]["down_bytes"] == 0
    assert zs["params"]["global"] == 0
    lines = [json.loads(s) for s in (tmp_path / "zs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0]
    assert zs["gm"] == zs["zero_shot_gm"] == lines[0]["gm"]
    assert zs["gm"]["tkl"] == pytest.approx(0.0, abs=1e-6)  # the zero-shot model against itself

    # round 0 of a pfadapter run with the same seed, stopped right after its first evaluation
    first = []

    def on_round(record):
        first.append(record)
        raise _Stop

    exp = build(cfg(algorithm='"pfadapter"'))
    with pytest.raises(_Stop):
        run_rounds(exp, MemoryStore(), on_round)
    gm0 = first[0]["gm"]
    assert set(gm0) == set(zs["gm"])
    for k, v in zs["gm"].items():
        if v is None:
            assert gm0[k] is None, k
        else:
            assert gm0[k] == pytest.approx(v, abs=1e-6), k


# ----------------------------------------------------------------------------- logit adjustment


def test_logit_adjustment_shifts_the_training_loss(cfg):
    exp = build(cfg(algorithm='"lora"', switch__logit_adjustment="{}", client__batch_size=64,
                    client__max_steps=1, client__optimizer='"sgd"'))
    assert display_name(exp.cfg) == "fedavg-lora+la"
    _no_dropout(exp.model)
    cid = 1
    c = exp.clients[cid]
    counts = np.bincount(exp.data.train_labels[c.train_idx], minlength=3)
    ctx = train_context(exp, cid, start_switches(exp, cid, None, {}).values())
    offset = torch.log(torch.tensor((counts + 1e-3) / counts.sum(), dtype=torch.float32))
    assert torch.allclose(LA.offset(1.0, exp.data.train_labels[c.train_idx], 3), offset)  # τ = 1, the default
    assert float(offset.max() - offset.min()) > 0.1  # a skewed client: a visible shift
    x = [exp.data.train_texts[i] for i in c.train_idx]
    y = torch.as_tensor(exp.data.train_labels[c.train_idx])
    exp.model.eval()
    with torch.no_grad():
        logits = exp.model(x)
        adjusted = cross_entropy_objective(exp.model, x, y, c.train_idx, ctx)["task"]
        plain = cross_entropy_objective(exp.model, x, y, c.train_idx,
                                        dataclasses.replace(ctx, task_loss=cross_entropy))["task"]
    z = logits + offset
    by_hand = -(z[torch.arange(len(y)), y] - z.logsumexp(-1)).mean()
    assert float(adjusted) == pytest.approx(float(by_hand), rel=1e-5)
    assert float(plain) == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)
    assert abs(float(adjusted) - float(plain)) > 1e-3
    # the training loop reports the shifted loss (measured before its one step)
    _, stats = local_train(exp.model, x, exp.data.train_labels[c.train_idx], cfg=exp.cfg.client,
                           keep_opt=set(), opt_state={}, rng=np.random.default_rng(0),
                           ctx=ctx, ids=c.train_idx)
    assert stats["task_loss"] == pytest.approx(float(by_hand), rel=1e-5)
    # off: plain cross-entropy
    exp0 = build(cfg(algorithm='"lora"'))
    assert train_context(exp0, cid, start_switches(exp0, cid, None, {}).values()).task_loss is cross_entropy


@pytest.mark.parametrize("sets,match", [
    (["method.theta=1.0"], "method.theta must be in (0, 1)"),
    (["peft.ot_gamma=0.8"], "peft.ot_gamma = 0.8 is now `gamma` in the [method] table of algorithm 'fedotp', and "
                            "this config runs algorithm 'promptfolio'"),
])
def test_promptfolio_settings_are_its_own(sets, match, cfg, cli_refuses):
    cli_refuses(cfg(**PEFTS["promptfolio"]), sets, match)
