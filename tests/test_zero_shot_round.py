"""Round 0 from the build's zero-shot cache (issue 50): where GM's or a client's PM tensors provably
make the zero-shot model (LoRA with every B zero, nothing else moved), its test logits are the
cached zero-shot ones, equal to a forward's within the batches' rounding, and no forward runs;
anywhere it may not be (a B moved, a head moved, a PM rule of the method's own, runtime.cache
off) the model runs."""

import numpy as np
import pytest
import torch

from fedsplice.federation import tasks
from fedsplice.federation.evaluation import evaluate_global, zero_shot_cached
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore


def _forward(exp, params, idx):
    exp.model.load_params(params)
    return exp.model.predict([exp.data.test_texts[i] for i in idx], exp.cfg.eval.batch_size).numpy()


@pytest.mark.parametrize("task", ["dual_encoder", "encoder_head"])
def test_round_zero_is_the_cached_zero_shot_model(tiny_cfg, task, monkeypatch):
    exp = build(tiny_cfg(model__task=f'"{task}"', server__rounds=1))
    init, idx = dict(exp.init_params), exp.clients[exp.train_ids[0]].test_idx
    cached = zero_shot_cached(exp, init, idx)
    assert cached is not None and cached.shape == (len(idx), len(exp.data.class_names))
    assert np.allclose(cached, _forward(exp, init, idx), atol=1e-5)

    def no_forward(*a, **k):
        raise AssertionError("round 0 of a zero-shot model runs no forward")
    monkeypatch.setattr(exp.model, "predict", no_forward)
    gm = evaluate_global(exp, {n: init[n] for n in exp.global_names})
    pm = tasks.evaluate(exp, MemoryStore(), exp.train_ids[0], {n: init[n] for n in exp.global_names})
    assert 0.0 <= gm["accuracy"] <= 1.0 and pm["tkl"] == 0.0  # scored from the zero-shot logits themselves


def test_a_model_that_may_differ_runs(tiny_cfg):
    exp = build(tiny_cfg(server__rounds=1))
    init, idx = dict(exp.init_params), np.arange(exp.data.global_test_size)
    infos = exp.model.param_infos()
    b = next(n for n, i in infos.items() if i.factor == "B")
    moved = {**init, b: init[b] + 1e-3}
    assert zero_shot_cached(exp, moved, idx) is None  # a LoRA B moved: ΔW != 0
    a = next(n for n, i in infos.items() if i.factor == "A")
    assert zero_shot_cached(exp, {**init, a: init[a] * 2}, idx) is None  # not the tensors the cache saw
    assert zero_shot_cached(build(tiny_cfg(runtime__cache="false")), init, idx) is None
    dpa = build(tiny_cfg(algorithm='"feddpa"'))  # its PM mixes adapters per instance: its own rule
    assert zero_shot_cached(dpa, dict(dpa.init_params), idx) is None
    assert torch.equal(exp.init_params[b], init[b])  # nothing above changed the run's tensors
