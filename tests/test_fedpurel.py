"""FedPuReL (docs/design.md §3.2; the FedPuReL paper §3.2-3.3, Algorithm 1): temperature
alignment, TKL, gradient purification, the two objectives, a purified local step on a tiny BERT,
and two end-to-end runs with the personalization phase. Values checked by hand."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsplice.algorithms import fedpurel as fp
from fedsplice.core import purify as PU
from fedsplice.core import tkl as T
from fedsplice.core import wire
from fedsplice.core.context import TrainContext
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build
from fedsplice.federation.tasks import train_context
from fedsplice.federation.train import Step, local_train
from fedsplice.runtimes import inprocess as simulation

# ----------------------------------------------------------------------------- temperature


def _entropy_by_hand(a: torch.Tensor) -> torch.Tensor:
    p = torch.exp(a - a.logsumexp(-1, keepdim=True))
    return -(p * torch.log(p)).sum(-1)


def test_entropy_matches_definition():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(8, 19, generator=g, dtype=torch.float64) * 3
    assert torch.allclose(T.entropy(a), _entropy_by_hand(a), atol=1e-12)
    assert T.entropy(torch.zeros(2, 19, dtype=torch.float64)) == pytest.approx(math.log(19))


@pytest.mark.parametrize("scale", [0.3, 1.0, 5.0, 20.0, 80.0])
def test_bisection_hits_target_entropy(scale):
    g = torch.Generator().manual_seed(int(scale * 10))
    a = (torch.randn(64, 19, generator=g) * scale).double()
    # reachable range of each row: H at τ = 0.05 (coldest) .. τ = 20 (hottest)
    h_cold = T.entropy(a / T.TAU_MIN)
    h_hot = T.entropy(a / T.TAU_MAX)
    u = torch.rand(64, generator=g, dtype=torch.float64) * 0.9 + 0.05
    target = h_cold + u * (h_hot - h_cold)
    tau = T.temperature_for_entropy(a, target)
    assert tau.shape == (64,)
    assert ((tau >= T.TAU_MIN) & (tau <= T.TAU_MAX)).all()
    assert (T.entropy(a / tau.unsqueeze(-1)) - target).abs().max() < 1e-4
    # in float32 too (the dtype of logits in training)
    tau32 = T.temperature_for_entropy(a.float(), target.float())
    assert tau32.dtype == torch.float32
    assert (_entropy_by_hand(a / tau32.double().unsqueeze(-1)) - target).abs().max() < 1e-4


def test_bisection_recovers_known_temperature():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 19, generator=g, dtype=torch.float64) * 4
    log_tau = torch.empty(64, dtype=torch.float64).uniform_(math.log(0.1), math.log(10), generator=g)
    true_tau = torch.exp(log_tau)
    target = T.entropy(a / true_tau.unsqueeze(-1))
    tau = T.temperature_for_entropy(a, target)
    assert torch.allclose(tau, true_tau, rtol=1e-5)


def test_bisection_clamps_unreachable_targets():
    a = torch.tensor([[3.0, 0.0, -1.0], [3.0, 0.0, -1.0]], dtype=torch.float64)
    tau = T.temperature_for_entropy(a, torch.tensor([10.0, 0.0], dtype=torch.float64))
    assert tau[0] == pytest.approx(T.TAU_MAX, rel=1e-6)  # above log C: hottest
    assert tau[1] == pytest.approx(T.TAU_MIN, rel=1e-6)  # below H at τ_min: coldest


def test_bisection_keeps_the_logits_device():
    a = torch.randn(4, 19, device="meta")
    assert T.temperature_for_entropy(a, torch.ones(4, device="meta")).device.type == "meta"
    assert T.tkl(a, torch.randn(4, 19, device="meta")).device.type == "meta"


def test_aligned_temperatures_reach_mean_entropy():
    g = torch.Generator().manual_seed(2)
    f = torch.randn(64, 19, generator=g) * 6
    z = torch.randn(64, 19, generator=g) * 1.5
    tf, tz = T.aligned_temperatures(f, z)
    h_star = 0.5 * (_entropy_by_hand(f.double()) + _entropy_by_hand(z.double()))
    assert (_entropy_by_hand(f.double() / tf.double().unsqueeze(-1)) - h_star).abs().max() < 1e-4
    assert (_entropy_by_hand(z.double() / tz.double().unsqueeze(-1)) - h_star).abs().max() < 1e-4
    # the sharper f is heated (τ_f > 1), the flatter z cooled (τ_z < 1)
    assert (tf > 1).float().mean() > 0.9 and (tz < 1).float().mean() > 0.9


# ----------------------------------------------------------------------------- TKL


def _kl_by_hand(z: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """KL(softmax z ‖ softmax f) per row, written out."""
    pz = torch.exp(z) / torch.exp(z).sum(-1, keepdim=True)
    pf = torch.exp(f) / torch.exp(f).sum(-1, keepdim=True)
    return (pz * (torch.log(pz) - torch.log(pf))).sum(-1)


def test_tkl_equals_plain_kl_when_entropies_match():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(64, 19, generator=g, dtype=torch.float64) * 2
    # f: a per-row permutation of z's logits -> same entropy, different distribution
    perm = torch.stack([torch.randperm(19, generator=g) for _ in range(64)])
    f = torch.gather(z, 1, perm)
    tf, tz = T.aligned_temperatures(f, z)
    assert torch.allclose(tf, torch.ones_like(tf), atol=1e-6)
    assert torch.allclose(tz, torch.ones_like(tz), atol=1e-6)
    got = T.tkl(f, z)
    want = _kl_by_hand(z, f)
    assert (want > 0.1).all()  # not a vacuous comparison
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_tkl_unaligned_is_plain_kl():
    g = torch.Generator().manual_seed(4)
    f = torch.randn(64, 19, generator=g, dtype=torch.float64) * 5
    z = torch.randn(64, 19, generator=g, dtype=torch.float64)
    assert torch.allclose(T.tkl(f, z, aligned=False), _kl_by_hand(z, f), atol=1e-10)
    # and aligned differs from it when confidences differ
    assert not torch.allclose(T.tkl(f, z), _kl_by_hand(z, f), atol=1e-3)


def test_tkl_ignores_a_pure_confidence_change():
    """f = 3·z: the same ranking, only sharper. Plain KL is large, TKL ~ 0 (paper §3.2)."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(64, 19, generator=g, dtype=torch.float64)
    f = 3 * z
    assert T.tkl(f, z, aligned=False).mean() > 0.3
    assert T.tkl(f, z).abs().max() < 1e-6


