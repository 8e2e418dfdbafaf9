"""Fed-GraB ([switch.grab]): the PID step, the re-weighted logit gradients and the prior estimate
against hand-computed values; the switch end to end on fedavg-lora and promptfolio; bad
hyperparameters as one-line errors."""

import dataclasses
import math
import re

import pytest
import torch

from fedsplice.algorithms import grab as G
from fedsplice.app.cli import main
from fedsplice.config import to_dict
from fedsplice.core import wire
from fedsplice.core.context import TrainContext, cross_entropy
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build
from fedsplice.federation.fitting import fit
from fedsplice.federation.store import MemoryStore
from fedsplice.federation.tasks import start_switches, train_context
from fedsplice.federation.train import cross_entropy_objective
from fedsplice.federation.validate import load_config, saved_as_current

LN3 = math.log(3.0)
U2 = 100.0 * math.log(9.0 / 4.0)  # f(U2) = 2, f(-U2) = 8/17 (β = 1/9, λ = 0.01)


# ----------------------------------------------------------------------------- the math


def test_map_weight_by_hand():
    f = G.map_weight(torch.tensor([0.0, U2, -U2, 100.0], dtype=torch.float64))
    assert f.tolist() == pytest.approx([1.0, 2.0, 8 / 17, (10 / 9) / (1 / 9 + math.exp(-1.0))], abs=1e-12)


def test_pid_step_by_hand():
    # classes: two open ones, one open that saturates, one closed
    err = torch.tensor([[2.0, 0.5, 0.0, 7.0],   # e_{t-1}
                        [1.0, 2.0, 0.5, 7.0],   # e_{t-2}
                        [9.0, 9.0, 9.0, 9.0]])  # e_{t-3}: dropped
    out = torch.tensor([5.0, 0.0, 95.0, 40.0])
    e_new = torch.tensor([3.0, -1.0, 1.0, 3.0])
    open_mask = torch.tensor([True, True, True, False])
    new_err, new_out = G.pid_step(err, out, e_new, open_mask, kp=10.0, ki=0.01, kd=0.1, limit=100.0)
    # Δu = Kp(e_t − e_{t−1}) + Ki e_t + Kd(e_t − 2e_{t−1} + e_{t−2})
    # c0: 10·1 + 0.03 + 0.1·(3 − 4 + 1) = 10.03          -> 15.03
    # c1: 10·(−1.5) − 0.01 + 0.1·(−1 − 1 + 2) = −15.01   -> −15.01
    # c2: 10·1 + 0.01 + 0.1·(1 − 0 + 0.5) = 10.16        -> 105.16, clipped to 100
    # c3: closed -> 0, history 0
    assert new_out.tolist() == pytest.approx([15.03, -15.01, 100.0, 0.0], abs=1e-5)
    assert torch.allclose(new_err, torch.tensor([[3.0, -1.0, 1.0, 0.0], [2.0, 0.5, 0.0, 0.0],
                                                 [1.0, 2.0, 0.5, 0.0]]), atol=1e-6)


def _balancer(loss: str) -> G.Balancer:
    # zero gains: the PID output stays at its stored value, so the weights are known:
    # class 0: u = U2 -> w+ = 2, w− = 8/17; class 1: u = 0 -> 1, 1
    p = G.GrabParams(kp=0.0, ki=0.0, kd=0.0, loss=loss)
    st = G.fresh_state(2)
    st["out"] = torch.tensor([U2, 0.0])
    return G.Balancer(p, st, torch.tensor([True, True]))


@pytest.mark.parametrize("loss, value, grad", [
    # sigmoid: σ(z) = [[.5, .75], [.75, .5]], (σ − y)/N = [[−.25, .375], [.375, −.25]];
    # loss = (ln 2 + ln 4 + ln 4 + ln 2)/2 = ln 8
    ("sigmoid", math.log(8.0), [[-0.5, 0.375], [0.375 * 8 / 17, -0.25]]),
    # softmax: p = [[1/4, 3/4], [3/4, 1/4]], (p − y)/N = [[−3/8, 3/8], [3/8, −3/8]]; loss = ln 4
    ("softmax", math.log(4.0), [[-0.75, 0.375], [0.375 * 8 / 17, -0.375]]),
])
def test_reweighted_logit_gradient_by_hand(loss, value, grad):
    b = _balancer(loss)
    z = torch.tensor([[0.0, LN3], [LN3, 0.0]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 1])
    out = b.loss(z, y)
    out.backward()
    assert float(out.detach()) == pytest.approx(value, abs=1e-12)  # the value: the unweighted loss
    assert torch.allclose(z.grad, torch.tensor(grad, dtype=torch.float64), atol=1e-12)  # the gradient: W ⊙ (p − y)/N
    # G+ / G−: |weighted gradient| of the class's own samples / of the others
    assert b.state["pos"].tolist() == pytest.approx([abs(grad[0][0]), abs(grad[1][1])], abs=1e-6)
    assert b.state["neg"].tolist() == pytest.approx([abs(grad[1][0]), abs(grad[0][1])], abs=1e-6)


