"""FedDPA (algorithms/feddpa.py): the instance weight α on hand-computed features, adapter
factors in the LoRA forward against a hand-computed layer, the round's phases and their mixes,
the dynamic PM equal to a per-instance loop, what travels, and bad parameters."""

import math

import numpy as np
import pytest
import torch

from fedsplice.algorithms import Phase
from fedsplice.algorithms import feddpa as D
from fedsplice.core import split as S
from fedsplice.core import wire
from fedsplice.federation import tasks
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds

DPA = dict(algorithm='"feddpa"', method="{local_r = 4}")


def test_instance_alpha_by_hand():
    test = np.array([[1.0, 0.0], [0.0, 3.0]])
    bank = np.array([[2.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    refs = np.array([[0, 1], [2, 2]])
    # x0: cos 1 and 1/sqrt(2); x1: cos 1 twice (norms do not matter)
    want = [0.5 * (1 + 1 / math.sqrt(2)) / 2, 0.5 * (1 + 1) / 2]
    assert D.instance_alpha(test, bank, refs, 0.5) == pytest.approx(want, abs=1e-12)
    assert D.instance_alpha(-test, bank, refs, 1.0) == pytest.approx([-2 * w for w in want], abs=1e-12)  # no clamp


def test_adapter_factors_scale_each_lora_output_exactly():
    """h = W0 x + f_d·s·B_d A_d x + f_l·s·B_l A_l x with s = alpha / r, restored afterwards."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(3, 2, bias=False)).double()
    cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["0"])
    model = get_peft_model(base, cfg)
    model.add_adapter("local", cfg)
    model.base_model.set_adapter(["default", "local"])
    lin = model.base_model.model[0]
    w = {"default": (torch.tensor([[1.0, 0, 2], [0, 1, 0]]), torch.tensor([[1.0, 0], [0, -1]])),
         "local": (torch.tensor([[0.0, 1, 0], [1, 0, 1]]), torch.tensor([[2.0, 1], [0, 3]]))}
    with torch.no_grad():
        for a, (A, B) in w.items():
            lin.lora_A[a].weight.copy_(A)
            lin.lora_B[a].weight.copy_(B)
    x = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    w0 = lin.base_layer.weight.detach()
    delta = {a: 2.0 * (B @ A).double() for a, (A, B) in w.items()}  # s = 4 / 2
    with D.Mix.of({"default": 0.25, "local": 0.0})(model):
        got = model(x)
    assert torch.allclose(got, x @ (w0 + 0.25 * delta["default"]).T, atol=1e-12)
    with D.Mix.of({"local": -1.5})(model):
        got = model(x)
    assert torch.allclose(got, x @ (w0 + delta["default"] - 1.5 * delta["local"]).T, atol=1e-12)
    assert lin.scaling == {"default": 2.0, "local": 2.0}  # restored
    assert torch.allclose(model(x), x @ (w0 + delta["default"] + delta["local"]).T, atol=1e-12)


def test_round_phases():
    p = D.FedDPAParams(local_weight=0.3, local_epochs=2)
    ph = D.phases(p)
    glob = Phase(S.GLOBAL, 2, D.Mix((("local", 0.0),)))
    assert ph(1) == (glob,)  # the code's round 0: the global adapter alone
    assert ph(2) == ph(7) == (Phase(S.PRIVATE, 2, D.Mix((("local", 0.3), ("default", pytest.approx(0.7))))), glob)


def test_training_phases_mix_and_move_one_group_each(tiny_cfg, monkeypatch, capture_uploads):
    exp = build(tiny_cfg(**DPA, server__rounds=2, server__clients_per_round=len(build(tiny_cfg(**DPA)).train_ids)))
    assert exp.private_names and all(".local." in n for n in exp.private_names)
    assert all(".default." in n for n in exp.global_names)
    seen = []
    orig = tasks.train_client
    lora = next(m for m in exp.model.modules() if isinstance(getattr(m, "scaling", None), dict))
    s = dict(lora.scaling)

    def spy(exp_, cid, **kw):
        before = {n: p.detach().clone() for n, p in exp_.model.named_parameters() if ".lora_" in n}
        out = orig(exp_, cid, **kw)
        moved = {n for n, p in exp_.model.named_parameters() if ".lora_" in n and not torch.equal(p, before[n])}
        seen.append((kw["rnd"], dict(lora.scaling), moved))
        return out

    monkeypatch.setattr(tasks, "train_client", spy)
    run_rounds(exp, MemoryStore(), lambda r: None)
    n = len(exp.train_ids)
    r1, r2 = seen[:n], seen[n:]
    assert len(r2) == 2 * n  # round 2: a local and a global phase per client
    glob = r1 + r2[1::2]
    assert [g[0] for g in glob] == [1] * n + [2] * n
    for _, sc, moved in glob:  # global phases: the local adapter off, only global tensors move
        assert sc == {"default": s["default"], "local": 0.0} and moved and moved <= set(exp.global_names)
    for rnd, sc, moved in r2[0::2]:  # local phases: 0.5 / 0.5, only local tensors move
        assert rnd == 2 and sc == {"default": 0.5 * s["default"], "local": 0.5 * s["local"]}
        assert moved and moved <= set(exp.private_names)
    assert dict(lora.scaling) == s  # restored after training
    assert all(sorted(wire.decode(up)) == exp.global_names for _, _, up in capture_uploads)


def test_dynamic_pm_is_the_per_instance_mix(tiny_cfg):
    """evaluate's PM = each test instance scored alone with its own α on the global adapter."""
    exp = build(tiny_cfg(**DPA, server__rounds=2))
    store = MemoryStore()
    run_rounds(exp, store, lambda r: None)
    cid = next(c for c in exp.train_ids if store.get(c))
    glob = {n: exp.model.trainable()[n].detach().clone() for n in exp.global_names}
    priv = {n: t for n, t in tasks.split_state(exp, tasks.ClientState.from_store(store.get(cid)))[0].items()}
    ops = tasks.OnClient(exp, cid)
    params = {**glob, **priv}
    test, bank = (ops.run(params, on, D.local_features).numpy() for on in ("test", "train"))
    assert test.shape[0] == len(exp.clients[cid].test_idx) and bank.shape[0] == len(exp.clients[cid].train_idx)
    rng = ops.rng(D.EVAL_DRAWS)
    refs = np.array([rng.choice(len(bank), size=5, replace=False) for _ in test])
    alpha = D.instance_alpha(test, bank, refs, 0.5)
    n = len(alpha)
    assert np.all(np.abs(alpha) <= 0.5) and alpha.std() > 0  # one α per instance
    one_by_one = np.concatenate([ops.test_logits(params, D.mix_groups({"default": np.full(n, a),
                                                                        "local": np.full(n, 1 - a)}))[[i]]
                                 for i, a in enumerate(alpha)])
    assert np.allclose(exp.recipe.personalize.predict(ops, params, {}), one_by_one, atol=1e-5)
    want = tasks.score(exp, exp.data.test_labels[exp.clients[cid].test_idx], one_by_one, exp.clients[cid].test_idx)
    assert tasks.evaluate(exp, store, cid, glob)["accuracy"] == want["accuracy"]
    # the local adapter matters: the plain sum of both adapters scores otherwise
    assert not np.allclose(ops.test_logits(params), one_by_one, atol=1e-5)
    # method.alpha_grid: α rounded to the grid, the instances of one grid value in one batch
    grid = D.dynamic_mix(D.FedDPAParams(alpha_grid=0.05)).predict(ops, params, {})
    a = np.round(alpha / 0.05) * 0.05
    assert len(np.unique(a)) < len(alpha)
    assert np.allclose(grid, ops.test_logits(params, D.mix_groups({"default": a, "local": 1 - a})), atol=1e-6)
    alone = [(D.Mix.of({"default": a[0], "local": 1 - a[0]}), np.arange(n))]
    assert np.allclose(grid[[0]], ops.test_logits(params, alone)[[0]], atol=1e-5)
    groups = D.mix_groups({"default": a, "local": 1 - a})
    assert len(groups) == len(np.unique(a)) and sorted(np.concatenate([m for _, m in groups])) == list(range(n))
    with pytest.raises(ValueError, match="each of the .* test positions exactly once"):
        ops.test_logits(params, groups[:-1])


@pytest.mark.parametrize("sets,match", [
    (["method.local_weight=1.5"], "method.local_weight must be in [0, 1]"),
    (["method.alpha_on=\"both\""], "method.alpha_on: unknown value 'both'; choose one of global, local"),
    (["peft.type=\"prompt\""], "algorithm 'feddpa' trains a global and a local LoRA adapter: set peft.type"),
])
def test_bad_parameters_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**DPA), sets, match)
