"""Caches of frozen work: exact stand-ins for the computation they skip, never found stale."""

from unittest import mock

import numpy as np
import pytest
import torch

from fedsplice.data import zoo
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.model.cache import FrozenCache, TokenCache
from fedsplice.model.taskmodel import TaskModel
from fedsplice.runtimes.inprocess import run_rounds

TEXTS = ["hello world game", "the moon is a plant 3", "sing a song", "a"]
CLASSES = ["sports", "science", "music"]


def _randomize_lora(model: TaskModel, seed: int = 3) -> None:
    """LoRA B starts at zero; give every trainable tensor values so the adapters matter."""
    g = torch.Generator().manual_seed(seed)
    model.load_params({n: torch.randn(p.shape, generator=g) * 0.3 for n, p in model.trainable().items()})


@pytest.mark.parametrize("style", ["bert", "llama"])
def test_token_cache_pads_to_the_tokenizers_own_batch(style):
    tok = zoo.tiny_tokenizer(style=style)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    cache = TokenCache(tok, max_length=5)
    for batch in (TEXTS, TEXTS[::-1], TEXTS[:1], TEXTS + TEXTS[:2]):
        ref = tok(batch, padding=True, truncation=True, max_length=5, return_tensors="pt")
        got = cache(batch)
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(got[k], ref[k]), k


def test_prefix_cache_gives_the_full_forward_and_its_gradients(tiny_cfg):
    outs = {}
    for on in (True, False):
        m = TaskModel(tiny_cfg(peft__layers=[1], runtime__cache=on), CLASSES)
        _randomize_lora(m)
        assert m.param_infos() and all(".layer.1." in n for n in m.trainable())
        m.train()
        m.zero_grad()
        logits = m(TEXTS)  # the class prompts and the texts both go through the prefix cache
        logits.pow(2).sum().backward()
        again = m(TEXTS[::-1])  # second call: every prefix now comes from the cache
        outs[on] = (logits.detach(), again.detach(), {n: p.grad.clone() for n, p in m.trainable().items()})
        if on:
            st = m.cache_stats()["prefix"]
            assert st["entries"] == len(TEXTS) + len(CLASSES) and st["hits"] >= len(TEXTS)
        else:
            assert m.cache_stats() == {}
    (a1, a2, ga), (b1, b2, gb) = outs[True], outs[False]
    assert (a1 - b1).abs().max() < 1e-5 and (a2 - b2).abs().max() < 1e-5
    assert a1.abs().max() > 0.1  # the adapters changed the logits, so the check has teeth
    for n in ga:
        assert torch.allclose(ga[n], gb[n], atol=1e-5), n
        assert ga[n].abs().max() > 0


def test_prefix_cache_only_where_every_adapted_layer_is_above_it(tiny_cfg):
    assert TaskModel(tiny_cfg(), CLASSES).cache_stats() == {}  # LoRA in layer 0: nothing is frozen below it
    assert TaskModel(tiny_cfg(peft__layers=[0, 1]), CLASSES).cache_stats() == {}
    assert "prefix" in TaskModel(tiny_cfg(peft__layers=[1]), CLASSES).cache_stats()


def test_prefix_cache_on_disk_is_reused_and_keyed_by_what_computed_it(tiny_cfg, tmp_path):
    c = tiny_cfg(peft__layers=[1], runtime__cache_dir=str(tmp_path / "pc"))
    m1 = TaskModel(c, CLASSES)
    _randomize_lora(m1)
    ref = m1.predict(TEXTS, 2)
    files = sorted((tmp_path / "pc").rglob("*.npy"))
    assert len(files) == len(TEXTS) + len(CLASSES)
    m2 = TaskModel(c, CLASSES)  # a new process would see the same: entries on disk are found
    _randomize_lora(m2)
    assert torch.allclose(m2.predict(TEXTS, 3), ref, atol=1e-5)
    assert m2.cache_stats()["prefix"]["misses"] == 0
    # other frozen weights or another placement: another namespace, never the stale entries
    m3 = TaskModel(c, CLASSES)
    with torch.no_grad():
        m3._text.hf.embeddings.word_embeddings.weight.add_(0.01)
    m3._init_prefix_cache(c, 1)
    assert m3._text.prefix.cache.key != m1._text.prefix.cache.key
    c_len = tiny_cfg(peft__layers=[1], model__max_length=16, runtime__cache_dir=str(tmp_path / "pc"))
    assert TaskModel(c_len, CLASSES)._text.prefix.cache.key != m1._text.prefix.cache.key


