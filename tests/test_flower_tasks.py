"""Every client-side stage runs where the client's data is: on Flower, FedPuReL's phase 2 and the
held-out clients' cold start are client tasks on the SuperNodes, never work of the ServerApp."""

from __future__ import annotations

import json

import pytest
import tomli_w
from test_flower import FakeGrid

from fedsplice.app.runner import run_experiment
from fedsplice.config import to_dict
from fedsplice.federation import fitting, tasks
from fedsplice.runtimes.flower import client as flower_client
from fedsplice.runtimes.flower.transport import FlowerTransport, JsonLog


@pytest.fixture
def purel_cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    return cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"fedpurel"', method__personal_rounds=1)


def _flower_run(cfg, tmp_path, monkeypatch):
    """run_experiment with a FlowerTransport over FakeGrid (the real ClientApp, in this process);
    returns (results, the server's Experiment, [(task, id(exp), cid)] of every client-task call)."""
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)
    calls = []
    for name in ("fit", "evaluate", "personalize", "cold_start"):
        mod = fitting if name == "fit" else tasks
        orig = getattr(mod, name)

        def spy(exp, store, cid, *a, _o=orig, _n=name):
            calls.append((_n, id(exp), cid))
            return _o(exp, store, cid, *a)

        if name in tasks.RUN:
            monkeypatch.setitem(tasks.RUN, name, spy)
        monkeypatch.setattr(mod, name, spy)
    monkeypatch.setattr(flower_client, "fit_client", fitting.fit)
    server = {}
    grid = FakeGrid(tomli_w.dumps(to_dict(cfg)), tmp_path, 3)

    def make_transport(exp, store):
        server["exp"] = exp
        return FlowerTransport(grid, exp, events=JsonLog(tmp_path / "events.jsonl"),
                               audit=JsonLog(tmp_path / "wire.jsonl"), min_nodes=3, say=lambda s: None, poll_s=0.01)

    try:
        res = run_experiment(cfg, tmp_path / "fl", quiet=True, make_transport=make_transport)
    finally:
        flower_client.Node._cached, flower_client.Node._key = None, ()
    return res, server["exp"], calls


def test_phase2_and_cold_start_run_on_the_nodes_and_equal_the_simulation(purel_cfg, tmp_path, monkeypatch):
    sim = run_experiment(purel_cfg, tmp_path / "sim", quiet=True)
    fl, server_exp, calls = _flower_run(purel_cfg, tmp_path, monkeypatch)
    # the ServerApp's experiment never ran a client task: every call came from a node's own build
    assert calls and all(e != id(server_exp) for _, e, _ in calls)
    assert sorted(c for t, _, c in calls if t == "personalize") == server_exp.train_ids
    assert sorted(c for t, _, c in calls if t == "cold_start") == server_exp.holdout_ids
    # the same numbers as the in-process runtime: GM, PM after phase 2, the cold-start curve
    for key in ("gm", "pm", "cold_start", "zero_shot_gm"):
        assert fl[key] == sim[key], key
    recs = [json.loads(x) for x in (tmp_path / "fl" / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["phase"] == "personalization" and recs[-1]["pm"] == sim["pm"]
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert not any(e["event"] == "personalization_on_server" for e in events)


def test_phase2_messages_carry_only_global_tensors_down_and_metrics_up(purel_cfg, tmp_path, monkeypatch):
    _, exp, _ = _flower_run(purel_cfg, tmp_path, monkeypatch)
    audit = [json.loads(x) for x in (tmp_path / "wire.jsonl").read_text().splitlines()]
    kinds = {(a["dir"], a["kind"]) for a in audit}
    assert {(d, k) for d in ("down", "up") for k in ("train.personalize", "train.cold_start")} <= kinds
    for a in audit:
        assert a["private_hits"] == [], a
        if a["kind"] in ("train.personalize", "train.cold_start"):
            if a["dir"] == "down":
                assert a["arrays"] == {"global": sorted(exp.global_names)}
            else:
                assert a["arrays"] == {} and a["bytes"] > 0  # only the task's metrics, as JSON
    down = [a for a in audit if a["kind"] == "train.personalize" and a["dir"] == "down"]
    assert sorted(c for a in down for c in a["cids"]) == exp.train_ids
    cold = [a for a in audit if a["kind"] == "train.cold_start" and a["dir"] == "down"]
    assert [c for a in cold for c in a["cids"]] == exp.holdout_ids


def test_a_node_refuses_a_task_for_a_client_it_does_not_hold(purel_cfg, tmp_path, monkeypatch):
    from flwr.app import Context, RecordDict

    from fedsplice.runtimes.flower.transport import CONFIG_KEY

    ctx = Context(run_id=7, node_id=1, state=RecordDict(), run_config={CONFIG_KEY: tomli_w.dumps(to_dict(purel_cfg))},
                  node_config={"partition-id": 0, "num-partitions": 3, "state-dir": str(tmp_path / "n0")})
    try:
        node = flower_client.Node.get(ctx)
        with pytest.raises(ValueError, match="not served by this node for cold_start"):
            node.check([0], "cold_start")  # a training client, not a held-out one
        with pytest.raises(ValueError, match="not served by this node for personalize"):
            node.check([1], "personalize")  # cid 1 belongs to partition 1
        node.check([3], "cold_start")  # the held-out client of partition 0
    finally:
        flower_client.Node._cached, flower_client.Node._key = None, ()
