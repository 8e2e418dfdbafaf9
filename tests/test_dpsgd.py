"""privacy.local = "dpsgd" (sample-level DP-SGD by Opacus, federation.dpsgd): per-example clipping
against hand-computed gradients, the noise's scale, DP-SGD with no clipping and no noise as the
plain step (PFAdapter's orthogonality term included), each client's ε from its own steps across
rounds, the ledger, and the refusals."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from fedsplice.config import ClientConfig
from fedsplice.core.context import TrainContext
from fedsplice.errors import ConfigError
from fedsplice.federation import dpsgd
from fedsplice.federation import privacy as FP
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.federation.train import local_train
from fedsplice.runtimes.inprocess import run_rounds

pytestmark = pytest.mark.unit

X = torch.tensor([[1.0, 2.0, 0.0], [0.0, -1.0, 3.0], [2.0, 0.0, 1.0], [-1.0, 1.0, 1.0]])
Y = np.array([0, 1, 1, 0])


class Toy(nn.Module):
    """A linear classifier over fixed features; its "texts" are row indices."""

    def __init__(self, d_in=3, d_out=2, feats=X):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(d_in, d_out)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(d_out, d_in, generator=g))
            self.lin.bias.copy_(torch.randn(d_out, generator=g))
        self.feats = feats

    def forward(self, texts):
        return self.lin(self.feats[[int(t) for t in texts]])

    def trainable(self):
        return {n: p for n, p in self.named_parameters() if p.requires_grad}


def train(model, private, y=Y, lr=0.5, batch=4):
    texts = [str(i) for i in range(len(y))]
    cfg = ClientConfig(optimizer="sgd", lr=lr, momentum=0.0, weight_decay=0.0, batch_size=batch, local_epochs=1)
    ctx = TrainContext(client=0, split={})
    return local_train(model, texts, y, cfg=cfg, keep_opt=set(), opt_state={}, ctx=ctx,
                       rng=np.random.default_rng(0), private=private)


def local(z=0.0, clip=1.0, q=1.0, seed=(1, 2)):
    return dpsgd.LocalDP(z, clip, q, 1e-5, "rdp", list(seed) if seed is not None else None)


def test_each_example_is_clipped_then_averaged_over_the_batch():
    m = Toy()
    w0, b0 = m.lin.weight.detach().clone(), m.lin.bias.detach().clone()
    with torch.no_grad():  # by hand: softmax(Wx+b) - onehot(y), outer x; each clipped to C as one vector
        err = torch.softmax(X @ w0.T + b0, 1) - torch.eye(2)[Y]
        gw, gb = err[:, :, None] * X[:, None, :], err
        norms = (gw.pow(2).sum((1, 2)) + gb.pow(2).sum(1)).sqrt()
        scale = torch.clamp(0.3 / norms, max=1.0)
        want_w = w0 - 0.5 * (gw * scale[:, None, None]).sum(0) / 4
        want_b = b0 - 0.5 * (gb * scale[:, None]).sum(0) / 4
    assert (norms > 0.3).any() and (norms < 0.3).any()  # the bound binds on some examples, not all
    p = local(z=0.0, clip=0.3)
    _, stats = train(m, p)
    assert torch.allclose(m.lin.weight, want_w, atol=1e-6) and torch.allclose(m.lin.bias, want_b, atol=1e-6)
    assert p.steps == 1 and stats["steps"] == 1
    assert not hasattr(m.lin.weight, "grad_sample")  # Opacus is detached after the stage


def test_noise_has_std_z_c_over_the_batch_and_seeded_noise_reproduces():
    feats = torch.zeros(8, 2000)  # zero features: the weight's per-example gradients are 0
    ups = []
    for seed in ((1, 2), (1, 2), (1, 3)):
        m = Toy(2000, 10, feats)
        with torch.no_grad():
            m.lin.weight.zero_()
        train(m, local(z=2.0, clip=0.5, seed=seed), y=np.zeros(8, dtype=int), lr=1.0, batch=8)
        ups.append(-m.lin.weight.detach().reshape(-1))
    assert float(ups[0].std()) == pytest.approx(2.0 * 0.5 / 8, rel=0.02) and abs(float(ups[0].mean())) < 2e-3
    assert torch.equal(ups[0], ups[1]) and not torch.equal(ups[0], ups[2])


def test_a_forward_that_mixes_examples_is_refused():
    class Pairs(Toy):  # each example's logits from two rows (as B·C verbalizer sequences would be)
        def forward(self, texts):
            rows = self.lin(self.feats[[int(t) for t in texts] * 2])
            return rows[:len(texts)] + rows[len(texts):]

    with pytest.raises(ConfigError, match="per-example gradients over \\[8\\] rows for a batch of 4 examples"):
        train(Pairs(), local(z=1.0))


def test_flora_trains_only_lora_locally_so_its_dense_delta_is_no_obstacle(tiny_cfg):
    cfg = tiny_cfg(algorithm='"flora"', method__ranks="[4, 2]", privacy__local='"dpsgd"',
                   privacy__local_noise_multiplier=1.0)
    assert dpsgd.trained_groups(build(cfg).recipe) == {"private"}  # the GLOBAL dense ΔW is frozen locally


def test_dpsgd_without_clipping_or_noise_is_the_plain_step_with_the_orthogonality_term(tiny_cfg):
    # PFAdapter: its orthogonality term reads no data, so its gradient joins after the (zero) noise
    cfg = tiny_cfg(method__ortho_lambda=0.5, client__max_steps=3, client__optimizer='"sgd"', client__lr=0.5)
    exp = build(cfg)
    from fedsplice.federation import tasks

    cid, out = exp.train_ids[0], []
    for private in (None, local(z=0.0, clip=1e9, q=0.5)):
        exp.model.load_params(exp.init_params)
        tasks.train_client(exp, cid, rnd=1, torch_round=1, ctx=tasks.train_context(exp, cid),
                           step=tasks.Step.of(exp.recipe), private=private)
        out.append({n: t.detach().clone() for n, t in exp.model.trainable().items()})
    moved = max(float((out[0][n] - exp.init_params[n]).abs().max()) for n in out[0])
    assert moved > 1e-3
    for n in out[0]:
        assert torch.allclose(out[0][n], out[1][n], atol=1e-5), n
    assert not exp.model._per_sample and exp.model.training  # per_sample() is undone


def test_each_client_accounts_its_own_steps_across_rounds(tiny_cfg, tmp_path):
    cfg = tiny_cfg(privacy__local='"dpsgd"', privacy__local_noise_multiplier=1.1, privacy__local_clip=1.0,
                   privacy__noise='"seeded"', server__rounds=3)
    exp = build(cfg)
    exp.ledger = tmp_path
    records, store = [], MemoryStore()
    run_rounds(exp, store, records.append)
    steps: dict[int, int] = {}
    sites = {c: [json.loads(x) for x in (tmp_path / f"site-{c}.jsonl").read_text().splitlines()]
             for c in exp.train_ids if (tmp_path / f"site-{c}.jsonl").exists()}
    for r in records[1:]:
        eps = {}
        for cid in r["clients"]:
            n = len(exp.clients[cid].train_idx)
            steps[cid] = steps.get(cid, 0) + min(cfg.client.max_steps, -(-n // cfg.client.batch_size))
            eps[cid] = FP.epsilon(1.1, min(1.0, cfg.client.batch_size / n), steps[cid], 1e-5)
            logged = {row["local_epsilon"] for row in sites[cid] if row["round"] == r["round"]}
            assert len(logged) == 1 and logged.pop() == pytest.approx(eps[cid])  # its own ε in its ledger
        assert r["dp_local_epsilon"] == pytest.approx(max(eps.values()))  # the worst of the round's clients
    assert any(sum(c in r["clients"] for r in records[1:]) > 1 for c in steps)  # steps accumulated


def test_target_epsilon_picks_each_clients_noise():
    exp = type("E", (), {})()
    exp.cfg = type("C", (), {})()
    from fedsplice.config.privacy import PrivacyConfig

    exp.cfg.privacy = PrivacyConfig(local="dpsgd", local_target_epsilon=4.0)
    exp.cfg.client = ClientConfig(batch_size=8, local_epochs=1)
    exp.cfg.server = type("S", (), {"rounds": 5})()
    exp.cfg.seed = 0
    exp.clients = {0: type("K", (), {"train_idx": np.arange(40)})(), 1: type("K", (), {"train_idx": np.arange(80)})()}
    a, b = dpsgd.session(exp, 0, 1), dpsgd.session(exp, 1, 1)
    for p, steps in ((a, 25), (b, 50)):  # trained in every round: rounds × ⌈n / batch⌉ steps
        p.steps = steps
        assert 3.95 <= p.epsilon() <= 4.0
    assert a.noise_multiplier != b.noise_multiplier and a.sample_rate == 0.2 and b.sample_rate == 0.1


def test_cli_run_reports_the_worst_clients_epsilon(tiny_cfg, tmp_path, capsys):
    from fedsplice.app.cli import main
    from fedsplice.app.rundir import write_config

    write_config(tmp_path, tiny_cfg(privacy__local='"dpsgd"', privacy__local_noise_multiplier=0.8,
                                    privacy__noise='"seeded"'))
    assert main(["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run")]) == 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    out = " ".join(capsys.readouterr().out.split())
    eps = [json.loads(x).get("dp_local_epsilon") for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert res["privacy_local"]["epsilon_max"] == max(e for e in eps if e is not None) > 0
    assert "privacy" not in res  # no client-level DP asked for
    assert f"DP-SGD in each client: ε ≤ {res['privacy_local']['epsilon_max']:.4g} at δ = 1e-05" in out
    assert main(["audit", str(tmp_path / "run")]) == 0


@pytest.mark.parametrize("sets,match", [
    (["privacy.local=\"dpsgd\"", "privacy.local_clip=-1", "privacy.local_noise_multiplier=1"],
     "privacy.local_clip must be > 0"),
    (["privacy.local=\"dpsgd\""], "with no noise gives no privacy"),
    (["privacy.local=\"dpsgd\"", "privacy.local_noise_multiplier=1", "privacy.local_target_epsilon=2"],
     "are both set: keep one"),
    (["privacy.local=\"dpsgd\"", "privacy.local_noise_multiplier=1", "peft.type=\"prompt\""], "trains the class side"),
    (["privacy.local=\"dpsgd\"", "privacy.local_noise_multiplier=1", "runtime.precision=\"bf16\""],
     "set runtime.precision = 'fp32'"),
    (["privacy.local=\"dpsgd\"", "privacy.local_noise_multiplier=1", "switch.grab={}"], "Fed-GraB re-weights"),
    (["privacy.local=\"dpsgd\"", "privacy.local_noise_multiplier=1", "algorithm=\"fedpgp\"", "method={}",
      "peft.type=\"prompt\""], "a loss or gradient rule of its own"),
])
def test_bad_dpsgd_settings_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(), sets, match)