def test_tkl_temperatures_carry_no_gradient():
    g = torch.Generator().manual_seed(6)
    f0 = torch.randn(32, 19, generator=g, dtype=torch.float64) * 4
    z = torch.randn(32, 19, generator=g, dtype=torch.float64) * 2
    f = f0.clone().requires_grad_(True)
    (grad_auto,) = torch.autograd.grad(T.tkl(f, z).sum(), f)
    # manual: τ's as constants, KL(softmax(z/τz) ‖ softmax(f/τf)) differentiated by hand
    tf, tz = T.aligned_temperatures(f0, z)
    pz = torch.softmax(z / tz[:, None], -1)
    pf = torch.softmax(f0 / tf[:, None], -1)
    grad_manual = (pf - pz) / tf[:, None]
    assert torch.allclose(grad_auto, grad_manual, atol=1e-10)
    # and autograd over the same expression with detached τ agrees
    f2 = f0.clone().requires_grad_(True)
    loss = (pz * (torch.log(pz) - F.log_softmax(f2 / tf.detach()[:, None], -1))).sum()
    (grad_const,) = torch.autograd.grad(loss, f2)
    assert torch.allclose(grad_auto, grad_const, atol=1e-10)
    # no gradient reaches z either (the zero-shot side is a fixed target)
    zr = z.clone().requires_grad_(True)
    T.tkl(f0.clone().requires_grad_(True), zr).sum().backward()
    assert zr.grad is None


# ----------------------------------------------------------------------------- projection


def test_project_two_d_by_hand():
    g_task = torch.tensor([1.0, 0.0])
    g_align = torch.tensor([-1.0, 1.0])
    out, hit = PU.project(g_task, g_align)
    # ⟨g_t, g_a⟩ = -1, ‖g_a‖² = 2: g̃ = [1, 0] + ½·[-1, 1]
    assert torch.is_tensor(hit) and bool(hit) is True  # a tensor: the step never waits for it
    assert out.tolist() == [0.5, 0.5]
    assert float(out @ g_align) == 0.0


def test_project_keeps_non_conflicting_gradient_exactly():
    g_task = torch.tensor([1.0, 2.0, -3.0])
    for g_align in (torch.tensor([1.0, 1.0, 1.0]), torch.tensor([3.0, 0.0, 1.0]), torch.zeros(3)):
        # dots 0 (orthogonal: kept), 0, and a zero align gradient
        out, hit = PU.project(g_task, g_align)
        assert bool(hit) is False and torch.equal(out, g_task)
    out, hit = PU.project(g_task, torch.tensor([1.0, 1.0, 0.0]))  # dot 3 > 0
    assert bool(hit) is False and torch.equal(out, g_task)


