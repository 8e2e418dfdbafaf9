"""pFedLoRA (algorithms/pfedlora.py): the second (private) LoRA adapter, the split, the
alternating phases (each trains only its group), what travels (federated LoRA's bytes), an
end-to-end tiny run and bad parameters."""

import pytest
import torch

from fedsplice.core import wire
from fedsplice.federation import tasks
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds

PFL = dict(algorithm='"pfedlora"', method="{private_r = 4, private_epochs = 1, global_epochs = 2}")


def test_private_adapter_split_and_forward(tiny_cfg):
    exp = build(tiny_cfg(**PFL))
    infos = exp.model.param_infos()
    priv = [n for n in infos if ".private." in n]
    assert priv and sorted(priv) == exp.private_names
    assert all(infos[n].kind == "lora_private" and infos[n].role for n in priv)
    assert all(".default." in n for n in exp.global_names)
    assert len(exp.global_names) == len(priv)  # one private A, B beside each shared A, B
    a = next(n for n in priv if ".lora_A." in n)
    assert exp.model.trainable()[a].shape[0] == 4  # private_r
    sc = exp.model.scalings()
    assert sc[a] == pytest.approx(tiny_cfg().peft.alpha / 4)  # its own alpha / r
    # both adapters act: a nonzero private B changes the logits; zero-shot switches both off
    texts = ["a goal in the last minute", "the cell divides"]
    m = exp.model
    with torch.no_grad():
        before = m.predict(texts, 2)
        b = next(n for n in priv if ".lora_B." in n)
        m.trainable()[b].add_(0.5)
        assert not torch.allclose(m.predict(texts, 2), before)
        with m.zero_shot():
            zs = m.predict(texts, 2)
        m.trainable()[b].zero_()
        with m.zero_shot():
            assert torch.allclose(m.predict(texts, 2), zs)


def test_phases_train_one_group_each(tiny_cfg, monkeypatch, capture_uploads):
    exp = build(tiny_cfg(**PFL, server__rounds=1, server__clients_per_round=1))
    calls = []
    orig = tasks.train_client

    def spy(exp_, cid, **kw):
        params = exp_.model.trainable()
        before = {n: p.detach().clone() for n, p in exp_.model.named_parameters() if ".lora_" in n}
        out = orig(exp_, cid, **kw)
        moved = sorted(n for n, p in exp_.model.named_parameters() if ".lora_" in n and not torch.equal(p, before[n]))
        calls.append((sorted(params), kw.get("epochs"), moved))
        return out

    monkeypatch.setattr(tasks, "train_client", spy)
    store = MemoryStore()
    run_rounds(exp, store, lambda r: None)
    # private first (E_1 = 1), then shared (E_2 = 2); each moves only its own tensors
    assert [(c[0], c[1]) for c in calls] == [(exp.private_names, 1), (exp.global_names, 2)]
    assert set(calls[0][2]) <= set(exp.private_names) and calls[0][2]
    assert set(calls[1][2]) <= set(exp.global_names) and calls[1][2]
    assert len(exp.model.trainable()) == len(exp.global_names) + len(exp.private_names)  # restored
    # only the shared adapter travels; the private one is stored, trained
    (_, cid, up), = capture_uploads
    assert sorted(wire.decode(up)) == exp.global_names
    st = store.get(cid)
    assert all(not torch.equal(st[f"param/{n}"], exp.init_params[n]) for n in exp.private_names if ".lora_B." in n)


def _two_rounds_of_every_client(tiny_cfg, **kw):
    n_train = len(build(tiny_cfg(**PFL)).train_ids)
    exp = build(tiny_cfg(**PFL, server__rounds=2, server__clients_per_round=n_train, **kw))
    store = MemoryStore()
    run_rounds(exp, store, lambda r: None)  # round 2 trains every client again, from its stored state
    return exp, store.get(exp.train_ids[0])


