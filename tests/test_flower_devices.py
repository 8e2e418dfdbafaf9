"""Flower on GPUs, checked on a CPU: `fedsplice flower up --devices` puts a device into each
SuperNode's node config (cycled over the nodes), and a node builds its experiment on the device
of its node config (or the run config's runtime.device without one). Bad device names, and
devices this machine lacks, are one-line errors (exit 2) before anything starts.

No process is started here: the launcher's SuperLink, SuperNodes and `flwr run` are replaced by
stand-ins, so only the node configs it writes are read; the node side is the real ClientApp's
`Node`, built in this process from such a node config.
"""

from __future__ import annotations

import json
import tomllib

import pytest
import torch

from fedsplice.app.cli import main
from fedsplice.app.flower import launcher
from fedsplice.errors import ConfigError
from fedsplice.runtimes.flower import client as flower_client

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture
def cfg_file(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    import tomli_w

    from fedsplice.config import to_dict

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl)
    path = tmp_path / "cfg.toml"
    path.write_text(tomli_w.dumps(to_dict(cfg)))
    return cfg, path


@pytest.fixture
def no_processes(monkeypatch):
    """The Cluster writes its node configs as usual but starts nothing; the run stops at `flwr run`."""
    started = []
    monkeypatch.setattr(launcher.Cluster, "start_superlink", lambda self, timeout=90.0: None)
    monkeypatch.setattr(launcher.Cluster, "start_supernode",
                        lambda self, i, node_config, key, name=None: started.append((i, node_config)))

    def run(self, app, on_line, **kw):
        raise launcher.FlowerLaunchError("stopped by the test before `flwr run`")

    monkeypatch.setattr(launcher.Cluster, "run", run)
    return started


def _node(cfg_text: str, node_config: dict, tmp_path):
    from flwr.app import Context, RecordDict

    from fedsplice.runtimes.flower.transport import CONFIG_KEY

    ctx = Context(run_id=7, node_id=1, state=RecordDict(), run_config={CONFIG_KEY: cfg_text},
                  node_config={"state-dir": str(tmp_path / "state"), **node_config})
    try:
        return flower_client.Node(ctx)
    finally:
        flower_client.Node._cached, flower_client.Node._key = None, ()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_devices_reach_each_node_config_and_the_nodes_experiment(cfg_file, tmp_path, no_processes, capsys):
    cfg, path = cfg_file
    out = tmp_path / "run"
    assert main(["flower", "up", str(path), "--devices", "cpu,auto", "--supernodes", "3", "--insecure",
                 "--out", str(out)]) == 2
    assert "stopped by the test" in capsys.readouterr().err
    assert [i for i, _ in no_processes] == [0, 1, 2]
    ncs = [tomllib.loads(p.read_text()) for _, p in no_processes]
    # cycled over the nodes: node p gets devices[p % len(devices)]
    assert [nc["device"] for nc in ncs] == ["cpu", "auto", "cpu"]
    assert [(nc["partition-id"], nc["num-partitions"]) for nc in ncs] == [(0, 3), (1, 3), (2, 3)]
    # `fedsplice resume` starts the nodes on the same devices
    assert json.loads((out / "flower" / "launch.json").read_text())["devices"] == ["cpu", "auto"]
    # the node builds its experiment on its node config's device, whatever the run config says
    import tomli_w

    from fedsplice.config import to_dict

    text = tomli_w.dumps(to_dict(cfg)).replace('device = "auto"', 'device = "cuda:7"')  # a GPU host's config
    assert 'device = "cuda:7"' in text
    node = _node(text, ncs[0], tmp_path)
    assert node.exp.cfg.runtime.device == "cpu" and (node.partition_id, node.num_partitions) == (0, 3)
    assert node.exp.cfg.runtime.precision == cfg.runtime.precision  # precision / dtype: the run config's
    assert node.exp.cfg.model.dtype == cfg.model.dtype
    assert {t.device.type for t in node.exp.init_params.values()} == {"cpu"}


def test_a_node_without_device_uses_the_run_configs(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    import tomli_w

    from fedsplice.config import to_dict

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, runtime__device='"cpu"')
    node = _node(tomli_w.dumps(to_dict(cfg)), {"partition-id": 1, "num-partitions": 3}, tmp_path)
    assert node.exp.cfg.runtime.device == "cpu"