def test_project_random_invariants():
    g = torch.Generator().manual_seed(7)
    conflicts = 0
    for _ in range(200):
        gt = torch.randn(50, generator=g, dtype=torch.float64)
        ga = torch.randn(50, generator=g, dtype=torch.float64)
        out, hit = PU.project(gt, ga)
        dot = float(gt @ ga)
        assert float(out @ ga) >= -1e-10  # never opposes g_align
        if dot >= 0:
            assert not hit and torch.equal(out, gt)
        else:
            conflicts += 1
            assert hit
            assert float(out @ ga) == pytest.approx(0.0, abs=1e-10)
            # only the g_align component was removed
            assert torch.allclose(out, gt - dot / float(ga @ ga) * ga)
    assert 50 < conflicts < 150


# ----------------------------------------------------------------------------- purification


def _grads(conflict_second: bool):
    task = [torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 2.0]])]
    align = [torch.tensor([-1.0, 1.0]), torch.tensor([[-1.0, -1.0]] if conflict_second else [[1.0, 1.0]])]
    return {"task": task, "align": align}


def counts(stats: dict) -> dict:
    return {k: stats[k] for k in ("purified_steps", "purified_tensors")}


@pytest.mark.parametrize("granularity, conflict, ratio", [
    ("flat", False, 1.0), ("tensor", False, math.sqrt(5.5 / 6)),  # per tensor: [.5, .5], [1, 2]
    ("flat", True, math.sqrt(2 / 6)), ("tensor", True, 1 / math.sqrt(6))])  # [0, 1], [0, 1]; [.5, .5], [-.5, .5]
def test_purification_geometry_by_hand(granularity, conflict, ratio):
    # ‖g_task‖ = √6, ‖g_align‖ = 2; ⟨g_task, g_align⟩ = −1 + 3 = 2, or −1 − 3 = −4 with the second in conflict
    _, stats = PU.purification(granularity)(_grads(conflict_second=conflict))
    assert float(stats["purify_cos"]) == pytest.approx((-4 if conflict else 2) / (2 * math.sqrt(6)), rel=1e-6)
    assert float(stats["purify_norm_ratio"]) == pytest.approx(ratio, rel=1e-6)
    zero = PU.geometry([torch.zeros(2)], [torch.zeros(2)], [torch.zeros(2)])
    assert (float(zero["purify_cos"]), float(zero["purify_norm_ratio"])) == (0.0, 1.0)
    # g_align at rounding-noise size (‖g_align‖ ≤ tie_tol·‖g_task‖): no direction, cos 0
    noise = PU.geometry([torch.tensor([1.0, 0.0])], [torch.tensor([1e-6, 0.0])], [torch.tensor([1.0, 0.0])])
    assert float(noise["purify_cos"]) == 0.0
    assert float(PU.geometry([torch.tensor([1.0, 0.0])], [torch.tensor([1e-6, 0.0])], [torch.tensor([1.0, 0.0])],
                             tie_tol=0.0)["purify_cos"]) == pytest.approx(1.0)


def test_purification_per_tensor_projects_only_conflicting_tensor():
    out, stats = PU.purification("tensor")(_grads(conflict_second=False))
    assert out[0].tolist() == [0.5, 0.5]  # ⟨[1,0],[-1,1]⟩ = -1: projected
    assert out[1].tolist() == [[1.0, 2.0]]  # ⟨[1,2],[1,1]⟩ = 3: untouched
    assert out[1].shape == (1, 2)
    assert counts(stats) == {"purified_steps": 1.0, "purified_tensors": 0.5}


def test_purification_flat_projects_concatenation():
    # same gradients: the concatenation's dot is -1 + 3 = 2 >= 0, so nothing changes
    out, stats = PU.purification("flat")(_grads(conflict_second=False))
    assert out[0].tolist() == [1.0, 0.0] and out[1].tolist() == [[1.0, 2.0]]
    assert counts(stats) == {"purified_steps": 0.0, "purified_tensors": 0.0}
    # second tensor conflicting too: flat dot = -1 - 3 = -4, ‖g_a‖² = 4 -> g̃ = g_t + 1·g_a
    out, stats = PU.purification("flat")(_grads(conflict_second=True))
    assert out[0].tolist() == [0.0, 1.0]
    assert out[1].tolist() == [[0.0, 1.0]] and out[1].shape == (1, 2)
    assert counts(stats) == {"purified_steps": 1.0, "purified_tensors": 1.0}
    # per tensor on the same: [0.5, 0.5] and [1,2] + 1.5·[-1,-1] = [-0.5, 0.5]
    out, stats = PU.purification("tensor")(_grads(conflict_second=True))
    assert out[0].tolist() == [0.5, 0.5] and out[1].tolist() == [[-0.5, 0.5]]
    assert counts(stats) == {"purified_steps": 1.0, "purified_tensors": 1.0}