def test_second_step_feeds_the_accumulated_gradients_back():
    # after the first step (sigmoid) G+ = [.5, .25], G− = [3/17, .375]; with the default
    # a = 50, b = 0.5 the error is e = −(50 G+ − 0.5 G−) (e_{t−1} = 0) and Kp = 1 moves u by e
    b = _balancer("sigmoid")
    z = torch.tensor([[0.0, LN3], [LN3, 0.0]], dtype=torch.float64, requires_grad=True)
    b.loss(z, torch.tensor([0, 1]))
    b.p = G.GrabParams(kp=1.0, loss="sigmoid")  # default scales 50 / 0.5 (the official code)
    w_pos, w_neg = b.weights()
    e = [-(50 * 0.5 - 0.5 * 3 / 17), -(50 * 0.25 - 0.5 * 0.375)]
    u = [U2 + e[0], e[1]]  # 81.093 − 24.912, −12.3125
    assert b.state["out"].tolist() == pytest.approx(u, abs=1e-4)
    assert w_pos.tolist() == pytest.approx([(10 / 9) / (1 / 9 + math.exp(-0.01 * x)) for x in u], abs=1e-5)
    assert w_neg.tolist() == pytest.approx([(10 / 9) / (1 / 9 + math.exp(0.01 * x)) for x in u], abs=1e-5)


def test_softmax_balances_positive_against_negative():
    # softmax, default scales 1 / 1: after the first step G+ = [3/4, 3/8], G− = [3/17, 3/8];
    # e = −(G+ − G−) = [−(3/4 − 3/17), 0]: class 1 is balanced and its output stays at 0
    b = _balancer("softmax")
    z = torch.tensor([[0.0, LN3], [LN3, 0.0]], dtype=torch.float64, requires_grad=True)
    b.loss(z, torch.tensor([0, 1]))
    b.p = G.GrabParams(kp=1.0)
    assert b.scales() == (1.0, 1.0)
    b.weights()
    assert b.state["out"].tolist() == pytest.approx([U2 - (3 / 4 - 3 / 17), 0.0], abs=1e-5)


def test_prior_estimates_by_hand():
    # responses on content-free inputs: softmax [1/4, 3/4] and [1/2, 1/2] -> mean [3/8, 5/8]
    p = G.prior_from_responses(torch.tensor([[0.0, LN3], [LN3, LN3]]))
    assert p.tolist() == pytest.approx([3 / 8, 5 / 8], abs=1e-7)
    assert G.tail_mask(p, 1.0).tolist() == [True, False]  # 3/8 < 1/2
    # a linear classifier's class-vector norms 5, 1, 10 -> [5, 1, 10]/16
    w = torch.tensor([[3.0, 4.0], [0.0, 1.0], [6.0, 8.0]])
    p = G.prior_from_weight_norms(w)
    assert p.tolist() == pytest.approx([5 / 16, 1 / 16, 10 / 16], abs=1e-7)
    assert G.tail_mask(p, 1.0).tolist() == [True, True, False]  # below 1/3
    assert G.tail_mask(p, 0.5).tolist() == [False, True, False]  # below 1/6


def test_a_class_leaving_the_tail_has_its_controller_reset():
    st = G.fresh_state(2)
    st["out"], st["err"] = torch.tensor([30.0, -20.0]), torch.ones(3, 2)
    st["pos"] = torch.tensor([1.0, 2.0])
    b = G.Balancer(G.GrabParams(), st, torch.tensor([False, True]))
    assert b.state["out"].tolist() == [0.0, -20.0]
    assert b.state["err"][:, 0].tolist() == [0.0, 0.0, 0.0] and b.state["err"][:, 1].tolist() == [1.0, 1.0, 1.0]
    assert b.state["pos"].tolist() == [1.0, 2.0]  # the accumulated gradients are kept
    assert st["out"].tolist() == [30.0, -20.0]  # the stored state is not modified
    w_pos, w_neg = b.weights()
    assert float(w_pos[0]) == 1.0 and float(w_neg[0]) == 1.0


# ----------------------------------------------------------------------------- in the federation


@pytest.fixture
def cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        return cfg_factory(tiny_bert_dir, toy_jsonl, **kw)
    return make


def on(over=None, **kw):
    """The config kwargs that turn the switch on ([switch.grab], its settings inside)."""
    return {**kw, **(over or {"switch__grab": "{}"})}