def test_no_devices_puts_no_device_in_the_node_configs(cfg_factory, tiny_bert_dir, toy_jsonl):
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl)
    assert launcher.node_devices(cfg, None, 3) == []
    assert launcher.node_entries(3, [], []) == [{}, {}, {}]
    # runtime.devices (the simulation's per-worker devices) pins the SuperNodes the same way
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, runtime__devices='["cpu", "auto"]')
    assert launcher.node_devices(cfg, None, 3) == ["cpu", "auto", "cpu"]
    assert launcher.node_entries(2, ["csv:a.csv"], ["cpu", "cpu"]) == [{"data-path": "csv:a.csv", "device": "cpu"},
                                                                       {"device": "cpu"}]


@pytest.mark.parametrize("node_device, match", [
    ("gpu0", r"^node config device = 'gpu0': use 'auto'"),
    pytest.param("cuda:0", r"^node config device = 'cuda:0': this machine has no CUDA device",
                 marks=pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")),
])
def test_a_node_config_device_this_machine_lacks_fails_on_the_node(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path,
                                                                   node_device, match):
    import tomli_w

    from fedsplice.config import to_dict

    text = tomli_w.dumps(to_dict(cfg_factory(tiny_bert_dir, toy_jsonl)))
    with pytest.raises(ConfigError, match=match) as e:
        _node(text, {"partition-id": 0, "num-partitions": 3, "device": node_device}, tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_devices_cuda_on_a_cpu_machine_exits_2_with_one_line(cfg_file, tmp_path, capsys):
    _, path = cfg_file
    out = tmp_path / "run"
    assert main(["flower", "up", str(path), "--devices", "cuda:0,cuda:1", "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert "--devices = 'cuda:0'" in line and "no CUDA device" in line, line
    assert not out.exists()  # nothing started, no run directory


@pytest.mark.parametrize("devices, says", [
    ("cpu,,cpu", "an empty device name"),
    ("", "an empty device name"),
    ("cuda:0 cuda:1", "--devices = 'cuda:0 cuda:1': use 'auto'"),
    ("gpu:0", "--devices = 'gpu:0': use 'auto'"),
    ("cuda:-1", "--devices = 'cuda:-1': use 'auto'"),
])
def test_a_malformed_devices_list_exits_2_with_one_line(cfg_file, tmp_path, capsys, devices, says):
    _, path = cfg_file
    out = tmp_path / "run"
    assert main(["flower", "up", str(path), "--devices", devices, "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert says in line and "--devices" in line, line
    assert not out.exists()


@pytest.mark.skipif(not NO_CUDA, reason="this machine has CUDA")
def test_runtime_device_cuda_on_a_cpu_machine_exits_2_before_flower_starts(cfg_file, tmp_path, capsys):
    """The ServerApp of `flower up` runs here too, on runtime.device: checked before anything starts."""
    _, path = cfg_file
    out = tmp_path / "run"
    assert main(["flower", "up", str(path), "--set", "runtime.device=cuda", "--devices", "cpu", "--out", str(out)]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("fedsplice: error: runtime.device = 'cuda'") and "no CUDA device" in line, line
    assert not out.exists()


def test_the_server_learns_each_nodes_device_from_the_query(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path,
                                                            monkeypatch):
    """The query reply carries the node config's device; the ServerApp prints it with the partition."""
    import tomli_w
    from flwr.supercore.task_identity import TaskIdentity
    from test_flower import FakeGrid

    from fedsplice.config import to_dict
    from fedsplice.federation import build
    from fedsplice.runtimes.flower.transport import FlowerTransport, JsonLog

    for k, v in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl)
    grid = FakeGrid(tomli_w.dumps(to_dict(cfg)), tmp_path, 3)
    nids = sorted(grid.nodes)
    grid.nodes[nids[0]].node_config["device"] = "cpu"  # node 1 and 2: runtime.device
    said: list[str] = []
    t = FlowerTransport(grid, build(cfg), events=JsonLog(tmp_path / "events.jsonl"),
                        audit=JsonLog(tmp_path / "wire.jsonl"), min_nodes=3, say=said.append, poll_s=0.01)
    t._connect()  # what the transport's first call does: ask every node for its partition (and device)
    lines = [s for s in said if "partition" in s]
    assert len(lines) == 3 and lines[0].endswith(" on cpu") and not any(" on " in s for s in lines[1:]), lines