def test_purification_no_conflict_stats_zero():
    grads = {"task": [torch.ones(3), torch.ones(2, 2)], "align": [torch.ones(3), torch.zeros(2, 2)]}
    out, stats = PU.purification("tensor")(grads)
    assert all(torch.equal(a, b) for a, b in zip(out, grads["task"]))
    assert counts(stats) == {"purified_steps": 0.0, "purified_tensors": 0.0}


def test_tie_rule_by_hand():
    # ‖g_align‖ = 1e-3·‖g_task‖ exactly: above 1e-4 no tie, at 1e-2 a tie
    assert not PU.is_tie(-1e-3, 1.0, 1e-3, tie_tol=1e-4)
    assert PU.is_tie(-1e-3, 1.0, 1e-3, tie_tol=1e-2)
    # orthogonal to working precision: |cos| = 1e-6 <= 1e-4; |cos| = 1e-3 is not
    assert PU.is_tie(-1e-6, 1.0, 1.0, tie_tol=1e-4)
    assert not PU.is_tie(-1e-3, 1.0, 1.0, tie_tol=1e-4)
    assert not PU.is_tie(-1e-6, 1.0, 1.0, tie_tol=0.0)  # 0: the exact sign rule


def test_noise_level_alignment_gradient_is_no_conflict():
    # the first step from zero-shot: g_align is rounding noise (‖g_a‖/‖g_t‖ = 1e-7, measured
    # 6e-8..1.4e-7 on real runs) whose sign opposes g_task; the exact rule projects, the tie rule not
    gt = torch.tensor([1.0, 2.0, -1.0])
    ga = -1e-7 * torch.tensor([1.0, 1.0, 0.0]) / 2**0.5 * float(gt.norm())
    out, hit = PU.project(gt, ga)
    assert not hit and torch.equal(out, gt)
    out, hit = PU.project(gt, ga, tie_tol=0.0)
    assert hit and float((out * ga).sum()) == pytest.approx(0.0, abs=1e-12)
    # a real conflict (ratio 1e-3, the smallest measured after one step, cos -0.87) is projected
    # exactly as by the exact rule
    ga = 1e-3 * ga / 1e-7
    a, hit_a = PU.project(gt, ga)
    b, hit_b = PU.project(gt, ga, tie_tol=0.0)
    assert hit_a and hit_b and torch.equal(a, b)


def test_tie_rule_in_both_granularities():
    # flat: the whole step is a tie; per tensor: only the noise-level tensor is
    task = [torch.tensor([1.0, 0.0]), torch.tensor([[1.0, 2.0]])]
    align = [torch.tensor([-1e-9, 0.0]), torch.tensor([[-1.0, -1.0]])]
    out, stats = PU.purification("tensor")({"task": task, "align": align})
    assert out[0].tolist() == [1.0, 0.0] and out[1].tolist() == [[-0.5, 0.5]]
    assert counts(stats) == {"purified_steps": 1.0, "purified_tensors": 0.5}
    out, stats = PU.purification("tensor", tie_tol=0.0)({"task": task, "align": align})
    assert out[0].tolist() == [0.0, 0.0] and stats["purified_tensors"] == 1.0
    align = [torch.tensor([-1e-9, 0.0]), torch.tensor([[-1e-9, 0.0]])]
    out, stats = PU.purification("flat")({"task": task, "align": align})
    assert [o.tolist() for o in out] == [[1.0, 0.0], [[1.0, 2.0]]] and stats["purified_steps"] == 0.0


@pytest.mark.parametrize("bad", [-1e-4, 1.0])
def test_tie_tol_out_of_range_is_refused(bad):
    with pytest.raises(ConfigError, match="method.tie_tol"):
        fp.FedPuReLParams(tie_tol=bad).check()


# ----------------------------------------------------------------------------- objectives


def test_residual_objective_by_hand():
    g = torch.Generator().manual_seed(8)
    n_train, c = 20, 5
    global_logits = torch.randn(n_train, c, generator=g) * 3
    l_p = torch.randn(4, c, generator=g)
    ids = np.array([17, 2, 9, 11])
    y = torch.tensor([0, 3, 3, 1])
    calls = []

    def model(texts):
        calls.append(texts)
        return l_p

    def ce(logits, y):
        logp = logits - torch.log(torch.exp(logits).sum(-1, keepdim=True))
        return -logp[torch.arange(len(y)), y].mean()

    for lam in (0.0, 0.9, 1.0):
        out = fp.residual_objective(lam, global_logits)(model, ["w", "x", "y", "z"], y, ids, TrainContext())
        l_g = global_logits[torch.as_tensor(ids)]
        want = (1 - lam) * ce(l_g + l_p, y) + lam * ce(l_p, y)
        assert set(out) == {"task"}
        assert float(out["task"]) == pytest.approx(float(want), rel=1e-6)
    assert len(calls) == 3  # one forward per call