def test_off_by_default_and_the_balancer_reaches_the_objective(cfg):
    exp = build(cfg(algorithm='"lora"'))
    assert exp.switches == {} and start_switches(exp, 0, None, {}) == {}
    assert train_context(exp, 0).task_loss is cross_entropy
    exp = build(cfg(algorithm='"lora"', switch__grab='{loss = "softmax"}'))
    received = {n: exp.init_params[n].clone() for n in exp.global_names}
    link = start_switches(exp, 0, None, received)["grab"]
    c = exp.clients[0]
    x = [exp.data.train_texts[i] for i in c.train_idx[:8]]
    y = torch.as_tensor(exp.data.train_labels[c.train_idx[:8]])
    exp.model.eval()
    ce = cross_entropy_objective(exp.model, x, y, c.train_idx[:8], TrainContext())["task"]
    gr = cross_entropy_objective(exp.model, x, y, c.train_idx[:8], train_context(exp, 0, [link]))["task"]
    assert float(gr.detach()) == pytest.approx(float(ce.detach()), abs=1e-5)  # the value is the plain CE
    st = link.state()
    assert set(st) == set(G.STATE_KEYS) and float(st["pos"].sum()) > 0 and float(st["neg"].sum()) > 0


def test_the_balancer_takes_its_settings_and_the_prior():
    """start: every controller open (prior = "all"), or the tail the content-free prior names."""
    class Ops:
        num_classes, fresh = 3, staticmethod(dict)

        def logits(self, params, texts):
            assert texts == [""] and params == {"w": 1}
            return torch.tensor([[2.0, 0.0, 0.0]])  # softmax: [0.79, 0.11, 0.11]: tail 1 and 2

    p = G.GrabParams(kp=2.0, loss="sigmoid")
    b = G.start(p, Ops(), {}, {"w": 1}).state()
    assert b["out"].tolist() == [0.0] * 3
    link = G.start(G.GrabParams(prior="content-free", kp=1.0), Ops(), {}, {"w": 1})
    z, y = torch.zeros(2, 3, requires_grad=True), torch.tensor([0, 1])
    link.wrap(cross_entropy)(z, y)
    link.wrap(cross_entropy)(z, y)  # the second step's PID sees the first's sums
    assert link.state()["out"][0] == 0.0 and bool((link.state()["out"][1:] != 0).all())
    kept = {k: v + 1 for k, v in link.state().items()}
    assert torch.equal(G.start(p, Ops(), kept, {}).state()["pos"], kept["pos"])  # from what the client kept


def test_the_state_is_private_and_persists_across_rounds(cfg):
    exp = build(cfg(**on(algorithm='"lora"')))
    store = MemoryStore()
    down = wire.encode({n: exp.init_params[n].clone() for n in exp.global_names})
    up, _ = fit(exp, store, 0, 0, down)
    st = store.get(0)
    assert {f"switch/grab/{k}" for k in G.STATE_KEYS} <= set(st)
    assert not any("grab" in k for k in wire.decode(up))  # never uploaded
    acc1 = st["switch/grab/pos"] + st["switch/grab/neg"]
    assert float(st["switch/grab/pos"].sum()) > 0 and float(st["switch/grab/neg"].sum()) > 0
    fit(exp, store, 0, 1, down)
    st2 = store.get(0)
    assert bool((st2["switch/grab/pos"] + st2["switch/grab/neg"] > acc1).all())  # round 2 continues round 1's sums


@pytest.mark.parametrize("over", [
    dict(algorithm='"lora"'),
    dict(algorithm='"promptfolio"', peft__type='"prompt"', peft__n_ctx=0, method="{theta = 0.2}"),
])
def test_grab_runs_end_to_end(over, cfg):
    from fedsplice.runtimes.inprocess import run_rounds

    exp, store, recs = build(cfg(**on(**over))), MemoryStore(), []
    final = run_rounds(exp, store, recs.append)
    assert [r["round"] for r in recs] == [0, 1, 2]
    # every client that trained keeps its balancer state (PRIVATE, in its store)
    for c in {c for r in exp.sampling[:2] for c in r}:
        assert {f"switch/grab/{k}" for k in G.STATE_KEYS} <= set(store.get(c)), c
    # GM, recomputed by hand: the final GLOBAL tensors with fresh PRIVATE ones on the global test set
    d = exp.data
    exp.model.load_params({**final["global_params"], **{n: exp.init_params[n] for n in exp.private_names}})
    pred = exp.model.predict(d.test_texts[:d.global_test_size], 8).argmax(1).numpy()
    assert recs[-1]["gm"]["accuracy"] == pytest.approx(float((pred == d.test_labels[:d.global_test_size]).mean()))
    # the switch changed the training: the same run without it ends on other GLOBAL tensors
    off = run_rounds(build(cfg(**over)), MemoryStore(), lambda r: None)["global_params"]
    assert any(not torch.equal(final["global_params"][n], off[n]) for n in exp.global_names)


