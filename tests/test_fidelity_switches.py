"""The switches of docs/fidelity.md each change exactly what they say: the client optimizer's
momentum and cosine schedule, FedPuReL's phase-2 schedules, the permuted long tail, PFAdapter's
orthogonality on A and its gradient diagnostics. Values by hand."""

import math

import numpy as np
import pytest
import torch

from fedsplice.algorithms import fedpurel
from fedsplice.config import ClientConfig
from fedsplice.core.losses import Orthogonality
from fedsplice.core.split import ParamInfo
from fedsplice.data import partition as P
from fedsplice.errors import ConfigError
from fedsplice.federation import tasks, train
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.federation.train import make_optimizer, term_diagnostics
from fedsplice.runtimes.inprocess import run_rounds


@pytest.fixture
def cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        return cfg_factory(tiny_bert_dir, toy_jsonl, **kw)
    return make


# ----------------------------------------------------------------------------- client optimizer


def test_cosine_schedule_by_hand():
    c = ClientConfig(lr=1.0, schedule="cosine")
    assert [c.lr_at(t, 4) for t in (1, 2, 3, 4)] == pytest.approx(
        [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2])
    assert ClientConfig(lr=0.3).lr_at(3, 4) == 0.3  # constant


def test_sgd_momentum_two_steps_by_hand():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = make_optimizer([p], ClientConfig(optimizer="sgd", lr=0.1, momentum=0.9))
    g = torch.tensor([0.5, 1.0])
    for _ in range(2):
        p.grad = g.clone()
        opt.step()
    # v1 = g, p1 = p0 − 0.1·g; v2 = 0.9·g + g, p2 = p1 − 0.1·1.9·g
    assert torch.allclose(p.detach(), torch.tensor([1.0, -2.0]) - 0.1 * g - 0.19 * g)


@pytest.mark.parametrize("sets, msg", [({"client.momentum": 0.9}, "client.momentum is SGD's"),
                                       ({"client.momentum": 1.0, "client.optimizer": "sgd"}, r"in \[0, 1\)"),
                                       ({"client.schedule": "linear"}, "client.schedule")])
def test_client_switch_errors(sets, msg):
    with pytest.raises(ConfigError, match=msg):
        ClientConfig(**{k.split(".")[1]: v for k, v in sets.items()}).check()


def test_rounds_train_at_the_scheduled_lr(cfg, monkeypatch):
    seen = []
    orig = train.local_train

    def spy(*a, **k):
        seen.append(k["cfg"].lr)
        return orig(*a, **k)

    monkeypatch.setattr(tasks, "local_train", spy)
    c = cfg(algorithm='"lora"', method="{}", client__lr=0.01, client__schedule='"cosine"', server__rounds=3,
            server__clients_per_round=1, data__holdout_clients=0, eval__every=3)
    run_rounds(build(c), MemoryStore(), lambda r: None)
    assert seen == pytest.approx([0.01 * (1 + math.cos(math.pi * t / 3)) / 2 for t in range(3)])


# ----------------------------------------------------------------------------- FedPuReL phase 2


def test_persistent_branch_persists_across_rounds(cfg, monkeypatch):
    """phase2 = persistent: a sampled client trains its stored branch every round (one round's
    budget, from where it stopped), PM is l_G + branch, and the stage after the rounds trains nothing."""
    starts = []
    orig = fedpurel.train_branch

    def spy(ops, lam, branch, rounds, l_g):
        starts.append((ops.cid, {n: t.clone() for n, t in branch.items()}))
        return orig(ops, lam, branch, rounds, l_g)

    monkeypatch.setattr(fedpurel, "train_branch", spy)
    c = cfg(algorithm='"fedpurel"', method='{phase2 = "persistent"}', server__rounds=3, server__clients_per_round=3,
            data__num_clients=3, data__holdout_clients=0, eval__every=3)
    exp, store = build(c), MemoryStore()
    assert exp.recipe.personalize.fit is not None  # persistent: trained in every fit
    run_rounds(exp, store, lambda r: None)
    assert len(starts) == 9  # 3 clients × 3 rounds
    for cid in exp.train_ids:
        mine = [b for k, b in starts if k == cid]
        assert all(torch.equal(mine[0][n], exp.init_params[n]) for n in mine[0])  # fresh at first
        stored = {k[len("method/branch/"):]: v for k, v in store.get(cid).items() if k.startswith("method/")}
        # the branch only: phase 1's zero-shot rows are not kept (Exchange.send drops them)
        assert set(stored) == set(exp.init_params)
        # round 2 starts where round 1 stopped: not the fresh init
        assert any(not torch.equal(mine[1][n], exp.init_params[n]) for n in mine[1])
        assert all(not torch.equal(stored[n], mine[2][n]) for n in exp.init_params if ".lora_B." in n)
    steps = []
    monkeypatch.setattr(tasks, "train_client", lambda *a, **k: steps.append(1))
    g = {n: t.clone() for n, t in exp.model.trainable().items()}
    m = tasks.personalize(exp, store, 0, g)
    assert steps == []  # persistent: phase 2 only scores
    assert m == tasks.evaluate(exp, store, 0, g)  # the same l_G + stored branch as PM in the rounds