@pytest.fixture(scope="module")
def purel_exp(cfg_factory, tiny_bert_dir, toy_jsonl):
    # per-tensor purification (the official code's), which the hand-computed step below follows
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"fedpurel"', client__optimizer='"sgd"',
                      client__lr=1.0, client__batch_size=64, client__max_steps=1,
                      client__weight_decay=0.0, method='{granularity = "tensor", phase2 = "after"}')
    exp = build(cfg)
    for m in exp.model.modules():  # BERT's dropout off: forwards are deterministic
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    # move LoRA B off zero, so that f ≠ z and the alignment gradient is not zero
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in exp.model.trainable().items():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g))
    return exp


CID = 1  # 49 samples: one batch of 64


def _client_batch(exp, cid=CID, order=None):
    c = exp.clients[cid]
    idx = c.train_idx if order is None else c.train_idx[order]
    texts = [exp.data.train_texts[i] for i in idx]
    y = torch.as_tensor(exp.data.train_labels[idx], dtype=torch.long)
    return texts, y, idx


def _zs_ctx(exp, cid=CID):
    """The training context as fit builds it: the method's slot holds the client's zero-shot logits."""
    from fedsplice.federation.tasks import OnClient

    _, st = fp.keep_zero_shot(OnClient(exp, cid), 1, {}, fp.FedPuReLState())
    assert torch.equal(st.zero_shot_ids, torch.as_tensor(exp.clients[cid].train_idx))
    return train_context(exp, cid, state=st)


def test_align_objective_one_forward_both_losses(purel_exp):
    exp, model = purel_exp, purel_exp.model
    texts, y, ids = _client_batch(exp)
    ctx = _zs_ctx(exp)
    calls = []
    h = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        model.eval()
        out = fp.align_objective()(model, texts, y, ids, ctx)
        assert len(calls) == 1
        with torch.no_grad():
            f = model(texts)
    finally:
        h.remove()
    assert set(out) == {"task", "align"}
    z = ctx.state.zero_shot  # the client's rows, in its order (= ids)
    assert float(out["task"].detach()) == pytest.approx(float(F.cross_entropy(f, y)), rel=1e-5)
    assert float(out["align"].detach()) == pytest.approx(float(T.tkl(f, z).mean()), rel=1e-4, abs=1e-8)
    assert float(out["align"].detach()) > 1e-3  # the perturbed LoRA moved away from zero-shot
    # both losses hang off the one graph
    assert out["task"].requires_grad and out["align"].requires_grad
    # the cached zero-shot logits are what the frozen model predicts on these texts
    with model.zero_shot():
        assert torch.allclose(model.predict(texts, 64), z, atol=1e-5)
    # aligned=False: plain KL on the same forward
    plain = fp.align_objective(aligned=False)(model, texts, y, ids, ctx)
    by_hand = float(_kl_by_hand(z.double(), f.double()).mean())
    assert float(plain["align"].detach()) == pytest.approx(by_hand, rel=1e-4)


