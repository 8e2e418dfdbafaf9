"""HetLoRA (algorithms/hetlora.py): truncation, the tail norm and the sparsity weights on
hand-computed tensors; then a tiny run: each client trains at its own rank (the zero tail stays
exactly zero), prunes when its tail shrank, and the server's aggregate is the sparsity-weighted
sum of the zero-padded uploads; bad parameters."""

import math

import pytest
import torch

from fedsplice.algorithms import hetlora as H
from fedsplice.core import wire
from fedsplice.core.server import own_weights
from fedsplice.federation import tasks
from fedsplice.federation.experiment import build
from fedsplice.federation.store import MemoryStore
from fedsplice.runtimes.inprocess import run_rounds

HET = dict(algorithm='"hetlora"', method="{r_min = 1, ranks = [1, 3, 4, 2]}")  # tiny peft.r = 4
PAIRS = {"m.lora_A.default.weight": "m.lora_B.default.weight"}


def _adapter():
    a = torch.tensor([[1.0, 2.0], [0.0, 3.0], [4.0, 0.0]])  # r = 3, d_in = 2
    b = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0]])  # d_out = 2
    return {"m.lora_A.default.weight": a, "m.lora_B.default.weight": b, "head.weight": torch.ones(2)}


def test_truncate_and_tail_norm_by_hand():
    t = H.truncate(_adapter(), PAIRS, 2)
    assert t["m.lora_A.default.weight"].tolist() == [[1, 2], [0, 3], [0, 0]]
    assert t["m.lora_B.default.weight"].tolist() == [[1, 0, 0], [0, 1, 0]]
    assert torch.equal(t["head.weight"], torch.ones(2)) and _adapter()["m.lora_A.default.weight"][2, 0] == 4
    # r = 3, gamma 0.5: T = [1, 3): ||B[:, 1:3]|| = sqrt(0+2^2+1+1) = sqrt(6), ||A[1:3]|| = sqrt(9+16) = 5
    assert float(H.tail_norm(_adapter(), PAIRS, 3, 0.5)) == pytest.approx(5 * math.sqrt(6))
    # gamma 0.99 at r = 2: T = {1}: ||B[:, 1]|| = 1, ||A[1]|| = 3
    assert float(H.tail_norm(_adapter(), PAIRS, 2, 0.99)) == pytest.approx(3.0)


def test_sparsity_weights_by_hand():
    """Each client reports ‖B_k A_k‖_F for its A and B ("weight/<tensor>" statistics); the server
    normalizes them over the round (core.server.own_weights)."""
    u1 = _adapter()
    u2 = {k: 2 * v for k, v in u1.items()}  # B A four times as large
    u0 = {k: torch.zeros_like(v) for k, v in u1.items()}
    ba = torch.tensor([[9.0, 2.0], [4.0, 3.0]])  # B A of _adapter by hand
    assert H.sparsity_weights(u1, PAIRS) == {"weight/m.lora_A.default.weight": pytest.approx(float(ba.norm())),
                                             "weight/m.lora_B.default.weight": pytest.approx(float(ba.norm()))}
    w = own_weights([H.sparsity_weights(u, PAIRS) for u in (u1, u2, u0)])
    assert w["m.lora_A.default.weight"] == w["m.lora_B.default.weight"] == pytest.approx([0.2, 0.8, 0.0])
    assert "head.weight" not in w  # left to the sample-size weights
    assert own_weights([H.sparsity_weights(u0, PAIRS)] * 2)["m.lora_A.default.weight"] == [0.5, 0.5]  # all zero