def test_after_phase2_trains_t_p_rounds(cfg, monkeypatch):
    steps = []
    orig = train.local_train

    def spy(*a, **k):
        out = orig(*a, **k)
        steps.append(out[1]["steps"])
        return out

    c = cfg(algorithm='"fedpurel"', method='{personal_rounds = 3, phase2 = "after"}', data__holdout_clients=0,
            data__num_clients=3)
    exp = build(c)
    monkeypatch.setattr(tasks, "local_train", spy)
    tasks.personalize(exp, MemoryStore(), 0, {n: t.clone() for n, t in exp.init_params.items()})
    assert steps == [2, 2, 2]  # T_p = 3 rounds of client.max_steps = 2


# ----------------------------------------------------------------------------- long tail


def test_permuted_long_tail_keeps_the_profile_and_if(cfg):
    sized = build(cfg(data__imbalance=4.0, data__n_max=8)).data.train_labels
    c = cfg(data__imbalance=4.0, data__n_max=8, data__long_tail_order='"permuted"')
    a, b = build(c).data.train_labels, build(c).data.train_labels
    ca, cs = np.bincount(a), np.bincount(sized)
    assert sorted(ca) == sorted(cs) == sorted(P.long_tail_counts(3, 8, 4.0))  # same counts, same IF
    assert np.array_equal(a, b)  # seeded
    ranks = {build(cfg(data__imbalance=4.0, data__n_max=8, data__long_tail_order='"permuted"', seed=s))
             .data.train_labels.tolist().count(0) for s in range(6)}
    assert len(ranks) > 1  # the class that is the head changes with the seed


def test_permuted_order_fits_or_says_why():
    counts = np.array([10, 40, 25, 60])
    need = np.array(P.long_tail_counts(4, 40, 4.0))  # 40, 25, 15, 10
    seen = set()
    for s in range(20):
        order, n = P.permuted_order(counts, 4.0, 40, np.random.default_rng(s), list("abcd"))
        assert n == 40 and sorted(order.tolist()) == [0, 1, 2, 3] and np.all(counts[order] >= need)
        seen.add(tuple(order))
    assert len(seen) > 2  # a permutation, not a sort: several orders fit and are drawn
    order, n = P.permuted_order(counts, 4.0, 0, np.random.default_rng(0), list("abcd"))
    ratio = np.array([4.0 ** (-r / 3) for r in range(4)])
    assert n == int(np.floor(counts[order] / ratio + 1e-9).min())  # the largest n_max this order fits
    with pytest.raises(ConfigError, match=r"data.n_max = 70: .* no permutation .* lower data.n_max"):
        P.permuted_order(counts, 4.0, 70, np.random.default_rng(0), list("abcd"))


# ----------------------------------------------------------------------------- PFAdapter


def _pair():
    infos = {f"l0.{r}.{f}": ParamInfo(r, f, "l0", "lora") for r in ("q", "v") for f in ("A", "B")}
    shapes = {"l0.q.A": torch.Size([2, 5]), "l0.q.B": torch.Size([6, 2]),
              "l0.v.A": torch.Size([2, 5]), "l0.v.B": torch.Size([6, 2])}
    g = torch.Generator().manual_seed(1)
    params = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    return infos, shapes, params


