"""End to end on a tiny BERT / Llama and a toy data set: what travels, what stays, what is exact."""

import json
import math

import numpy as np
import pytest
import torch

from fedsplice.app.runner import run_experiment
from fedsplice.core import wire
from fedsplice.core.server import deltas, fedavg, weighted_mean
from fedsplice.federation.experiment import build
from fedsplice.federation.store import DiskStore, MemoryStore
from fedsplice.runtimes import inprocess as simulation
from fedsplice.runtimes.inprocess import run_rounds

EMPTY_PAYLOAD = len(wire.encode({}))


def _run(cfg, store=None):
    exp = build(cfg)
    records = []
    final = run_rounds(exp, store or MemoryStore(), records.append)
    return exp, records, final


@pytest.fixture
def cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        return cfg_factory(tiny_bert_dir, toy_jsonl, **kw)
    return make


# ----------------------------------------------------------------------------- the wire


def test_private_tensors_never_travel(cfg, monkeypatch):
    payloads = []
    orig = wire.encode

    def spy(tensors):
        payloads.append(sorted(tensors))
        return orig(tensors)

    monkeypatch.setattr(wire, "encode", spy)
    c = cfg(server__rounds=2)
    exp, records, final = _run(c)
    private, glob = set(exp.private_names), sorted(exp.global_names)
    assert len(private) == 8 and len(glob) == 8
    # per round: one broadcast + one upload per sampled client, plus one evaluation broadcast
    # per evaluated round (0..rounds); each exactly the GLOBAL names
    evals = c.server.rounds + 1
    assert len(payloads) == c.server.rounds * (1 + c.server.clients_per_round) + evals
    for names in payloads:
        assert names == glob
        assert not private & set(names)
    assert sorted(final["global_params"]) == glob


def test_a_leaking_client_is_refused(cfg, monkeypatch):
    orig = simulation.fit_client

    def leaky(exp, store, cid, rnd, down):
        up, st = orig(exp, store, cid, rnd, down)
        t = wire.decode(up)
        t[exp.private_names[0]] = exp.init_params[exp.private_names[0]]
        return wire.encode(t), st

    monkeypatch.setattr(simulation, "fit_client", leaky)
    # refused on the server, logged with the client id, never aggregated (issue 6: no crash)
    exp, records, final = _run(cfg(server__rounds=1))
    r = records[1]
    assert r["rejected"] == len(exp.sampling[0]) and r["skipped"] and r["clients"] == []
    assert [e["client"] for e in r["events"] if e["event"] == "rejected"] == exp.sampling[0]
    assert all("PRIVATE" in e["reason"] for e in r["events"])
    assert all(torch.equal(final["global_params"][n], exp.init_params[n]) for n in exp.global_names)