def test_local_train_steps_with_purified_gradient(purel_exp):
    exp, model = purel_exp, purel_exp.model
    n = len(exp.clients[CID].train_idx)
    assert n <= exp.cfg.client.batch_size
    # the batch in the order local_train will draw it (same float sums)
    texts, y, ids = _client_batch(exp, order=np.random.default_rng(0).permutation(n))
    ctx = _zs_ctx(exp)
    params = model.trainable()
    names = sorted(params)
    before = {n: params[n].detach().clone() for n in names}
    # g_task and g_align by hand, from one forward on the whole client batch
    model.train()
    losses = fp.align_objective()(model, texts, y, ids, ctx)
    plist = [params[n] for n in names]
    g_task = torch.autograd.grad(losses["task"], plist, retain_graph=True, allow_unused=True)
    g_align = torch.autograd.grad(losses["align"], plist, allow_unused=True)
    expected, hits = {}, 0
    for n, p, gt, ga in zip(names, plist, g_task, g_align):
        gt = torch.zeros_like(p) if gt is None else gt
        ga = torch.zeros_like(p) if ga is None else ga
        dot, nrm = float((gt * ga).sum()), float((ga * ga).sum())
        if dot < 0 and nrm > 0:
            gt = gt - dot / nrm * ga
            hits += 1
            tol = 1e-6 * nrm**0.5 * float(gt.norm()) + 1e-12
            assert float((gt * ga).sum()) == pytest.approx(0.0, abs=tol)
        expected[n] = before[n] - 1.0 * gt  # SGD, lr = 1
    assert 0 < hits < len(names)  # some tensors purified, some not: the test tells them apart
    r = exp.recipe
    c = exp.clients[CID]
    all_texts = [exp.data.train_texts[i] for i in c.train_idx]
    _, stats = local_train(model, all_texts, exp.data.train_labels[c.train_idx], cfg=exp.cfg.client,
                           step=Step.of(r), ids=c.train_idx, keep_opt=set(), opt_state={},
                           rng=np.random.default_rng(0), ctx=ctx)
    assert stats["steps"] == 1
    assert stats["purified_steps"] == 1.0
    assert stats["purified_tensors"] == pytest.approx(hits / len(names))
    after = model.trainable()
    for n in names:
        assert torch.allclose(after[n].detach(), expected[n], atol=1e-5, rtol=1e-4), n
    # not the plain gradient of the sum, nor the raw task gradient
    plain = {n: before[n] - (gt if gt is not None else 0) - (ga if ga is not None else 0)
             for n, gt, ga in zip(names, g_task, g_align)}
    assert any(not torch.allclose(after[n].detach(), plain[n], atol=1e-5) for n in names)
    raw = {n: before[n] - (gt if gt is not None else 0) for n, gt in zip(names, g_task)}
    assert any(not torch.allclose(after[n].detach(), raw[n], atol=1e-5) for n in names)
    model.load_params(before)


# ----------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("granularity", ["tensor", "flat"])
def test_fedpurel_run_writes_longtail_results_and_personalizes_locally(
        granularity, cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path, monkeypatch):
    from fedsplice.app.runner import run_experiment

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"fedpurel"',
                      method=f'{{personal_rounds = 1, granularity = "{granularity}", phase2 = "after"}}',
                      data__imbalance=3.0, eval__many_threshold=40, eval__few_threshold=20, eval__min_group_samples=1,
                      data__holdout_clients=0, data__num_clients=3)
    # watch phase 2: what goes over the wire, which clients run it, and what they are given
    from fedsplice.app import runner
    from fedsplice.federation import tasks

    wire_calls = []
    for name in ("encode", "decode"):
        orig = getattr(wire, name)
        monkeypatch.setattr(wire, name, lambda x, _o=orig, _n=name: (wire_calls.append(_n), _o(x))[1])
    fits = []
    orig_fit = simulation.InProcess.fit

    def fit(self, rnd, *a):
        fits.append(rnd)
        return orig_fit(self, rnd, *a)

    monkeypatch.setattr(simulation.InProcess, "fit", fit)
    steps = _count_local_steps(monkeypatch)
    seen = {"clients": [], "given": []}
    orig_phase2, orig_task = runner.personalization, tasks.personalize

    def phase2(exp, transport, global_params):
        seen["global"] = {n: t.clone() for n, t in global_params.items()}
        seen["wire_before"], seen["fits_before"], seen["steps_before"] = len(wire_calls), len(fits), len(steps)
        seen["stage"] = exp.recipe.personalize
        out = orig_phase2(exp, transport, global_params)
        seen["wire"] = wire_calls[seen["wire_before"]:]
        seen["fits_after"], seen["steps"] = len(fits), steps[seen["steps_before"]:]
        seen["global_after"] = global_params
        seen["train_ids"] = list(exp.train_ids)
        return out

    def task(exp, store, cid, global_params):
        seen["clients"].append(cid)
        seen["given"].append({n: t.clone() for n, t in global_params.items()})
        return orig_task(exp, store, cid, global_params)

    monkeypatch.setattr(runner, "personalization", phase2)
    monkeypatch.setitem(tasks.RUN, "personalize", task)
    out = tmp_path / "run"
    results = run_experiment(cfg, out, quiet=True)

    saved = json.loads((out / "results.json").read_text())
    assert saved["algorithm"] == "fedpurel-lora" and saved["rounds"] == 2
    assert saved["train_counts"] == [54, 31, 18]  # long_tail_counts(3, 54, 3)
    for side in ("gm", "pm"):
        m = saved[side]
        for key in ("many", "medium", "few", "balancedness", "tkl", "head_bias"):
            assert key in m, (side, key)
        # thresholds 40 / 20 put one class in each group (54 > 40, 20 <= 31 <= 40, 18 < 20): each
        # group's accuracy is that class's; β(V) = (1/C²)·Σ_ij exp(−(a_i − a_j)²/σ) by hand
        a = m["class_accuracy"]
        assert None not in a and (m["many"], m["medium"], m["few"]) == (a[0], a[1], a[2])
        for sigma in (0.1, 0.01):
            beta = sum(math.exp(-(x - y) ** 2 / sigma) for x in a for y in a) / 9
            assert m[f"balancedness_{sigma}"] == pytest.approx(beta, rel=1e-12), (side, sigma)
        assert m["balancedness"] == m["balancedness_0.1"]  # eval.balancedness_sigma = 0.1
        assert m["tkl"] >= 0.0  # a KL divergence
    lines = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in lines] == [0, 1, 2, 2]
    last = lines[-1]
    assert last["phase"] == "personalization"
    assert "phase" not in lines[-2]
    assert last["gm"] == lines[-2]["gm"]  # phase 2 leaves the global model as it is
    assert last["pm"]["tkl"] != lines[-2]["pm"]["tkl"]  # PM is now scored on l_G + l_P
    assert last["pm"] == saved["pm"] and last["gm"] == saved["gm"]
    assert "up_bytes" not in last and "down_bytes" not in last
    # phase 1 logged its purification statistics
    assert all(0.0 <= r["purified_tensors"] <= r["purified_steps"] <= 1.0 for r in lines[1:3])
    assert all(r["align_loss"] >= 0.0 for r in lines[1:3])
    # communication is phase 1's only
    assert results["communication"]["up_bytes"] == sum(r["up_bytes"] for r in lines[1:3])
    # phase 2: the `personalize` client task on every training client, personal_rounds = 1 round
    # of client.max_steps = 2 local steps each, the GLOBAL tensors sent down once (decoded once
    # in-process), no upload, no fit
    assert seen["stage"].after_rounds == 1 and seen["stage"].fit is None  # "after": no stage in the rounds
    assert sorted(seen["clients"]) == sorted(seen["train_ids"]) and len(seen["train_ids"]) == 3
    assert seen["steps"] == [2, 2, 2]
    assert seen["wire"] == ["encode", "decode"] and seen["fits_after"] == seen["fits_before"]
    assert set(seen["global_after"]) == set(seen["global"])
    for n, t in seen["global"].items():
        assert torch.equal(seen["global_after"][n], t), n  # the server's GLOBAL tensors unchanged
        assert all(torch.equal(g[n], t) for g in seen["given"]), n  # what every client was given