def test_clients_train_at_their_ranks_and_the_server_weighs_by_norm(tiny_cfg, capture_uploads):
    n_train = len(build(tiny_cfg(**HET)).train_ids)
    exp = build(tiny_cfg(**HET, server__rounds=1, server__clients_per_round=n_train))
    pairs = H.pairs_of(exp.model.param_infos())
    assert pairs and sorted([*pairs, *pairs.values()]) == exp.global_names and not exp.private_names
    store = MemoryStore()
    state = run_rounds(exp, store, lambda r: None)
    g0 = {n: exp.init_params[n] for n in exp.global_names}
    ups = []
    for _, cid, up in capture_uploads:
        u = wire.decode(up)
        rank = int(store.get(cid)["method/rank"])
        start = [1, 3, 4, 2][cid % 4]  # method.ranks, cycled by client id
        assert rank in (start, max(1, math.floor(0.99 * start)))  # pruned at most once
        for a, b in pairs.items():  # the ranks beyond the client's are exactly zero; its own trained
            assert not u[a][rank:].any() and not u[b][:, rank:].any()
            assert not torch.equal(u[b][:, :rank], g0[b][:, :rank])
        ups.append(u)
    w = own_weights([H.sparsity_weights(u, pairs) for u in ups])
    for name in exp.global_names:
        want = sum(wk * u[name].double() for wk, u in zip(w[name], ups))
        assert torch.allclose(state["global_params"][name].double(), want, atol=1e-6), name


def test_pruning_rule(tiny_cfg, monkeypatch):
    """A client prunes one rank (gamma = 0.99) exactly when its trained tail norm fell below the
    received one; with prune = false it never does."""
    exp = build(tiny_cfg(**HET))
    ex = exp.recipe.exchange
    ops = tasks.OnClient(exp, exp.train_ids[0])
    received = {n: torch.randn_like(exp.init_params[n]) for n in exp.global_names}
    start, slot = ex.receive(ops, 1, received, H.HetLoRAState(rank=3))
    pairs = H.pairs_of(exp.model.param_infos())
    assert slot.tail_before == pytest.approx(float(H.tail_norm(start, pairs, 3, 0.99)))
    shrunk = {n: t * 0.5 for n, t in start.items()}
    sent, kept, stats = ex.send(ops, 1, shrunk, slot)
    assert kept == H.HetLoRAState(rank=2) and stats == {"rank": 2.0, **H.sparsity_weights(sent, pairs)}
    assert all(not sent[a][2:].any() and torch.equal(sent[a][:2], shrunk[a][:2]) for a in pairs)
    grown = {n: t * 2.0 for n, t in start.items()}
    assert ex.send(ops, 1, grown, slot)[1].rank == 3
    fixed = build(tiny_cfg(algorithm='"hetlora"', method="{ranks = [3], prune = false}")).recipe.exchange
    assert fixed.send(ops, 1, shrunk, slot)[1].rank == 3


@pytest.mark.parametrize("sets,match", [
    (["method.ranks=[2, 9]"], "method.r_min and method.ranks must be <= peft.r = 4"),
    (["method.gamma=1.0"], "method.gamma must be in (0, 1)"),
    (["server.aggregation=\"median\""], "set server.aggregation = 'mean'"),
    (["peft.type=\"prompt\""], "algorithm 'hetlora' gives each client a LoRA rank of its own: set peft.type"),
    # another method with this [method] table: the line says whose settings they are
    (["algorithm=\"pfedlora\""], "(a setting of algorithm 'hetlora': switching algorithms with --set? add"),
])
def test_bad_parameters_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(**HET), sets, match)


def test_a_whole_run_with_a_held_out_client(tiny_cfg, tmp_path):
    """The runner's stages around the rounds: the held-out client trains at a rank of its own
    (its ranks beyond are zero after cold start), and the slot's rank is not a moved tensor."""
    import fedsplice

    cfg = tiny_cfg(**HET, server__rounds=1, data__holdout_clients=1, eval__cold_start_epochs=1)
    res = fedsplice.run(cfg, tmp_path / "run")
    assert len(res.cold_start["accuracy"]) == 2 and res.raw["movement"]["branch"] is None
    exp = build(cfg)
    cid = exp.holdout_ids[0]
    tasks.cold_start(exp, MemoryStore(), cid, {n: exp.init_params[n] for n in exp.global_names})
    rank = [1, 3, 4, 2][cid % 4]
    trained = exp.model.trainable()
    assert all(not trained[a][rank:].any() and trained[b][:, :rank].any()
               for a, b in H.pairs_of(exp.model.param_infos()).items())


