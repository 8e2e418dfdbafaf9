"""A killed Flower run, resumed, gives the outputs of a run that never stopped.

The ServerApp's logic (`server.run_on_grid`) runs over `FakeGrid` (test_flower.py): the real
ClientApp answers every message in this process, each node with its own node config and state
folder. The run is killed inside round 4, after the nodes trained it (their PRIVATE state is two
rounds past the last checkpoint, round 2); the resumed run gets a new Flower run id, finds the
nodes' state by the run key, rolls it back to round 2 on the nodes, and must give metrics.jsonl,
results.json (the "flower" traffic table included) and the nodes' PRIVATE state of an
uninterrupted run, apart from the wall-clock fields. The last test does the same with real
processes: `fedsplice flower up` stopped by Ctrl-C, then `fedsplice resume`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w
import torch
from test_flower import FakeGrid, _ours_alive

from fedsplice.app.cli import main
from fedsplice.app.flower import server
from fedsplice.app.flower.resume import RUN_FILE
from fedsplice.config import to_dict
from fedsplice.federation import DiskStore
from fedsplice.runtimes.flower import client as flower_client
from fedsplice.runtimes.flower import nodestate
from fedsplice.runtimes.flower.transport import FlowerRuntimeError

ROUNDS, KILL = 5, 4  # checkpoints after rounds 2, 4 and 5: the kill in round 4 falls back to round 2


class Killed(BaseException):
    """The ServerApp's process dies (nothing catches it)."""


class KillingGrid(FakeGrid):
    """FakeGrid whose server dies right after the nodes have trained round `kill`."""

    def __init__(self, *a, kill: int, **kw):
        super().__init__(*a, **kw)
        self.kill = kill

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        if any(m.metadata.message_type == "train" and int(m.content.config_records["task"]["round"]) == self.kill
               for m in messages):
            raise Killed()
        return ids


@pytest.fixture
def flower_env(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)
    yield
    flower_client.Node._cached, flower_client.Node._key = None, ()


@pytest.fixture
def cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    return cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds=str(ROUNDS), server__optimizer='"fedadam"',
                       runtime__checkpoint_every="2", runtime__keep_checkpoints="2")


def _grid(cfg, nodes: Path, run_id: int, cls=FakeGrid, **kw) -> FakeGrid:
    grid = cls(tomli_w.dumps(to_dict(cfg)), nodes, 3, **kw)
    for ctx in grid.nodes.values():
        ctx.run_id = run_id  # Flower gives a resumed run a new id
    return grid


def _run(grid, cfg, out: Path, run_id: int, resume: bool = False) -> dict:
    return server.run_on_grid(grid, cfg, out, min_nodes=3, node_wait_s=5, resume=resume, run_id=run_id, poll_s=0.01)


def _records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(s).items() if k != "time_s"}
            for s in (out / "metrics.jsonl").read_text().splitlines()]


def _results(out: Path) -> dict:
    r = json.loads((out / "results.json").read_text())
    r.pop("time_s"), r.pop("cpu_s"), r.pop("setup", None)
    return r


def _private_state(nodes: Path) -> dict[str, bytes]:
    """Every node's live PRIVATE state, by node and client (the run-key folder name left out)."""
    files = sorted(nodes.glob("node-*/run-*/client-*.safetensors"))
    return {f"{f.parts[-3]}/{f.name}": f.read_bytes() for f in files}


def _lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def test_a_killed_flower_run_resumes_to_the_uninterrupted_outputs(cfg, tmp_path, flower_env):
    ref, run = tmp_path / "ref", tmp_path / "run"
    _run(_grid(cfg, tmp_path / "ref-nodes", 7), cfg, ref, 7)
    with pytest.raises(Killed):
        _run(_grid(cfg, tmp_path / "nodes", 7, KillingGrid, kill=KILL), cfg, run, 7)
    key = json.loads((run / RUN_FILE).read_text())["run_key"]
    ahead = sorted(p.name for p in (tmp_path / "nodes").glob(f"node-*/run-{key}/rounds/round-*"))
    assert "round-000004" in ahead and not (run / "checkpoints" / "round-000004").exists()
    assert _records(run)[-1]["round"] == KILL - 1  # round 3 was logged after checkpoint 2

    _run(_grid(cfg, tmp_path / "nodes", 8), cfg, run, 8, resume=True)
    assert _records(run) == _records(ref)
    assert _results(run) == _results(ref)  # GM, PM, cold start, communication and the "flower" table
    assert _results(run)["flower"]["messages"] > 0
    assert _private_state(tmp_path / "nodes") == _private_state(tmp_path / "ref-nodes")
    info = json.loads((run / RUN_FILE).read_text())
    assert info["run_key"] == key and info["starts"] == [{"run_id": 7, "from_round": 0}, {"run_id": 8, "from_round": 2}]
    # the nodes kept the run's state under its key, never under Flower's new run id
    assert not list((tmp_path / "nodes").glob("node-*/run-8")) and not list((tmp_path / "nodes").glob("node-*/run-7"))
    # PRIVATE tensors never left the nodes: not in any message, not in the server's checkpoints
    audit = _lines(run / "wire.jsonl")
    assert {a["kind"] for a in audit} >= {"query", "train", "evaluate"} and all(a["private_hits"] == [] for a in audit)
    assert not list(run.glob("checkpoints/round-*/clients/*"))
    assert [json.loads(s) for s in (run / "events.jsonl").read_text().splitlines()] == []