def test_optimizer_state_rule(tiny_cfg):
    """client.optimizer_state: fresh (default) stores no optimizer state; keep_private stores the
    private adapter's AdamW moments, and round 2 then steps from them (other private tensors)."""
    exp, fresh = _two_rounds_of_every_client(tiny_cfg)
    assert not any(k.startswith("opt/") for k in fresh)
    _, kept = _two_rounds_of_every_client(tiny_cfg, client__optimizer_state='"keep_private"')
    assert {k[len("opt/"):].rsplit("/", 1)[0] for k in kept if k.startswith("opt/")} == set(exp.private_names)
    b = next(n for n in exp.private_names if ".lora_B." in n)
    assert not torch.equal(kept[f"param/{b}"], fresh[f"param/{b}"])


def test_shared_budget_splits_one_local_budget(tiny_cfg, monkeypatch):
    """method.budget = "shared": E_1 : E_2 = 1 : 2 of one epoch's steps (the remainder to the first
    phase), each phase cut at its share; the per-phase default runs 1 and 2 whole epochs."""
    steps = []
    orig = tasks.train_client

    def spy(exp_, cid, **k):
        out = orig(exp_, cid, **k)
        steps.append((cid, out[1]["steps"]))
        return out

    monkeypatch.setattr(tasks, "train_client", spy)
    for budget in ("per_phase", "shared"):
        kw = dict(PFL, method=f'{{private_epochs = 1, global_epochs = 2, budget = "{budget}"}}')
        exp = build(tiny_cfg(**kw, server__rounds=1, server__clients_per_round=1, client__max_steps=0))
        steps.clear()
        run_rounds(exp, MemoryStore(), lambda r: None)
        cid = steps[0][0]  # the one client of the round
        epoch = -(-len(exp.clients[cid].train_idx) // exp.cfg.client.batch_size)
        assert epoch >= 3  # so that both phases of the shared budget step
        want = [epoch, 2 * epoch] if budget == "per_phase" else [epoch - epoch * 2 // 3, epoch * 2 // 3]
        assert [n for _, n in steps] == want, budget


def test_same_bytes_as_federated_lora(tiny_cfg):
    records = {}
    for name, kw in (("pfedlora", PFL), ("lora", dict(algorithm='"lora"'))):
        recs = []
        run_rounds(build(tiny_cfg(**kw, server__rounds=1)), MemoryStore(), recs.append)
        records[name] = recs[-1]
    assert records["pfedlora"]["up_bytes"] == records["lora"]["up_bytes"] > 0
    assert "private_loss" in records["pfedlora"] and "global_loss" in records["pfedlora"]


@pytest.mark.parametrize("sets,match", [
    (["method.private_epochs=0"], "method.private_epochs and method.global_epochs must be >= 1"),
    (["method.private_r=0"], "method.private_r must be >= 1"),
    (["peft.type=\"prompt\""], "algorithm 'pfedlora' trains a shared and a private LoRA adapter: set peft.type"),
    # a moved setting of another method: the one line names where it went
    (["peft.prompt_lowrank=8"], "peft.prompt_lowrank = 8 is now `rank` in the [method] table of algorithm 'fedpgp'"),
])
def test_bad_parameters_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**PFL), sets, match)


def test_shared_budget_of_one_step_skips_the_second_phase(tiny_cfg):
    kw = dict(PFL, method='{private_epochs = 1, global_epochs = 1, budget = "shared"}')
    exp = build(tiny_cfg(**kw, client__max_steps=1))
    budgets = tasks.phase_budgets(exp, exp.train_ids[0], exp.cfg.client, tasks.round_phases(exp, 1))
    assert [(e, c.max_steps) for e, c in budgets] == [(1, 1), (0, exp.cfg.client.max_steps)]
    recs = []
    run_rounds(build(tiny_cfg(**kw, client__max_steps=1, server__rounds=1)), MemoryStore(), recs.append)
    assert recs[-1]["private_steps"] == 1.0 and recs[-1]["global_steps"] == 0.0 and "global_loss" not in recs[-1]