@pytest.mark.parametrize("store_kind, rule", [("memory", "fresh"), ("disk", "keep_private")])
def test_private_state_is_bit_identical_across_server_steps(cfg, monkeypatch, tmp_path, store_kind, rule):
    c = cfg(server__rounds=3, client__optimizer_state=f'"{rule}"')
    exp = build(c)
    store = MemoryStore() if store_kind == "memory" else DiskStore(tmp_path / "state")
    events = []  # (round, cid, private before, private after, global before)
    from fedsplice.federation import tasks

    orig = tasks.local_train

    def spy(model, *a, **k):
        p = model.trainable()
        before = {n: p[n].detach().clone() for n in exp.private_names}
        g_before = {n: p[n].detach().clone() for n in exp.global_names}
        out = orig(model, *a, **k)
        after = {n: p[n].detach().clone() for n in exp.private_names}
        events.append((k["ctx"].round, k["ctx"].client, before, after, g_before))
        return out

    monkeypatch.setattr(tasks, "local_train", spy)
    stored_after_round = {}

    def on_round(rec):
        if rec["round"] > 0:
            stored_after_round[rec["round"]] = {cid: store.get(cid) for cid in exp.train_ids}

    run_rounds(exp, store, on_round)
    assert [(r, cid) for r, cid, *_ in events] == [
        (r + 1, cid) for r, ids in enumerate(exp.sampling) for cid in ids]

    last_private = {}  # cid -> private tensors after its latest update
    for r, cid, before, after, _g_before in events:
        # a client starts from its own stored PRIVATE state (fresh init the first time)
        ref = last_private.get(cid, {n: exp.init_params[n] for n in exp.private_names})
        assert all(torch.equal(before[n], ref[n]) for n in ref)
        assert any(not torch.equal(before[n], after[n]) for n in after)  # training moved it
        last_private[cid] = after
        # after the server step and every other client's update, the store still holds it
        for later in range(r, c.server.rounds + 1):
            st = stored_after_round[later][cid]
            if later > r and cid in exp.sampling[later - 1]:
                break
            for n in exp.private_names:
                assert torch.equal(st[f"param/{n}"], after[n]), (later, cid, n)
            # client.optimizer_state: fresh stores no optimizer state; keep_private the Adam
            # moments of PRIVATE tensors; nothing of GLOBAL tensors either way
            assert {k for k in st if k.startswith("opt/")} == ({
                f"opt/{n}/{s}" for n in exp.private_names for s in ("step", "exp_avg", "exp_avg_sq")}
                if rule == "keep_private" else set())
    # never-sampled clients have no state
    seen = {cid for ids in exp.sampling for cid in ids}
    assert all(stored_after_round[c.server.rounds][cid] is None for cid in set(exp.train_ids) - seen)
    # clients of one round receive the same GLOBAL tensors; round 1's are the initial ones
    by_round = {}
    for r, _cid, _, _, g_before in events:
        by_round.setdefault(r, []).append(g_before)
    for _r, gs in by_round.items():
        for g in gs[1:]:
            assert all(torch.equal(g[n], gs[0][n]) for n in g)
    assert all(torch.equal(by_round[1][0][n], exp.init_params[n]) for n in exp.global_names)
    assert any(not torch.equal(by_round[2][0][n], exp.init_params[n]) for n in exp.global_names)


# ----------------------------------------------------------------------------- FedAvg identity


def test_weighted_mean_of_identical_uploads_then_fedavg_is_the_upload():
    g = torch.Generator().manual_seed(0)
    # LoRA-like: B from 0, A moved a little from its init (the regime of a round)
    x = {"A": torch.rand(4, 16, generator=g) + 0.5, "B": torch.zeros(16, 4)}
    u = {"A": x["A"] + 0.01 * torch.randn(4, 16, generator=g), "B": 0.01 * torch.randn(16, 4, generator=g)}
    m = weighted_mean([u, u, u], [18, 49, 73])
    assert all(torch.equal(m[k], u[k]) for k in u)
    d = weighted_mean([deltas(u, x) for _ in range(3)], [18, 49, 73])
    opt = fedavg(1.0)
    new, state = opt.update(d, opt.init(x), x)
    assert all(torch.equal(new[k], u[k]) for k in u)
    assert int(state["step"]) == 1


def test_fedavg_lr1_reaches_the_client_model_exactly_for_any_values():
    g = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(10000, generator=g)}
    u = {"w": torch.randn(10000, generator=g)}
    d = weighted_mean([deltas(u, x)] * 2, [1, 3])
    opt = fedavg(1.0)
    new, _ = opt.update(d, opt.init(x), x)
    assert torch.equal(new["w"], u["w"])


def test_one_client_per_round_fedavg_global_is_its_upload(cfg, capture_uploads):
    c = cfg(algorithm="lora", server__clients_per_round=1, server__rounds=1)
    exp, records, final = _run(c)
    assert len(capture_uploads) == 1
    up = wire.decode(capture_uploads[0][2])
    assert sorted(up) == sorted(final["global_params"]) == sorted(exp.init_params)
    assert all(torch.equal(final["global_params"][n], up[n]) for n in up)
    assert any(not torch.equal(up[n], exp.init_params[n]) for n in up)


def test_two_clients_fedavg_is_the_sample_weighted_mean(cfg, capture_uploads):
    c = cfg(algorithm="lora", server__rounds=1)
    exp, records, final = _run(c)
    ups = [wire.decode(b) for _, _, b in capture_uploads]
    w = [len(exp.clients[cid].train_idx) for _, cid, _ in capture_uploads]
    assert w[0] != w[1]
    for n, g in final["global_params"].items():
        want = (ups[0][n].double() * w[0] + ups[1][n].double() * w[1]) / sum(w)
        assert torch.allclose(g.double(), want, rtol=0, atol=1e-6)