def _count_local_steps(monkeypatch) -> list[int]:
    """Record the steps of every local_train call, under every name the client tasks call it by."""
    from fedsplice.federation import tasks, train

    steps, orig = [], train.local_train

    def spy(*a, **k):
        out = orig(*a, **k)
        steps.append(out[1]["steps"])
        return out

    for module in (train, tasks):
        monkeypatch.setattr(module, "local_train", spy)
    return steps


def test_personalize_predicts_global_plus_residual(purel_exp, monkeypatch):
    """Phase 2 scores softmax(l_G + l_P): with λ = 1 and an lr of 1e-30 the residual branch stays at
    its fresh init, so l_P is the fresh model's logits; compare the PM counts by hand."""
    import dataclasses

    from fedsplice.federation import tasks
    from fedsplice.federation.store import MemoryStore

    exp = purel_exp
    params = exp.model.trainable()
    global_params = {n: params[n].detach().clone() for n in exp.global_names}
    steps = _count_local_steps(monkeypatch)
    cfg0, recipe = exp.cfg, exp.recipe
    exp.cfg = dataclasses.replace(cfg0, client=dataclasses.replace(cfg0.client, lr=1e-30))
    exp.recipe = dataclasses.replace(recipe, personalize=fp.phase2(fp.FedPuReLParams(lam=1.0, phase2="after",
                                                                                    personal_rounds=1)))
    try:
        out = [tasks.personalize(exp, MemoryStore(), cid, global_params) for cid in exp.train_ids]
    finally:
        exp.cfg, exp.recipe = cfg0, recipe
    assert steps == [1] * len(exp.train_ids)
    d = exp.data
    exp.model.load_params({n: t.clone() for n, t in exp.init_params.items()})
    differs = 0
    for cid, m in zip(exp.train_ids, out):
        test = [d.test_texts[i] for i in exp.clients[cid].test_idx]
        l_p = exp.model.predict(test, 64)
        exp.model.load_params(global_params)
        l_g = exp.model.predict(test, 64)
        exp.model.load_params({n: t.clone() for n, t in exp.init_params.items()})
        pred = (l_g + l_p).argmax(1).numpy()
        labels = d.test_labels[exp.clients[cid].test_idx]
        assert m["accuracy"] == pytest.approx(float((pred == labels).mean()))
        assert m["class_correct"] == np.bincount(labels[pred == labels], minlength=3).tolist()
        differs += int((pred != l_g.argmax(1).numpy()).sum() + (pred != l_p.argmax(1).numpy()).sum())
    assert differs > 0  # l_G + l_P is neither branch alone on these samples
    exp.model.load_params(global_params)