def test_ortho_on_a_by_hand():
    infos, shapes, params = _pair()
    term = Orthogonality(infos, shapes, {n: 3.0 for n in infos}, ["q"], 0.5, on="A")
    want = 0.5 * float(((params["l0.q.A"] @ params["l0.v.A"].T) ** 2).sum())
    assert float(term(params)) == pytest.approx(want, rel=1e-6)
    params["l0.q.B"] = torch.zeros(6, 2)  # B plays no part; Eq. 11 would now be 0
    assert float(term(params)) == pytest.approx(want, rel=1e-6)
    assert float(Orthogonality(infos, shapes, {n: 3.0 for n in infos}, ["q"], 0.5)(params)) == 0.0


def test_term_diagnostics_by_hand():
    g, p = torch.nn.Parameter(torch.tensor([3.0, 4.0])), torch.nn.Parameter(torch.tensor([1.0]))
    task = (g ** 2).sum() / 2 + 2 * p.sum()  # ∇g = (3, 4): 5; ∇p = 2
    term = 0.1 * ((g * torch.tensor([1.0, 0.0])).sum() + (p ** 2).sum())  # ∇g = (0.1, 0): 0.1; ∇p = 0.2
    out = term_diagnostics(task, {"ortho": (term, 0.1)}, [g, p], ["g", "p"], {"g": "global", "p": "private"})
    assert out["ortho_raw"] == pytest.approx(float(term.detach()) / 0.1)
    assert out["ortho_grad_ratio_global"] == pytest.approx(0.1 / 5)
    assert out["ortho_grad_ratio_private"] == pytest.approx(0.2 / 2)


def test_pfadapter_rounds_log_lo_and_gradient_ratios(cfg):
    records = []
    run_rounds(build(cfg(server__rounds=2, eval__every=2)), MemoryStore(), records.append)
    for r in records[1:]:
        assert r["orthogonality_raw"] >= 0.0
        assert r["orthogonality_grad_ratio_global"] >= 0.0 and r["orthogonality_grad_ratio_private"] >= 0.0
    assert records[-1]["orthogonality_raw"] > 0.0  # B has moved off zero by round 2
    # client.diagnostics = false: no ratios (no extra backward passes), the same training
    quiet = []
    run_rounds(build(cfg(server__rounds=2, eval__every=2, client__diagnostics="false")), MemoryStore(), quiet.append)
    assert not any(k.endswith(("_grad_ratio_global", "_grad_ratio_private")) for r in quiet for k in r)
    assert [r["train_loss"] for r in quiet[1:]] == [r["train_loss"] for r in records[1:]]
    assert quiet[-1]["gm"]["accuracy"] == records[-1]["gm"]["accuracy"]


# ----------------------------------------------------------------------------- validation split


def test_validation_split_replaces_the_test_set(cfg):
    base = build(cfg(data__holdout_clients=0)).data
    v = build(cfg(data__holdout_clients=0, eval__on='"validation"', eval__validation_per_class=3)).data
    assert len(v.test_texts) == 3 * 3 and np.bincount(v.test_labels).tolist() == [3, 3, 3]
    assert set(v.test_texts) <= set(base.train_texts) and not set(v.test_texts) & set(base.test_texts)
    assert len(v.train_texts) == len(base.train_texts) - 9 and not set(v.test_texts) & set(v.train_texts)
    with pytest.raises(ConfigError, match="eval.on: unknown value 'dev'; choose one of test, validation"):
        cfg(eval__on='"dev"')


def test_feature_adapter_by_hand():
    from fedsplice.model.adapters import FeatureAdapter

    f = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    a = FeatureAdapter(6, 4, torch.Generator().manual_seed(1))
    att = torch.softmax(a.fc2(torch.tanh(a.fc1(f))), dim=-1)  # FedCLIP: tanh, then softmax attention
    assert torch.allclose(a(f), att * f * 6)
    assert float(a.fc2.weight.detach().abs().sum()) > 0 and float(a.fc2.bias.detach().abs().sum()) > 0  # random
    z = FeatureAdapter(6, 4, torch.Generator().manual_seed(1), init="zero")
    assert torch.allclose(z(f), f)  # uniform attention: f itself, round 0 = zero-shot