def test_prefix_cache_budget_bounds_its_bytes_and_changes_nothing(tiny_cfg):
    m = TaskModel(tiny_cfg(peft__layers=[1], runtime__cache_budget_mb=0), CLASSES)
    full = TaskModel(tiny_cfg(peft__layers=[1], runtime__cache=False), CLASSES)
    for x in (m, full):
        _randomize_lora(x)
    assert torch.allclose(m.predict(TEXTS, 2), full.predict(TEXTS, 2), atol=1e-5)
    assert m.cache_stats()["prefix"]["bytes"] == 0 and m.cache_stats()["prefix"]["entries"] == 0
    fc = FrozenCache({"kind": "t"}, budget_bytes=100)
    assert fc.put("a", torch.zeros(20)) and not fc.put("b", torch.zeros(20))  # 80 B fit, 160 B not
    assert fc.get("b") is None and np.array_equal(fc.get("a"), np.zeros(20, np.float32))


@pytest.mark.parametrize("kind,algo", [("prompt", "promptfl"), ("adapter", "fedclip")])
def test_frozen_input_features_are_cached_for_prompts_and_adapters(tiny_cfg, kind, algo):
    out = {}
    for on in (True, False):
        m = TaskModel(tiny_cfg(algorithm=algo, peft__type=kind, runtime__cache=on), CLASSES)
        _randomize_lora(m)
        out[on] = m.predict(TEXTS, 2)
        out[on, 2] = m.predict(TEXTS, 4)
        if on:
            assert m.cache_stats()["features"]["entries"] == len(TEXTS)
    assert torch.allclose(out[True], out[False], atol=1e-5)
    assert torch.allclose(out[True, 2], out[False, 2], atol=1e-5)


def _metrics(tiny_cfg, **kw):
    exp = build(tiny_cfg(**kw))
    records = []
    final = run_rounds(exp, MemoryStore(), records.append)
    return records, final


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max|a - b| / max|b|: the error relative to the tensor's scale."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# A cached forward is the same computation as the one it skips: measured here, the runs below
# give bitwise-equal tensors. The bound leaves room for another BLAS to sum in another order
# (float32 eps 1.2e-7, so ~100 ulps); a stale or wrong cache is off by 1e-2 or more.
CACHE_RTOL = 1e-5


