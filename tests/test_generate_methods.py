"""The methods with a personalized model of their own (`Personal.predict`: FedDPA, HetLoRA, FLoRA)
on model.task = "generate": their PM scores free-text answers (docs/instruct.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import GEN_BUDGET


@pytest.fixture
def gen_cfg(cfg_factory, tiny_llama_dir, instruct_jsonl):
    def make(**kw):
        return cfg_factory(tiny_llama_dir, instruct_jsonl, **{**GEN_BUDGET, **kw})
    return make


@pytest.mark.parametrize("algo, method", [("feddpa", "{}"), ("hetlora", "{ranks = [4, 2]}"),
                                          ("flora", "{ranks = [4, 2]}")])
def test_a_method_with_its_own_pm_learns_the_answers(gen_cfg, tmp_path, algo, method):
    from fedsplice import run

    res = run(gen_cfg(algorithm=f'"{algo}"', method=method), tmp_path / algo)
    zs, gm, pm = res.raw["zero_shot_gm"], res.gm, res.pm
    assert pm["test_size"] == 4 and len(pm["client_rouge_l"]) == 4
    assert math.isfinite(pm["rouge_l"]) and pm["perplexity"] == pytest.approx(
        np.mean([math.exp(x) for x in pm["client_response_loss"]]))
    # 3 rounds of 4 steps at lr 0.03 on one repeated answer: both models' held-out loss falls (measured,
    # zero-shot 7.47 -> GM / PM: FedDPA 4.30 / 5.54, HetLoRA 4.98 / 4.99, FLoRA 5.48 / 5.50)
    assert gm["response_loss"] < 0.9 * zs["response_loss"] and pm["response_loss"] < 0.9 * zs["response_loss"]


def test_feddpa_mixes_its_adapters_per_record_as_a_hand_loop_does(gen_cfg, monkeypatch):
    """FedDPA's PM on generate: α_i from the prompt's last-token state (W0 + local only), each
    record answered under W0 + α_i ΔW_g + (1 − α_i) ΔW_l; against one record at a time, unpadded."""
    from fedsplice.algorithms import feddpa
    from fedsplice.federation import build, generative
    from fedsplice.federation.tasks import OnClient

    cfg = gen_cfg(algorithm='"feddpa"', method="{alpha_grid = 0.05}", runtime__precision='"fp32"')
    exp = build(cfg)
    g = torch.Generator().manual_seed(0)
    params = {n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in exp.init_params.items()}
    p = feddpa.FedDPAParams(alpha_grid=0.05)
    got = feddpa.dynamic_mix(p).predict(OnClient(exp, 1), params, {})

    m, c = exp.model, exp.clients[1]
    tests, train = ([exp.data.test_texts[i] for i in c.test_idx], [exp.data.train_texts[i] for i in c.train_idx])
    m.load_params(params)
    m.eval()

    def state(rec):  # the last layer's state at the prompt's last token, the record alone
        ids = torch.tensor([m.encoded(rec).prompt])
        with torch.no_grad(), feddpa.Mix.of({"default": 0.0, "local": 1.0})(m):
            return m._lm(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1].numpy()

    bank = np.stack([state(r) for r in train])
    rng, s = OnClient(exp, 1).rng(feddpa.EVAL_DRAWS), min(p.instance_num, len(train))
    refs = np.array([rng.choice(len(train), size=s, replace=False) for _ in tests])
    alpha = np.round(feddpa.instance_alpha(np.stack([state(r) for r in tests]), bank, refs, p.max_weight) / 0.05) * 0.05
    assert len(set(alpha.round(6))) > 1  # the records do get different mixes: the grouping is exercised
    one = {k: [] for k in ("nll", "tokens", "text", "options")}
    for rec, a in zip(tests, alpha):
        with feddpa.Mix.of({"default": float(a), "local": 1.0 - float(a)})(m):
            for k, v in m.answers([rec], 1, cfg.eval.max_new_tokens).items():
                one[k] += v
    monkeypatch.setattr(exp.model, "answers", lambda *a, **k: one)  # the hand loop's, scored as the PM's
    want = generative.scores(exp, tests)
    for k in ("exact_match", "token_f1", "rouge_l", "test_size", "response_tokens"):
        assert got[k] == want[k], k
    assert got["response_loss"] == pytest.approx(want["response_loss"], rel=1e-4)


def test_generate_features_are_each_prompts_last_state(gen_cfg):
    """Batched, right-padded features equal each prompt's own unpadded forward."""
    from fedsplice.federation import build

    exp = build(gen_cfg(runtime__precision='"fp32"'))
    recs = exp.data.test_texts[:5]
    assert len({len(exp.model.encoded(r).prompt) for r in recs}) > 1  # padding happens
    feats = exp.model.features(recs, batch_size=5)
    lm = exp.model._lm.eval()
    for r, f in zip(recs, feats):
        with torch.no_grad():
            one = lm(input_ids=torch.tensor([exp.model.encoded(r).prompt]), output_hidden_states=True)
        assert torch.allclose(f, one.hidden_states[-1][0, -1], atol=1e-5)


def test_the_unpadded_response_loss_and_its_gradients_equal_the_padded(gen_cfg):
    """runtime.unpad on generate: the batch cut into sub-batches of similar length gives the padded
    batch's loss and LoRA gradients (fp32: within 1e-5)."""
    from fedsplice.federation import build

    exp = build(gen_cfg(runtime__precision='"fp32"', runtime__unpad='"off"'))
    m, recs = exp.model, exp.data.train_texts[:12]
    assert len({len(m.encoded(r)) for r in recs}) > 3  # the batch has lengths to cut at
    m.train()
    out = {}
    for overhead in (None, 0):  # 0: every distinct length its own forward
        m._answering.overhead = overhead
        m.zero_grad()
        loss = m.response_loss(recs)
        loss.backward()
        out[overhead] = (loss.item(), {n: p.grad.clone() for n, p in m.trainable().items()})
    assert out[0][0] == pytest.approx(out[None][0], rel=1e-6)
    for n, g in out[None][1].items():
        assert torch.allclose(out[0][1][n], g, atol=1e-5), n
    assert any(float(g.abs().sum()) > 0 for g in out[None][1].values())
    m.train()  # runtime.unpad = "off" keeps the batch padded in either mode
    assert m._answering.overhead is None