def test_fedyogi_one_round_follows_the_math(cfg, capture_uploads):
    c = cfg(algorithm="lora", server__rounds=1, server__optimizer='"fedyogi"', server__lr="0.05")
    exp, records, final = _run(c)
    lr, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3
    ups = [wire.decode(b) for _, _, b in capture_uploads]
    w = np.array([len(exp.clients[cid].train_idx) for _, cid, _ in capture_uploads], float)
    moved = 0
    for n, x0 in exp.init_params.items():
        x = x0.double()
        delta = sum(wi * (u[n].double() - x) for wi, u in zip(w, ups)) / w.sum()
        m = (1 - b1) * delta
        v0 = torch.full_like(x, tau**2)
        v = v0 - (1 - b2) * delta**2 * torch.sign(v0 - delta**2)
        want = x + lr * m / (torch.sqrt(v) + tau)
        got = final["global_params"][n].double()
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), n
        moved += int((got != x).sum())
    assert moved > 0
    st = final["server_state"]
    assert int(st["step"]) == 1 and len([k for k in st if k.startswith("v/")]) == len(exp.init_params)


# ----------------------------------------------------------------------------- local-only


def test_local_only_uploads_nothing_and_global_never_changes(cfg):
    c = cfg(algorithm="local", server__rounds=2)
    store = MemoryStore()
    exp, records, final = _run(c, store)
    assert exp.global_names == [] and final["global_params"] == {}
    m = c.server.clients_per_round
    for r in records[1:]:
        assert r["up_bytes"] == EMPTY_PAYLOAD * m and r["down_bytes"] == EMPTY_PAYLOAD * m
    assert final["up_bytes"] == EMPTY_PAYLOAD * m * c.server.rounds
    # GM (global tensors + fresh private ones) is the untrained model in every round
    assert all(r["gm"] == records[0]["gm"] for r in records)
    # ... while clients did train their private adapters
    cid = exp.sampling[0][0]
    st = store.get(cid)
    assert any(not torch.equal(st[f"param/{n}"], exp.init_params[n]) for n in exp.private_names)


def test_pfadapter_uploads_half_of_lora(cfg):
    _, rec_p, fin_p = _run(cfg(algorithm="pfadapter", server__rounds=1))
    exp_l, rec_l, fin_l = _run(cfg(algorithm="lora", server__rounds=1))
    ratio = fin_p["up_bytes"] / fin_l["up_bytes"]
    assert 0.45 <= ratio <= 0.55, ratio
    # measured, not estimated: each upload is exactly the serialized GLOBAL tensors
    per_client = len(wire.encode(exp_l.init_params))
    assert fin_l["up_bytes"] == per_client * 2 and rec_l[1]["up_bytes"] == per_client * 2
    assert fin_l["down_bytes"] == per_client * 2  # one broadcast per sampled client
    assert fin_p["down_bytes"] == fin_p["up_bytes"]


# ----------------------------------------------------------------------------- determinism, files


def _strip(records):
    return [{k: v for k, v in r.items() if k != "time_s"} for r in records]


@pytest.fixture(scope="module")
def two_runs(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path_factory):
    c = cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds=2)
    outs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"run{i}")
        res = run_experiment(c, out, overwrite=True, quiet=True)
        outs.append((out, res))
    return c, outs