def test_personal_rounds_zero_trains_nothing(purel_exp, monkeypatch):
    """method.personal_rounds = 0: no local step runs, the residual branch stays at its fresh
    init (bit for bit), and PM is l_G + l_P(fresh init) computed here by hand."""
    import dataclasses

    from fedsplice.federation import tasks
    from fedsplice.federation.store import MemoryStore

    exp = purel_exp
    params = exp.model.trainable()
    global_params = {n: params[n].detach().clone() for n in exp.global_names}
    assert any(not torch.equal(global_params[n], exp.init_params[n]) for n in global_params)  # φ_g ≠ init
    steps = _count_local_steps(monkeypatch)
    recipe = exp.recipe
    exp.recipe = dataclasses.replace(recipe, personalize=fp.phase2(fp.FedPuReLParams(lam=0.9, phase2="after",
                                                                                    personal_rounds=0)))
    d, cid = exp.data, CID
    try:
        m = tasks.personalize(exp, MemoryStore(), cid, global_params)
        after = {n: p.detach().clone() for n, p in exp.model.trainable().items()}
        test = [d.test_texts[i] for i in exp.clients[cid].test_idx]
        exp.model.load_params(global_params)
        l_g = exp.model.predict(test, 64)
        exp.model.load_params({n: t.clone() for n, t in exp.init_params.items()})
        l_p = exp.model.predict(test, 64)
    finally:
        exp.recipe = recipe
        exp.model.load_params(global_params)
    assert steps == []  # no local_train call at all
    assert set(after) == set(exp.init_params)
    for n, t in exp.init_params.items():  # one SGD step at lr 1 would have moved LoRA B
        assert torch.equal(after[n], t), n
    labels = d.test_labels[exp.clients[cid].test_idx]
    pred = (l_g + l_p).argmax(1).numpy()
    assert m["accuracy"] == pytest.approx(float((pred == labels).mean()))
    assert m["class_correct"] == np.bincount(labels[pred == labels], minlength=3).tolist()
    assert m["tkl"] == pytest.approx(float(T.tkl(l_g + l_p, exp.caches["zero_shot_test"][
        torch.as_tensor(exp.clients[cid].test_idx)]).mean()), rel=1e-5)


def test_per_loss_gradients_free_the_graph_with_the_last_one():
    """A grad transform (purification) takes each loss's own gradient: every call but the last
    keeps the shared graph, and the last frees it (the activations are not held to the next step)."""
    from fedsplice.federation.train import backward

    w = torch.tensor([1.0, 2.0], requires_grad=True)
    h = (w * torch.tensor([3.0, 4.0])).exp()  # a saved activation shared by both losses
    losses = {"task": h.sum(), "align": (h ** 2).sum()}
    seen = {}

    def keep(grads):
        seen.update(grads)
        return grads["task"], {}

    backward(losses, None, [w], keep, {})
    assert torch.allclose(seen["task"][0], torch.tensor([3.0, 4.0]) * h.detach())
    assert torch.allclose(seen["align"][0], 2 * torch.tensor([3.0, 4.0]) * h.detach() ** 2)
    assert torch.equal(w.grad, seen["task"][0])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        torch.autograd.grad(losses["task"], [w])


def test_the_training_loop_reads_the_device_once_a_round_not_once_a_step(purel_exp, monkeypatch):
    """Losses, purification's decisions and its geometry stay on the device through the round
    and are read once at its end: fedsplice's own tensor-to-host reads do not grow with steps.
    (transformers' SDPA mask check reads one a forward: not ours to change.)"""
    import dataclasses
    import traceback

    from fedsplice.federation import tasks

    exp = purel_exp
    reads = []

    def counted(name):
        real = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            caller = traceback.extract_stack(limit=2)[0].filename
            if "/src/fedsplice/" in caller.replace("\\", "/"):
                reads.append((name, caller))
            return real(self, *a, **k)
        return read

    for name in ("__float__", "__bool__", "item", "tolist", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))

    def reads_for(steps: int) -> int:
        reads.clear()
        cc = dataclasses.replace(exp.cfg.client, batch_size=8, max_steps=steps, diagnostics=False)
        init = dict(exp.init_params)
        exp.model.load_params(init)
        _, st = tasks.train_client(exp, CID, rnd=1, torch_round=1, ctx=_zs_ctx(exp),
                                   step=Step.of(exp.recipe), client_cfg=cc)
        assert st["steps"] == steps and 0.0 <= st["purified_tensors"] <= 1.0
        return len(reads)

    assert reads_for(2) == reads_for(6) > 0