def test_the_state_is_typed_where_used_and_flat_where_stored():
    """HetLoRA's state (an int rank, a float) round-trips exactly through the store's flat tensors;
    a state type fedsplice cannot store is refused by name."""
    import dataclasses

    from fedsplice.algorithms import state as ST

    st = H.HetLoRAState(rank=7, tail_before=0.1 + 0.2)
    flat = ST.pack(st)
    assert flat["rank"].dtype == torch.int64 and flat["tail_before"].dtype == torch.float64
    back = ST.unpack(H.HetLoRAState, flat)
    assert back == st and type(back.rank) is int and back.tail_before == 0.1 + 0.2
    assert ST.unpack(H.HetLoRAState, {}) == ST.fresh(H.HetLoRAState) == H.HetLoRAState()

    @dataclasses.dataclass
    class Mixed:
        on: bool = False
        kept: dict = dataclasses.field(default_factory=dict)
        t: torch.Tensor | None = None

    m = Mixed(True, {"a": torch.ones(2)}, torch.zeros(3))
    assert sorted(ST.pack(m)) == ["kept/a", "on", "t"]
    back = ST.unpack(Mixed, ST.pack(m))
    assert back.on is True and torch.equal(back.kept["a"], m.kept["a"]) and torch.equal(back.t, m.t)
    assert ST.unpack(dict, {"x": torch.ones(1)}).keys() == {"x"}  # a method without a state type
    # a key of no field: the layout before typed states (FedPuReL's branch tensors at the top) where
    # the state has one dict field, else an error naming it
    old = ST.unpack(Mixed, {"prompt.ctx": torch.ones(2), "on": torch.tensor(True)})
    assert old.on is True and list(old.kept) == ["prompt.ctx"]
    with pytest.raises(ValueError, match=r"method state keys \['lost'\] are no field of HetLoRAState"):
        ST.unpack(H.HetLoRAState, {"rank": torch.tensor(3), "lost": torch.ones(1)})

    @dataclasses.dataclass
    class Bad:
        names: list = dataclasses.field(default_factory=list)

    with pytest.raises(TypeError, match="method state field 'names': its default must be"):
        ST.check(Bad)
    import numpy as np

    assert ST.pack(H.HetLoRAState(rank=np.int64(4)))["rank"].dtype == torch.int64  # a numpy integer is an int
    with pytest.raises(TypeError, match="method state field 'rank' holds str"):
        ST.pack(H.HetLoRAState(rank="4"))


def test_own_weights_stay_out_of_the_round_record_and_are_refused_where_unusable(tiny_cfg, tmp_path):
    """The sparsity weights travel as statistics but are not statistics: the round record keeps
    the rank, not them. A method that reports weights where the server cannot use them (DP-FedAvg,
    SecAgg+, a robust mean) meets one line at the round, should its check_config let it through."""
    import json
    from types import SimpleNamespace

    import fedsplice
    from fedsplice.errors import ConfigError
    from fedsplice.federation.rounds import weights_of

    fedsplice.run(tiny_cfg(**HET, server__rounds=1), tmp_path / "run")
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[1])
    assert "rank" in rec and not [k for k in rec if k.startswith("weight/")]
    up = (SimpleNamespace(stats={"weight/a": 1.0}), {})
    for privacy, aggregation in (({"enabled": True}, "mean"), ({"secure_aggregation": True}, "mean"), ({}, "median")):
        p = SimpleNamespace(**{"enabled": False, "secure_aggregation": False, **privacy})
        exp = SimpleNamespace(cfg=SimpleNamespace(privacy=p, server=SimpleNamespace(aggregation=aggregation),
                                                  algorithm="mine"))
        with pytest.raises(ConfigError, match="algorithm 'mine' weighs its uploads itself"):
            weights_of(exp, [up])