@pytest.mark.parametrize("kw", [
    dict(peft__layers=[1]),  # PFAdapter, LoRA above a cached prefix
    # FedPuReL: + the zero-shot logits, cached vs a frozen forward per step. max_length 6
    # truncates every toy text to the same length: with padding, the two differ by ~2e-7
    # relative (another padded length, another summation order), and at B = 0 (where LoRA
    # starts, and the model IS zero-shot) the alignment gradient is that rounding noise, whose
    # sign decides purification: runs would then part ways for no fault of the cache.
    dict(algorithm="fedpurel", peft__layers=[1], client__optimizer="sgd", client__lr=0.05, model__max_length=6),
    dict(algorithm="promptfl", peft__type="prompt"),  # frozen input features
    dict(algorithm="fedclip", peft__type="adapter"),
])
def test_a_run_with_caches_equals_a_run_without(tiny_cfg, kw):
    on, fon = _metrics(tiny_cfg, **kw)
    off, foff = _metrics(tiny_cfg, runtime__cache=False, **kw)
    assert len(on) == len(off) == 3
    for a, b in zip(on, off):
        for part in ("gm", "pm"):
            if part in a:  # counts of correct answers: the same
                for k in ("accuracy", "f1_macro", "balancedness"):
                    assert a[part][k] == b[part][k], (a["round"], part, k)
                # TKL to zero-shot is ~1e-5 here, a difference of near-equal terms: its rounding
                # error is absolute, ~eps x the log-probabilities (measured 4e-9)
                assert a[part]["tkl"] == pytest.approx(b[part]["tkl"], abs=1e-7), (a["round"], part)
        if "train_loss" in a:
            assert a["train_loss"] == pytest.approx(b["train_loss"], rel=CACHE_RTOL)
    init = build(tiny_cfg(**kw)).init_params
    for n, t in fon["global_params"].items():
        assert _rel(t, foff["global_params"][n]) < CACHE_RTOL, n
    # and the runs trained: tensors moved far more than the bound
    assert any(_rel(t, init[n]) > 1e3 * CACHE_RTOL for n, t in fon["global_params"].items())


def test_cached_zero_shot_logits_equal_a_frozen_forward(tiny_cfg):
    from fedsplice.algorithms.fedpurel import zero_shot_logits, zero_shot_table
    from fedsplice.federation.tasks import OnClient

    exp = build(tiny_cfg(algorithm="fedpurel", peft__layers=[1]))
    _randomize_lora(exp.model)  # the zero-shot forward must ignore the adapters
    ops = OnClient(exp, 0)
    texts = [exp.data.train_texts[i] for i in ops.sample_ids()]
    n = len(texts)
    fresh = torch.cat([zero_shot_logits(exp.model, texts[i:i + 8]) for i in range(0, n, 8)])
    # measured ~2e-7 relative (another padded length per batch of 8 than the cache's batches)
    assert _rel(fresh, ops.cached("zero_shot", zero_shot_table)) < CACHE_RTOL
    assert "method/zero_shot" in exp.caches  # computed once per process, for every client
    assert _rel(fresh, ops.cached("zero_shot", lambda *a: 1 / 0)) < CACHE_RTOL  # and not again
    off = build(tiny_cfg(algorithm="fedpurel", runtime__cache=False))
    assert OnClient(off, 0).cached("zero_shot", zero_shot_table) is None


def test_cached_rows_reach_another_device_in_one_copy_with_their_shapes():
    """Off the CPU, a batch's cached rows travel as one (pinned, non-blocking) buffer and are cut
    back into their shapes; on the CPU each is its own copy of the stored array."""
    from fedsplice.model.cache import split_rows

    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([7.0, 8.0], dtype=np.float32),
              np.arange(12, dtype=np.float32).reshape(3, 2, 2)]
    flat = torch.from_numpy(np.concatenate([a.reshape(-1) for a in arrays]))
    assert [r.tolist() for r in split_rows(flat, [a.shape for a in arrays])] == [a.tolist() for a in arrays]
    rows = {"a": torch.ones(2, 3), "b": torch.zeros(4)}
    for device in ("cpu", "meta"):
        cache = FrozenCache({"kind": "test"}, 1 << 20, device=device)
        cache.rows(["a", "b"], lambda ts: [rows[t] for t in ts])  # computed, kept on the host
        copies = []
        real = torch.Tensor.to
        with mock.patch.object(torch.Tensor, "to", lambda self, *a, copies=copies, real=real, **k: (
                copies.append(k), real(self, *a, **k))[1]):
            got = cache.rows(["b", "a"], lambda ts: pytest.fail("every row is cached"))
        assert [tuple(g.shape) for g in got] == [(4,), (2, 3)] and {g.device.type for g in got} == {device}
        assert copies == ([] if device == "cpu" else [{"non_blocking": True}])
        if device == "cpu":
            assert got[0].tolist() == [0.0] * 4 and got[1].tolist() == [[1.0] * 3] * 2