def test_same_seed_same_metrics(two_runs):
    c, ((a, ra), (b, rb)) = two_runs
    la = [json.loads(s) for s in (a / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(s) for s in (b / "metrics.jsonl").read_text().splitlines()]
    assert _strip(la) == _strip(lb)
    assert all("train_loss" in r and math.isfinite(r["train_loss"]) for r in la[1:])
    ra, rb = dict(ra), dict(rb)
    for k in ("time_s", "cpu_s", "setup"):
        ra.pop(k), rb.pop(k)
    assert ra == rb


def test_sampling_and_partition_are_the_same_across_algorithms(cfg):
    exps = [build(cfg(algorithm=a)) for a in ("pfadapter", "lora", "local")]
    for e in exps[1:]:
        assert e.sampling == exps[0].sampling
        assert all(np.array_equal(x.train_idx, y.train_idx) and np.array_equal(x.test_idx, y.test_idx)
                   for x, y in zip(e.clients, exps[0].clients))
    other = build(cfg(seed="1"))
    assert other.sampling != exps[0].sampling or any(
        not np.array_equal(x.train_idx, y.train_idx) for x, y in zip(other.clients, exps[0].clients))


def test_run_directory_contract(two_runs):
    c, ((out, res), _) = two_runs
    for f in ("config.toml", "metrics.jsonl", "results.json", "results.csv", "accuracy.png"):
        assert (out / f).is_file() and (out / f).stat().st_size > 0, f
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == c.server.rounds + 1
    assert [json.loads(s)["round"] for s in lines] == list(range(c.server.rounds + 1))
    r = json.loads((out / "results.json").read_text())
    assert r["algorithm"] == "pfadapter" and r["rounds"] == c.server.rounds
    assert set(r["gm"]) >= {"accuracy", "f1_macro", "f1_weighted"}
    assert set(r["pm"]) >= {"accuracy", "accuracy_std", "accuracy_min", "f1_macro"}
    assert set(r["communication"]) >= {"up_bytes", "down_bytes", "up_bytes_per_round"}
    last = json.loads(lines[-1])
    assert r["gm"] == last["gm"] and r["pm"] == last["pm"]
    comm = r["communication"]
    ups = [json.loads(s)["up_bytes"] for s in lines[1:]]
    assert comm["up_bytes"] == sum(ups) and comm["up_bytes_per_round"] == sum(ups) / c.server.rounds
    assert 0.0 <= r["pm"]["accuracy_min"] <= r["pm"]["accuracy"] <= 1.0
    assert r["params"]["global"] == r["params"]["private"] > 0
    # cold start: held-out client(s), accuracy at step 0 and after each local epoch
    cs = r["cold_start"]
    assert cs["clients"] == [c.data.num_clients - 1]
    assert cs["epochs"] == [0, 1] and len(cs["accuracy"]) == 2
    assert all(0.0 <= a <= 1.0 for a in cs["accuracy"])
    # the config written is the resolved one, and reloads to the same config
    from fedsplice.federation.validate import load_config

    assert load_config(out / "config.toml") == c
    csv = (out / "results.csv").read_text().splitlines()
    assert len(csv) == 2 and csv[0].startswith("algorithm,rounds,gm.accuracy")


def test_no_cold_start_without_holdout(cfg, tmp_path):
    c = cfg(data__holdout_clients="0", server__rounds=1)
    res = run_experiment(c, tmp_path / "out", quiet=True)
    assert "cold_start" not in res


def test_pm_is_over_all_training_clients(cfg):
    # 3 training clients, 2 sampled per round: PM must still average over all 3
    from fedsplice.federation import metrics

    seen = []
    orig = metrics.summarize_clients

    def spy(per_client):
        seen.append(len(per_client))
        return orig(per_client)

    import fedsplice.federation.evaluation as ev

    mp = pytest.MonkeyPatch()
    mp.setattr(ev, "summarize_clients", spy)
    try:
        exp, records, _ = _run(cfg(server__rounds=1))
    finally:
        mp.undo()
    assert seen == [3, 3] and len(exp.train_ids) == 3


# ----------------------------------------------------------------------------- causal LM, GQA


def test_causal_lm_pfadapter_round_with_gqa_orthogonality(cfg_factory, tiny_llama_dir, toy_jsonl):
    c = cfg_factory(tiny_llama_dir, toy_jsonl, model__task='"causal_lm"', server__rounds=1)
    exp, records, final = _run(c)
    term = exp.recipe.loss_terms[0]
    assert sorted({p.form for p in term.pairs}) == ["column", "row"]
    assert len(term.pairs) == 8
    r = records[1]
    assert r["orthogonality"] > 0  # B's move after the first step, so Lo is live by step 2
    assert math.isfinite(r["train_loss"]) and r["up_bytes"] > 0
    assert sorted(final["global_params"]) == exp.global_names
    assert all("q_proj" in n or "k_proj" in n for n in exp.global_names)
    assert all("v_proj" in n or "o_proj" in n for n in exp.private_names)


def test_fedprox_proximal_term_is_live(cfg):
    exp, records, _ = _run(cfg(algorithm="fedprox", method__mu="1.0", server__rounds=1))
    assert records[1]["proximal"] > 0  # 0 at the first step (θ = θ0), > 0 once θ moved
    assert exp.private_names == []


def test_overwrite_with_disk_store_is_a_fresh_run(cfg, tmp_path):
    c = cfg(runtime__store='"disk"', server__rounds=1)
    out = tmp_path / "run"
    first = run_experiment(c, out, quiet=True)
    second = run_experiment(c, out, overwrite=True, quiet=True)
    for k in ("time_s", "cpu_s", "setup"):
        first.pop(k), second.pop(k)
    assert first == second


def test_every_runtime_and_store_implements_the_spine_protocols(tmp_path):
    """The round loop's `Transport` and the clients' `Store` (fedsplice.federation): each runtime
    and both stores have the methods, the progress display is an `Observer` (not a transport), and
    a store round-trips a state."""
    from fedsplice.app.progress import RunProgress
    from fedsplice.federation import DiskStore, Observer, Store, Transport
    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.flower.transport import FlowerTransport
    from fedsplice.runtimes.workers import Workers

    for cls in (simulation.InProcess, Workers, FlowerTransport):
        assert issubclass(cls, Transport), cls
    assert issubclass(RunProgress, Observer) and not issubclass(RunProgress, Transport)
    assert not issubclass(MemoryStore, Transport) and not issubclass(simulation.InProcess, Store)
    state = {"param/x": torch.arange(3.0)}
    for store in (MemoryStore(), DiskStore(tmp_path / "s")):
        assert isinstance(store, Store)
        assert store.get(7) is None
        store.put(7, state)
        assert store.clients() == [7] and torch.equal(store.get(7)["param/x"], state["param/x"])


def test_client_state_round_trips_the_store_format():
    """ClientState <-> the store's tensor dict: each slot under its prefix, in slot order; an
    unknown key is refused with the slots named."""
    from fedsplice.federation.state import ClientState

    t = {k: torch.full((2,), float(i)) for i, k in enumerate("abcdef")}
    st = ClientState(params={"lora.A": t["a"]}, opt={"lora.A/exp_avg": t["b"]}, ef={"lora.B": t["c"]},
                     switch={"grab/pos": t["d"]}, method={"lora.A": t["e"]})
    flat = st.to_store()
    assert list(flat) == ["param/lora.A", "opt/lora.A/exp_avg", "ef/lora.B", "switch/grab/pos", "method/lora.A"]
    back = ClientState.from_store(flat)
    assert back == st and ClientState.from_store(None) is None
    assert ClientState.from_store({}) == ClientState()
    with pytest.raises(ValueError, match="'momentum/x' is in no slot"):
        ClientState.from_store({**flat, "momentum/x": t["f"]})
    # a checkpoint of an earlier version: the method's slot was "branch/", a switch's state "<switch>/"
    old = ClientState.from_store({"param/lora.A": t["a"], "grab/pos": t["d"], "branch/rank": t["e"]})
    assert old == ClientState(params={"lora.A": t["a"]}, switch={"grab/pos": t["d"]}, method={"rank": t["e"]})


def test_fedprox_keeps_its_reference_in_its_own_state_and_stores_none(cfg):
    """FedProx's θ⁰ is its state during the update (Exchange.receive), not a TrainContext field;
    nothing of it is stored after the round (send clears it)."""
    from fedsplice.algorithms.baselines import FedProxState
    from fedsplice.federation.tasks import OnClient

    exp = build(cfg(algorithm="fedprox", method__mu="1.0", server__rounds=1))
    ex, ops = exp.recipe.exchange, OnClient(exp, 0)
    received = {n: exp.init_params[n] + 1 for n in exp.global_names}
    start, st = ex.receive(ops, 1, received, FedProxState())
    assert start is received and st.ref == received and exp.recipe.state is FedProxState
    up, st2, stats = ex.send(ops, 1, received, st)
    assert up is received and st2 == FedProxState() and stats == {}
    store = MemoryStore()
    simulation.fit_client(exp, store, 0, 1, wire.encode(received))
    assert not [k for k in store.get(0) if k.startswith("method/")]
    assert build(cfg(algorithm="fedprox", method__mu="0.0")).recipe.exchange is None  # μ = 0: FedAvg