def test_a_resume_on_nodes_without_the_runs_state_stops(cfg, tmp_path, flower_env):
    run = tmp_path / "run"
    with pytest.raises(Killed):
        _run(_grid(cfg, tmp_path / "nodes", 7, KillingGrid, kill=3), cfg, run, 7)
    with pytest.raises(FlowerRuntimeError, match="could not restore its PRIVATE state to the end of round 2"):
        _run(_grid(cfg, tmp_path / "other-nodes", 8), cfg, run, 8, resume=True)
    assert json.loads((run / RUN_FILE).read_text())["starts"][-1] == {"run_id": 8, "from_round": 2}


def test_node_snapshots_roll_back_and_are_pruned(tmp_path):
    """Client 0 trains in rounds 1, 3, 4; client 1 in round 3 only. Back to round 2: client 0 has
    its round-1 state, client 1 none (fresh); the snapshots of rounds 3 and 4 are gone."""
    store = DiskStore(tmp_path / "run-k")
    for rnd, cid in ((1, 0), (3, 0), (3, 1), (4, 0)):
        store.put(cid, {"param/p": torch.full((2,), float(10 * rnd + cid))})
        flower_client.snapshot(store, cid, rnd)
    flower_client.rollback(store.root, 2)
    assert store.clients() == [0] and store.get(0)["param/p"].tolist() == [10.0, 10.0]
    assert [r for r, _ in nodestate.rounds_kept(store.root)] == [1]
    flower_client.rollback(store.root, 2)  # again (a rollback cut short): the same
    assert store.clients() == [0] and store.get(0)["param/p"].tolist() == [10.0, 10.0]
    # pruning: checkpoints every round, 2 kept; before round 6 those of rounds 4 and 5 are kept, so
    # of the snapshots of rounds <= 4 only each client's newest is needed
    for rnd, cid in ((2, 0), (3, 0), (5, 0)):
        store.put(cid, {"param/p": torch.full((2,), float(rnd))})
        flower_client.snapshot(store, cid, rnd)

    class RT:
        checkpoint_every, keep_checkpoints = 1, 2

    flower_client.prune(store.root, 6, RT, rounds=10)
    assert [r for r, _ in nodestate.rounds_kept(store.root)] == [3, 5]
    flower_client.rollback(store.root, 4)  # the oldest checkpoint kept: client 0 as after round 3
    assert store.get(0)["param/p"].tolist() == [3.0, 3.0]
    flower_client.rollback(store.root, 0)  # a fresh start
    assert store.clients() == [] and nodestate.rounds_kept(store.root) == []


def test_resume_of_a_remote_flower_run_says_how_in_one_line(cfg, tmp_path, capsys):
    from fedsplice.app.runner import resume_experiment
    from fedsplice.errors import ConfigError

    out = tmp_path / "run"
    out.mkdir()
    (out / "config.toml").write_text(tomli_w.dumps(to_dict(cfg)))
    (out / RUN_FILE).write_text(json.dumps({"run_key": "k", "starts": [], "rounds": {}}))
    assert main(["resume", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "remote deployment" in err[0] and "--run-config resume=true" in err[0], err
    with pytest.raises(ConfigError, match="is a Flower run"):  # never resumed in-process (no PRIVATE state)
        resume_experiment(out, quiet=True)


# ----------------------------------------------------------------------------- real processes


def _snapshots(out: Path, rnd: int) -> list[Path]:
    return list((out / "flower" / "nodes").glob(f"node-*/state/run-*/rounds/round-{rnd:06d}"))


@pytest.mark.integration
def test_flower_up_stopped_then_fedsplice_resume_equals_an_uninterrupted_run(cfg_factory, tiny_bert_dir, toy_jsonl,
                                                                             tmp_path):
    """`fedsplice flower up`, Ctrl-C once the nodes trained round 3 (checkpoint: round 2), then
    `fedsplice resume OUT`: a new SuperLink and SuperNodes, the same node folders."""
    from fedsplice.app.flower import launcher

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds="4", runtime__checkpoint_every="2")
    ref = tmp_path / "ref"
    launcher.up(cfg, ref, launcher.Launch(supernodes=3, quiet=True))
    toml = tmp_path / "cfg.toml"
    toml.write_text(tomli_w.dumps(to_dict(cfg)))
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "fedsplice.app.cli", "flower", "up", str(toml), "--out", str(out),
                          "--supernodes", "3", "--quiet"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    t0 = time.monotonic()
    while not _snapshots(out, 3):
        assert p.poll() is None and time.monotonic() - t0 < 300, p.stderr.read() if p.poll() is not None else "timeout"
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=120) == 130, p.stderr.read()
    assert _ours_alive(out / "flower") == []
    assert not (out / "checkpoints" / "round-000004").exists()

    assert main(["resume", str(out), "--quiet"]) == 0
    starts = json.loads((out / RUN_FILE).read_text())["starts"]
    assert [s["from_round"] for s in starts] == [0, 2] and starts[0]["run_id"] != starts[1]["run_id"]
    # Flower's node and run ids are random 64-bit numbers: their varint sizes move each message by a
    # byte or so between ANY two runs (two uninterrupted ones too); every other figure is equal
    slack = 4 * _results(ref)["flower"]["messages"]
    _same(_records(out), _records(ref), slack)
    _same(_results(out), _results(ref), slack)
    assert _ours_alive(out / "flower") == []


def _same(got, want, slack: int, key: str = "") -> None:
    """Equal, except measured Flower bytes (not the payload bytes), which may differ by `slack`."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), key
        for k in want:
            _same(got[k], want[k], slack, k)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), key
        for g, w in zip(got, want):
            _same(g, w, slack, key)
    elif "bytes" in key and "payload" not in key:
        assert abs(got - want) <= slack, (key, got, want)
    else:
        assert got == want, (key, got, want)
