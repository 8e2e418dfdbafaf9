"""Per-site data on Flower (data.dataset = "sites"): three SuperNodes each bring their own file,
nothing is partitioned, and the ServerApp's side never opens a site's file — checked by an audit
hook that records every file the process opens, and who (a node, or the server) was running."""

from __future__ import annotations

import csv
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import tomli_w
from test_flower import FakeGrid

from fedsplice.app.runner import run_experiment
from fedsplice.config import to_dict
from fedsplice.errors import ConfigError
from fedsplice.federation.evaluation import pooled_gm
from fedsplice.runtimes.flower import client as flower_client
from fedsplice.runtimes.flower.transport import FlowerTransport, JsonLog

LABELS = ["art", "food", "law"]
OPENED: list[tuple[str, object]] = []  # (path, who): who = a node's partition id, or None (the server)
WHO: list = [None]


def _hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)) and "site" in str(args[0]):
        OPENED.append((str(args[0]), WHO[0]))


sys.addaudithook(_hook)  # audit hooks cannot be removed; this one only records paths holding "site"


def write_site(path, skew: int, n: int = 24):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        for i in range(n):
            lab = LABELS[(skew if i % 3 else i) % 3]
            w.writerow([lab, f"site {skew} says {lab} number {i}"])
    return path


def _run(cfg, tmp_path, monkeypatch, sites):
    from flwr.supercore.task_identity import TaskIdentity

    for k, v in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)
    grid = FakeGrid(tomli_w.dumps(to_dict(cfg)), tmp_path, 3)
    for i, nid in enumerate(sorted(grid.nodes)):
        grid.nodes[nid].node_config["data-path"] = f"csv:{sites[i]}"
    real = flower_client.client_app

    def as_node(message, context):
        WHO[0] = context.node_config["partition-id"]
        try:
            return real(message=message, context=context)
        finally:
            WHO[0] = None
    monkeypatch.setattr(flower_client, "client_app", as_node)

    def make_transport(exp, store):
        return FlowerTransport(grid, exp, events=JsonLog(tmp_path / "events.jsonl"),
                               audit=JsonLog(tmp_path / "wire.jsonl"), min_nodes=3, say=lambda s: None, poll_s=0.01)
    OPENED.clear()
    try:
        return run_experiment(cfg, tmp_path / "out", quiet=True, make_transport=make_transport)
    finally:
        flower_client.Node._cached, flower_client.Node._key = None, ()


@pytest.fixture
def site_cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    def make(**kw):
        sets = dict(data__dataset='"sites"', data__labels=LABELS, data__num_clients=3, data__holdout_clients=0,
                    server__clients_per_round=2, runtime__kind='"flower"')
        return cfg_factory(tiny_bert_dir, toy_jsonl, **{**sets, **kw})
    return make


@pytest.mark.parametrize("server_file", [False, True])
def test_three_sites_own_files_never_opened_by_the_server(site_cfg, tmp_path, monkeypatch, server_file):
    sites = [write_site(tmp_path / f"site{i}" / "data.csv", i) for i in range(3)]
    extra = {}
    if server_file:
        extra["data__test"] = json.dumps(f"csv:{write_site(tmp_path / 'server' / 'eval-site.csv', 0, 9)}")
    res = _run(site_cfg(**extra), tmp_path, monkeypatch, sites)
    site_opens = [(p, who) for p, who in OPENED if "/site" in p and p.endswith("data.csv")]
    assert site_opens, "the audit saw no site file opened at all"
    for path, who in site_opens:  # every site file is opened only by its own node
        assert who is not None and path == str(sites[who]), (path, who)
    # local test: min(local_test_size = 6, 24 // 2) carved rows per site
    if server_file:
        assert res["data"]["global_test_size"] == 9 and res["data"]["split"].startswith("per site; the server's")
        assert "fewer than 10 samples in 3 of 3 classes" in res["data"]["warnings"][0]
        assert "evaluated_on" not in res["gm"]
        assert any(who is None and p.endswith("eval-site.csv") for p, who in OPENED)  # the server's own
    else:
        assert res["gm"]["evaluated_on"] == "sites" and res["gm"]["test_size"] == 18
        assert res["data"]["global_test_size"] == 0 and res["train_counts"] is None
    assert 0.0 <= res["gm"]["accuracy"] <= 1.0 and 0.0 <= res["pm"]["accuracy"] <= 1.0
    wire_log = [json.loads(x) for x in (tmp_path / "wire.jsonl").read_text().splitlines()]
    assert all(a["private_hits"] == [] for a in wire_log)


def test_site_label_outside_data_labels_fails_on_the_node(site_cfg, tmp_path, monkeypatch):
    sites = [write_site(tmp_path / f"site{i}" / "data.csv", i) for i in range(3)]
    with open(sites[1], "a") as f:
        f.write("music,a song\n")
    with pytest.raises(Exception, match=r"label\(s\) \['music'\] not in data.labels"):
        _run(site_cfg(), tmp_path, monkeypatch, sites)


def test_sites_config_checks(site_cfg, tmp_path):
    with pytest.raises(ConfigError, match="data.labels = \\[\\]: per-site data"):
        site_cfg(data__labels=[])
    with pytest.raises(ConfigError, match="so it runs on Flower"):
        run_experiment(site_cfg(runtime__kind='"simulation"'), tmp_path / "sim", quiet=True)
    with pytest.raises(ConfigError, match=r"\[scenario\] is for one data set"):
        site_cfg(scenario__noise_std=0.1)
    with pytest.raises(ConfigError, match="data.imbalance: the long-tail cut"):
        site_cfg(data__imbalance=10.0)


def test_pooled_gm_from_confusion_counts():
    exp = SimpleNamespace(caches={"train_counts": None}, data=SimpleNamespace(class_names=["a", "b"]),
                          cfg=SimpleNamespace(eval=None))
    per = [{"confusion": [[2, 1], [0, 1]], "zs_class_correct": None},
           {"confusion": [[1, 0], [1, 3]], "zs_class_correct": None}]
    gm = pooled_gm(exp, per)  # pooled [[3, 1], [1, 4]]: F1 = 6/8 and 8/10
    assert gm["accuracy"] == pytest.approx(7 / 9)
    assert gm["f1_macro"] == pytest.approx((0.75 + 0.8) / 2)
    assert gm["f1_weighted"] == pytest.approx((0.75 * 4 + 0.8 * 5) / 9)
    assert gm["auc"] is None and gm["test_size"] == 9
    assert gm["class_accuracy"] == [0.75, 0.8]
    assert np.isfinite(gm["f1_macro"])