@pytest.mark.parametrize("field, value", [
    ("kp", "-1.0"), ("ki", "nan"), ("kd", "inf"), ("pos_scale", "-1.0"),
    ("neg_scale", "nan"), ("out_limit", "0.0"), ("tail_ratio", "-0.1"), ("loss", '"focal"'),
])
def test_bad_hyperparameters_are_one_line_errors(field, value, cfg, capsys):
    with pytest.raises(ConfigError, match=f"switch.grab.{field}"):
        cfg(algorithm='"lora"', **{f"switch__grab__{field}": value})
    rc = main(["validate", "--no-data", "--set", f"switch.grab.{field}={value}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and f"switch.grab.{field}" in err, err


def test_the_earlier_settings_read_as_the_switch():
    """[grab] enabled = true (and before it client.grab*), as a user's old file or a saved run's
    config.toml wrote them, read as [switch.grab], so recorded runs stay reusable; a setting under
    enabled = false is refused as before."""
    cur = to_dict(load_config(overrides=["switch.grab.kp=2.0"]))
    assert cur["switch"] == {"grab": {"kp": 2.0}}
    assert to_dict(load_config(overrides=["client.grab=true", "client.grab_kp=2.0"])) == cur
    assert to_dict(load_config(overrides=["grab.enabled=true", "grab.kp=2.0"])) == cur
    # a run saved before the switch wrote every default of [grab], and client.logit_adjustment = 0
    saved = {k: v for k, v in cur.items() if k != "switch"}
    saved["grab"] = {"enabled": True, **dataclasses.asdict(G.GrabParams(kp=2.0))}
    saved["client"] = {**saved["client"], "logit_adjustment": 0.0}
    assert saved_as_current(saved) == cur
    saved["grab"] = {"enabled": False, **dataclasses.asdict(G.GrabParams())}
    assert saved_as_current(saved)["switch"] == {}
    with pytest.raises(ConfigError, match=r"^grab.kp = 2.0 does nothing while grab.enabled = false: write \[switch"):
        load_config(overrides=["grab.kp=2.0"])


def test_a_switch_turns_off_and_on_from_the_command_line_and_old_forms_never_fight_the_new():
    """`--set switch.NAME=false` removes a switch a file turns on, `=true` turns one on with its
    defaults; an earlier form set beside the new table is refused in one line, not ignored."""
    grab, la = "configs/cliplora-grab-fortunes.toml", "configs/cliplora-la-fortunes.toml"
    assert load_config(grab).switch == {"grab": {}}
    assert load_config(grab, ["switch.grab=false"]).switch == {}
    assert load_config(None, ["switch.grab=true"]).switch == {"grab": {}}
    assert load_config(la, ["switch.logit_adjustment=false"]).switch == {}
    for path, sets, says in ((grab, ["grab.enabled=false"], "grab.enabled = false and [switch.grab] are both set"),
                             (grab, ["client.grab=true"], "grab.enabled = true and [switch.grab] are both set"),
                             (la, ["client.logit_adjustment=0"], "client.logit_adjustment = 0 is now "
                                                                 "[switch.logit_adjustment] tau, which this config")):
        with pytest.raises(ConfigError, match="^" + re.escape(says)):
            load_config(path, sets)
    with pytest.raises(ConfigError, match=r"^client.logit_adjustment must be >= 0 \(0 = off\), got -1"):
        load_config(None, ["client.logit_adjustment=-1"])
    with pytest.raises(ConfigError, match="^grab: expected a table"):
        load_config(None, ["grab=true", "client.grab=true"])


def test_an_algorithm_with_its_own_objective_refuses_the_switch(cfg):
    """Refused where the recipe is planned, before any weight loads (`fedsplice validate`, build)."""
    from fedsplice.algorithms import NoParams, Recipe, register_algorithm
    from fedsplice.algorithms import registry as R
    from fedsplice.core import split as S

    rule = "^switch.grab re-weights the plain cross-entropy, and algorithm {!r} trains on an objective of its own"
    with pytest.raises(ConfigError, match=rule.format("fedpurel")):
        build(cfg(**on(algorithm='"fedpurel"', method="{personal_rounds = 1}")))
    build(cfg(**on(algorithm='"fedpurel"', method="{personal_rounds = 1, purify = false}")))  # plain CE: composes
    # a user's method declares nothing: the switch's own check refuses it
    register_algorithm("own-objective", NoParams,
                       lambda p, spec: Recipe(S.all_global(spec.infos), objective=cross_entropy_objective))
    try:
        with pytest.raises(ConfigError, match=rule.format("own-objective")):
            build(cfg(**on(algorithm='"own-objective"')))
    finally:
        del R.ALGORITHMS["own-objective"]
