"""The Flower runtime on a real local deployment: a SuperLink and 3 SuperNodes as separate
processes on 127.0.0.1, TLS with certificates made by `cryptography`, SuperNode authentication
on, tiny BERT on the toy data set.

- PFAdapter and FedAvg-LoRA, 2 rounds each: every round's GM/PM metrics, clients and losses are
  exactly the simulation runtime's for the same seed (same code, same data order, same seeds,
  one torch thread on both sides: nothing is allowed to differ);
- PFAdapter uploads about half of FedAvg-LoRA's bytes, measured on the serialized Flower messages;
  the Flower figure is the simulation's safetensors payload plus a stated envelope;
- the wire audit reads the real messages (every ArrayRecord's names, and a byte scan of every
  serialized message for every PRIVATE name); PRIVATE state stays in the SuperNodes' stores;
- an unregistered SuperNode key is refused, a SuperNode killed mid-run does not stop the run,
  and no process outlives a run.
"""

from __future__ import annotations

import hashlib
import json
import signal
import time
from pathlib import Path

import flwr  # noqa: F401  a pinned test dependency: a broken install must fail here, not skip
import psutil
import pytest
from safetensors.torch import load_file

from fedsplice.app.flower import launcher
from fedsplice.app.runner import run_experiment
from fedsplice.core import wire
from fedsplice.federation.experiment import build
from fedsplice.runtimes.flower import certs
from fedsplice.runtimes.flower.records import RecordError, decode, from_record, to_record, weigh

SUPERNODES = 3  # = the 3 training clients of the tiny budget: one client per SuperNode


def _records(out: Path) -> list[dict]:
    return [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]


def _lines(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def _ours_alive(cl_root: Path) -> list[str]:
    """Processes (not zombies) whose command line or environment mentions this run's folder."""
    needle = str(cl_root)
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == psutil.Process().pid or p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = p.cmdline()
            if any(needle in a for a in cmdline) or any(needle in v for v in p.environ().values()):
                found.append(f"{p.pid}: {' '.join(cmdline)[:120]!r}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.fixture(scope="module")
def runs(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path_factory):
    """For each algorithm: the simulation run and the Flower run of the same config (PM one client
    at a time, as each SuperNode scores its own: equal bit for bit)."""
    out = {}
    for algo in ("pfadapter", "lora"):
        kw = {} if algo == "pfadapter" else {"algorithm": '"lora"'}
        cfg = cfg_factory(tiny_bert_dir, toy_jsonl, runtime__batch_eval='"off"', **kw)
        sim = tmp_path_factory.mktemp(f"sim-{algo}")
        run_experiment(cfg, sim, overwrite=True, quiet=True)
        fl = tmp_path_factory.mktemp(f"flower-{algo}")
        t0 = time.monotonic()
        res = launcher.up(cfg, fl, launcher.Launch(supernodes=SUPERNODES, overwrite=True, quiet=True))
        out[algo] = {"cfg": cfg, "sim": sim, "flower": fl, "results": res, "time_s": time.monotonic() - t0}
    return out


@pytest.mark.parametrize("algo", ["pfadapter", "lora"])
@pytest.mark.integration
def test_flower_metrics_equal_the_simulation(runs, algo):
    r = runs[algo]
    sim, fl = _records(r["sim"]), _records(r["flower"])
    assert [x["round"] for x in fl] == [x["round"] for x in sim] == [0, 1, 2]
    for a, b in zip(sim, fl):
        assert b["gm"] == a["gm"], a["round"]
        assert b["pm"] == a["pm"], a["round"]
        for k in ("clients", "train_loss", "orthogonality", "dropped", "late", "rejected"):
            assert b.get(k) == a.get(k), (a["round"], k)
    res = r["results"]
    assert res["gm"] == json.loads((r["sim"] / "results.json").read_text())["gm"]
    assert res["flower"]["supernodes"] == SUPERNODES and res["flower"]["events"] == 0
    # the same run directory as `fedsplice run`
    for f in ("config.toml", "metrics.jsonl", "results.json", "results.csv", "accuracy.png"):
        assert (r["flower"] / f).is_file(), f
    assert "kind = \"flower\"" in (r["flower"] / "config.toml").read_text()


@pytest.mark.integration
def test_pfadapter_uploads_half_of_fedavg_lora(runs):
    payload = {}
    for algo, r in runs.items():
        exp = build(r["cfg"])
        payload[algo] = len(wire.encode({n: exp.init_params[n] for n in exp.global_names}))
        uploads = r["cfg"].server.rounds * r["cfg"].server.clients_per_round
        # the tensors inside the Flower messages are exactly these payloads, upload by upload
        assert r["results"]["flower"]["up_payload_bytes"] == uploads * payload[algo]
    ratio = payload["pfadapter"] / payload["lora"]
    assert 0.45 <= ratio <= 0.55, (payload, ratio)  # the paper's claim: about half


@pytest.mark.parametrize("algo", ["pfadapter", "lora"])
@pytest.mark.integration
def test_flower_bytes_are_the_payload_plus_a_stated_envelope(runs, algo):
    """Per client upload: Flower bytes = the simulation's safetensors payload + envelope. The
    envelope per tensor (npy header, Array + ArrayChunk objects and their 64-hex ids) replaces
    safetensors' per-tensor header, and one result record per message carries the statistics
    and a data fingerprint. docs/flower.md states the measured figures."""
    r = runs[algo]
    sim = json.loads((r["sim"] / "results.json").read_text())["communication"]
    fl = r["results"]["communication"]
    f = r["results"]["flower"]
    assert f["up_payload_bytes"] == sim["up_bytes"]  # the very same tensors, per client
    uploads = r["cfg"].server.rounds * r["cfg"].server.clients_per_round
    tensors = f["uploaded_tensors"] / uploads
    per_upload = (fl["up_bytes"] - sim["up_bytes"]) / uploads
    assert 450 * tensors <= per_upload <= 600 * tensors + 4000, (per_upload, tensors)
    # one client per SuperNode here, so each sampled client gets its own broadcast, as in simulation
    per_download = (fl["down_bytes"] - sim["down_bytes"]) / uploads
    assert 450 * tensors <= per_download <= 600 * tensors + 4000, (per_download, tensors)


@pytest.mark.parametrize("algo", ["pfadapter", "lora"])
@pytest.mark.integration
def test_wire_audit_of_the_real_messages(runs, algo):
    r = runs[algo]
    exp = build(r["cfg"])
    glob, private = set(exp.global_names), set(exp.private_names)
    if algo == "pfadapter":
        assert len(private) == len(glob) > 0
    audit = _lines(r["flower"] / "wire.jsonl")
    # the held-out client's cold start is a client task too: Flower's "train.cold_start" type
    assert {(m["dir"], m["kind"]) for m in audit} == {
        (d, k) for d in ("down", "up") for k in ("query", "train", "evaluate", "train.cold_start")}
    ups = [m for m in audit if m["dir"] == "up" and m["kind"] == "train"]
    downs = [m for m in audit if m["dir"] == "down" and m["kind"] in ("train", "evaluate", "train.cold_start")]
    assert len(ups) == r["cfg"].server.rounds * r["cfg"].server.clients_per_round  # one client per node
    for m in audit:
        assert m["private_hits"] == [], m  # no PRIVATE name anywhere in the serialized bytes
        for names in m["arrays"].values():
            assert set(names) <= glob and not set(names) & private
    for m in ups:
        assert m["arrays"] == {f"up.{m['cids'][0]}": sorted(glob)}
        assert m["global_hits"] == len(glob)  # the byte scan does see names: GLOBAL ones are there
    for m in downs:
        assert m["arrays"] == {"global": sorted(glob)}
    # PRIVATE tensors and their optimizer state stayed on the SuperNodes, per client
    states = sorted((r["flower"] / "flower" / "nodes").glob("node-*/state/run-*/client-*.safetensors"))
    trained = {c for ids in exp.sampling for c in ids}
    assert len(states) == len(trained)
    for path in states:
        st = load_file(str(path))
        if private:
            assert {k[len("param/"):] for k in st if k.startswith("param/")} == private
        assert not {k for k in st if k.startswith("param/")} & glob
    assert not (r["flower"] / "client_state").exists() or not any((r["flower"] / "client_state").iterdir())


@pytest.mark.parametrize("algo", ["pfadapter", "lora"])
@pytest.mark.integration
def test_the_sites_ledgers_match_the_servers_view(runs, algo, capsys):
    from fedsplice.app.cli import main

    fl = runs[algo]["flower"]
    # each SuperNode wrote its own ledger beside its PRIVATE state; the server only its view
    sites = sorted((fl / "flower" / "nodes").glob("node-*/state/run-*/ledger/site-*.jsonl"))
    assert len(sites) == len({c for ids in build(runs[algo]["cfg"]).sampling for c in ids})
    assert not list((fl / "ledger").glob("site-*.jsonl"))
    capsys.readouterr()
    assert main(["audit", str(fl)]) == 0
    assert capsys.readouterr().out.strip().endswith("audit: ok")


@pytest.mark.integration
def test_secagg_on_the_real_deployment(runs, tmp_path_factory, capsys):
    """privacy.secure_aggregation on the same TLS deployment, through Flower's SecAgg+ workflow and
    client mod: the numbers equal the plain run's within the quantization error, no upload holds
    a tensor, and the sites' ledgers of masked vectors match the server's (`fedsplice audit`)."""
    import dataclasses

    from fedsplice.app.cli import main
    from fedsplice.federation.checkpoint import DIRNAME, checkpoints

    plain = runs["pfadapter"]
    cfg = dataclasses.replace(plain["cfg"], privacy=dataclasses.replace(plain["cfg"].privacy, secure_aggregation=True))
    out = tmp_path_factory.mktemp("flower-secagg")
    res = launcher.up(cfg, out, launcher.Launch(supernodes=SUPERNODES, overwrite=True, quiet=True))
    a, b = _records(plain["flower"]), _records(out)
    assert [x.get("clients") for x in b] == [x.get("clients") for x in a]
    # round 1's aggregate (its checkpoint's GLOBAL tensors): within one quantization step per client
    g1 = [load_file(dict(checkpoints(o / DIRNAME))[1] / "global.safetensors") for o in (plain["flower"], out)]
    d = max(float((g1[0][n].double() - g1[1][n].double()).abs().max()) for n in g1[0])
    assert 0 < d <= cfg.server.clients_per_round * 2 * 8.0 / 2 ** 22 + 1e-6, d
    assert b[1]["train_loss"] == pytest.approx(a[1]["train_loss"], abs=1e-6)  # round 1 trains from the same tensors
    for x, y in zip(a, b):
        assert abs(x["gm"]["accuracy"] - y["gm"]["accuracy"]) <= 0.05 and not y.get("skipped")
    assert res["flower"]["events"] == 0 and res["flower"]["up_payload_bytes"] == 0  # no update left in the clear
    ups = [r for r in _lines(out / "wire.jsonl") if r["dir"] == "up" and r["kind"] in ("secagg", "train")]
    assert {r["kind"] for r in ups} == {"secagg"} and len(ups) == 4 * 2 * cfg.server.clients_per_round
    assert all(not any(r["arrays"].values()) and r["global_hits"] == 0 for r in ups)
    capsys.readouterr()
    assert main(["audit", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("audit: ok")
    assert _ours_alive(out / "flower") == []


@pytest.mark.integration
def test_no_process_outlives_the_runs(runs):
    for r in runs.values():
        assert _ours_alive(r["flower"] / "flower") == []


# ----------------------------------------------------------------------------- faults


@pytest.fixture(scope="module")
def faulty_run(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path_factory):
    """One run in which an intruder SuperNode (unregistered key) tries to join before the run,
    and SuperNode 2 (client 2, sampled in round 1) is SIGKILLed as soon as round 0 is logged."""
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, server__round_deadline_s="25.0")
    out = tmp_path_factory.mktemp("flower-faults")
    victim = build(cfg).sampling[0][-1]  # a client sampled in round 1; SuperNode `victim` serves it
    facts: dict = {"victim": victim}

    def on_cluster(cl: launcher.Cluster) -> None:
        # an unregistered key, and no key at all, both claiming partition 2
        key = certs.make_node_key(cl.root / "intruder", "auth-key")  # never registered
        ps = {"intruder": cl.start_supernode(2, cl.node_config(2, SUPERNODES), key, name="intruder"),
              "anonymous": cl.start_supernode(2, cl.node_config(2, SUPERNODES), None, name="anonymous")}
        facts["intruders"] = {k: (p.popen.wait(timeout=60), p.tail(40)) for k, p in ps.items()}
        facts["node_ids"] = dict(cl.node_ids)

    def on_tick(cl: launcher.Cluster) -> None:
        if "killed" not in facts and (out / "metrics.jsonl").is_file() and _records(out):
            cl.kill_supernode(victim, signal.SIGKILL)  # the host dies: SuperNode + executor at once
            facts["killed"] = (time.time(), cl.node_ids[victim])

    res = launcher.up(cfg, out, launcher.Launch(supernodes=SUPERNODES, overwrite=True, quiet=True),
                      on_cluster=on_cluster, on_tick=on_tick)
    return cfg, out, res, facts


@pytest.mark.integration
def test_an_unregistered_supernode_is_refused(faulty_run):
    cfg, out, res, facts = faulty_run
    rc, log = facts["intruders"]["intruder"]
    assert rc != 0 and "Failed to activate SuperNode" in log, log
    rc, log = facts["intruders"]["anonymous"]
    assert rc != 0 and "All SuperNodes must be registered" in log, log
    # the run saw only the registered nodes (an intruder with partition-id 2 would clash)
    assert res["flower"]["supernodes"] == SUPERNODES


@pytest.mark.integration
def test_a_killed_supernode_does_not_stop_the_run(faulty_run, runs):
    cfg, out, res, facts = faulty_run
    recs = _records(out)
    assert [r["round"] for r in recs] == [0, 1, 2] and (out / "results.json").is_file()
    victim = facts["victim"]
    killed_node = facts["node_ids"][victim]
    sampled = build(cfg).sampling
    r1 = recs[1]
    assert r1["clients"] == [c for c in sampled[0] if c != victim]
    assert r1["late"] + r1["dropped"] == 1 and not r1.get("skipped")
    assert recs[2]["clients"] == [c for c in sampled[1] if c != victim]
    events = _lines(out / "events.jsonl")
    assert any(e["node_id"] == killed_node and victim in e["cids"] and e.get("round") == 1 for e in events), events
    # later: the node is not asked again; PM averages the clients that can still answer
    assert any(e["event"] == "client_skipped" and e["node_id"] == killed_node for e in events)
    # round 0 (before the kill) is the simulation's, all 3 clients; after it PM is the mean of the
    # 2 clients left, 6 local test samples each: (min + max) / 2, std (max - min) / 2, and k/12
    sim0 = _records(runs["pfadapter"]["sim"])[0]
    assert (recs[0]["gm"], recs[0]["pm"]) == (sim0["gm"], sim0["pm"])
    for r in recs[1:]:
        pm = r["pm"]
        assert pm["accuracy"] == pytest.approx((pm["accuracy_min"] + pm["accuracy_max"]) / 2, abs=1e-12)
        assert pm["accuracy_std"] == pytest.approx((pm["accuracy_max"] - pm["accuracy_min"]) / 2, abs=1e-12)
        assert pm["accuracy"] * 12 == pytest.approx(round(pm["accuracy"] * 12), abs=1e-9)
    assert _ours_alive(out / "flower") == []


# ----------------------------------------------------------------------------- units (no processes)


def test_records_round_trip_fp32_fp16_and_bf16():
    import torch

    like = {"a": torch.zeros(3, 2), "h": torch.zeros(4, dtype=torch.float16),
            "b": torch.zeros(2, 3, dtype=torch.bfloat16)}
    t = {"a": torch.randn(3, 2), "h": torch.randn(4).half(), "b": torch.randn(2, 3).bfloat16()}
    rec = to_record(t)
    assert rec["b"].dtype == "float32"  # numpy has no bfloat16: widened (exactly) for the wire
    back = from_record(rec, like)
    assert all(back[k].dtype == t[k].dtype and torch.equal(back[k], t[k]) for k in t)
    with pytest.raises(RecordError, match="PRIVATE"):
        from_record(to_record({**t, "p": torch.zeros(1)}), {**like, "p": torch.zeros(1)}, private={"p"})
    with pytest.raises(RecordError, match="shape"):
        from_record(to_record({**t, "a": torch.zeros(2, 3)}), like)
    with pytest.raises(RecordError, match="non-finite"):
        from_record(to_record({**t, "a": torch.full((3, 2), float("nan"))}), like)
    # the server side decodes leniently; the round loop's validation refuses what is wrong
    assert set(decode(to_record({"x": torch.zeros(1)}), like)) == {"x"}


def test_weigh_counts_every_object_of_the_message(monkeypatch):
    import torch
    from flwr.app import ConfigRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # a Message outside a run needs these
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)

    small = Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=1, message_type="train")
    t = {"w": torch.randn(64, 64)}
    big = Message(RecordDict({"c": ConfigRecord({"x": 1}), "g": to_record(t)}), dst_node_id=1, message_type="train")
    ws, wb = weigh(small), weigh(big)
    payload = len(wire.encode(t))
    assert wb.total - ws.total >= 64 * 64 * 4
    assert 0 < wb.per_record["g"] - payload < 1000  # one tensor: npy header + Array/ArrayChunk objects
    assert b"w" in wb.blob


def test_certificates_and_node_keys(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    tls = certs.make_tls(tmp_path, hosts=["127.0.0.1", "superlink.example.org"])
    ca = x509.load_pem_x509_certificate(tls.ca_cert.read_bytes())
    srv = x509.load_pem_x509_certificate(tls.server_cert.read_bytes())
    srv.verify_directly_issued_by(ca)
    san = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink.example.org" in san.get_values_for_type(x509.DNSName)
    assert oct(tls.server_key.stat().st_mode & 0o777) == "0o600"
    k = certs.make_node_key(tmp_path, "n0")
    assert load_ssh_private_key(k.private.read_bytes(), None).public_key().public_numbers() == \
        load_ssh_public_key(k.public.read_bytes()).public_numbers()


def test_flower_config_fields_are_validated(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    from fedsplice.errors import ConfigError

    with pytest.raises(ConfigError, match="runtime.num_supernodes"):
        cfg_factory(tiny_bert_dir, toy_jsonl, runtime__num_supernodes="0")
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, runtime__kind='"flower"')
    with pytest.raises(ConfigError, match="exceeds the 3 training clients"):
        launcher.up(cfg, tmp_path / "x", launcher.Launch(supernodes=4, quiet=True))


# ----------------------------------------------------------------------------- in-process Flower


class FakeGrid:
    """A Grid without processes: messages go straight to fedsplice's real ClientApp, called
    in this process with each node's Context (an exception becomes Flower's error reply);
    `tamper(kind, node, msg, reply)` may alter a reply or return "silence" (no reply ever);
    `silent` nodes never answer."""

    def __init__(self, cfg_text: str, tmp: Path, n: int, tamper=None, silent=()):
        from flwr.app import Context, RecordDict

        from fedsplice.runtimes.flower.transport import CONFIG_KEY

        self.nodes = {1000 + i: Context(run_id=7, node_id=1000 + i, state=RecordDict(),
                                        run_config={CONFIG_KEY: cfg_text},
                                        node_config={"partition-id": i, "num-partitions": n,
                                                     "state-dir": str(tmp / f"node-{i}")}) for i in range(n)}
        self.tamper, self.silent, self.replies = tamper, set(silent), {}

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        from flwr.app import ConfigRecord, Message
        from flwr.common import Error
        from flwr.common.constant import ErrorCode

        from fedsplice.runtimes.flower.client import client_app

        ids = []
        configs = {id(m): {k: dict(r) for k, r in m.content.config_records.items()} for m in messages}
        for m in messages:
            # unique per destination: SecAgg+ sends the same content to every node
            m.metadata.__dict__["_message_id"] = hashlib.sha256(f"{m.object_id}:{m.metadata.dst_node_id}".encode()
                                                                ).hexdigest()
            ids.append(m.metadata.message_id)
            if m.metadata.dst_node_id in self.silent:
                continue
            for k, rec in configs[id(m)].items():  # each node reads its own copy (SecAgg+ shares one content)
                m.content[k] = ConfigRecord(dict(rec))
            try:
                rep = client_app(message=m, context=self.nodes[m.metadata.dst_node_id])
            except Exception as ex:  # the error reply flwr.supernode.runtime.run_clientapp sends
                rep = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                    reason=str(type(ex)) + ":<'" + str(ex) + "'>"), reply_to=m)
            if self.tamper:
                rep = self.tamper(m.metadata.message_type, m.metadata.dst_node_id, m, rep) or rep
            if rep != "silence":
                self.replies[m.metadata.message_id] = rep
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        """Flower's Grid call (SecAgg+'s workflow uses it): a silenced reply is a timeout."""
        return self.pull_messages(self.push_messages(list(messages)))


@pytest.fixture
def in_process(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path, monkeypatch):
    import tomli_w
    from flwr.supercore.task_identity import TaskIdentity

    from fedsplice.config import to_dict
    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.flower.transport import FlowerTransport, JsonLog
    from fedsplice.runtimes.inprocess import run_rounds

    for k, v in (("_run_id", 7), ("_node_id", 0), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, k, v)

    def run(cfg, **grid_kw):
        grid = FakeGrid(tomli_w.dumps(to_dict(cfg)), tmp_path, 3, **grid_kw)
        exp, records = build(cfg), []
        events, audit = JsonLog(tmp_path / "events.jsonl"), JsonLog(tmp_path / "wire.jsonl")
        t = FlowerTransport(grid, exp, events=events, audit=audit, min_nodes=3, say=lambda s: None, poll_s=0.01)
        run_rounds(exp, MemoryStore(), records.append, transport=t)
        return exp, records, _lines(tmp_path / "events.jsonl"), grid

    yield run
    from fedsplice.runtimes.flower.client import Node

    Node._cached, Node._key = None, ()  # the in-process "node" kept an experiment alive


# the DP cases: a client's noise share (distributed), the server's noise (central) and DP-SGD's
# (local, with its step count kept in the SuperNode's client state) are seeded by (seed, round,
# client), so Flower's run releases the same noised aggregates as the simulation
@pytest.mark.parametrize("privacy", [{}, {"mode": "distributed", "clip": 0.05, "noise_multiplier": 1.0},
                                     {"mode": "central", "clip": 0.05, "noise_multiplier": 1.0},
                                     {"local": "dpsgd", "local_noise_multiplier": 1.0}])
def test_in_process_flower_equals_the_simulation(in_process, cfg_factory, tiny_bert_dir, toy_jsonl, privacy):
    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.inprocess import run_rounds

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl)
    if privacy:
        for k, v in {**privacy, "noise": "seeded"}.items():
            setattr(cfg.privacy, k, v)
    # bit for bit: each Flower client scores its own PM, as the simulation does with batch_eval
    # "off"; its default "auto" scores them together, within rounding (tests/test_grouped.py)
    cfg.runtime.batch_eval = "off"
    exp_s, sim = build(cfg), []
    run_rounds(exp_s, MemoryStore(), sim.append)
    _, fl, events, _ = in_process(cfg)
    assert events == []
    for a, b in zip(sim, fl, strict=True):
        assert (a["gm"], a["pm"], a.get("clients"), a.get("train_loss")) == (b["gm"], b["pm"], b.get("clients"),
                                                                              b.get("train_loss"))
        assert a.get("dp_epsilon") == b.get("dp_epsilon") and a.get("dp_local_epsilon") == b.get("dp_local_epsilon")
        assert (a.get("dp_epsilon") is not None) == ("mode" in privacy and a["round"] > 0)
        assert (a.get("dp_local_epsilon") is not None) == ("local" in privacy and a["round"] > 0)


def test_bad_replies_are_refused_and_logged_with_the_node_id(in_process, cfg_factory, tiny_bert_dir, toy_jsonl):
    """Round 1: one client's reply smuggles a PRIVATE tensor; round 2: one sends NaN; round 3:
    one node never answers (deadline). Each round goes on with the other client."""
    import torch

    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, server__rounds="3", server__round_deadline_s="1.0",
                      server__max_retries="0")
    s = build(cfg).sampling
    bad = {1: s[0][0], 2: s[1][0]}
    silent_cid = s[2][0]

    def tamper(kind, node, msg, rep):
        rnd = int(msg.content.config_records["task"]["round"])
        cid = node - 1000
        if kind == "train" and rnd == 3 and cid == silent_cid:
            return "silence"
        if kind != "train" or bad.get(rnd) != cid:
            return None
        rec = rep.content.array_records[f"up.{cid}"]
        name = next(iter(rec.keys()))
        if rnd == 1:
            exp = build(cfg)
            rec[exp.private_names[0]] = to_record({"x": exp.init_params[exp.private_names[0]]})["x"]
        else:
            rec[name] = to_record({"x": torch.full(tuple(rec[name].shape), float("nan"))})["x"]
        return rep

    exp, recs, events, grid = in_process(cfg, tamper=tamper)
    assert [r["round"] for r in recs] == [0, 1, 2, 3]
    for rnd in (1, 2):
        r = recs[rnd]
        assert r["clients"] == [c for c in s[rnd - 1] if c != bad[rnd]] and not r.get("skipped")
        assert r["dropped"] + r["rejected"] == 1
        assert any(e["node_id"] == 1000 + bad[rnd] and e["round"] == rnd for e in events), events
    assert any("PRIVATE" in e["detail"] for e in events if e["round"] == 1)
    assert any("non-finite" in e["detail"] for e in events if e["round"] == 2)
    assert recs[3]["late"] == 1 and recs[3]["clients"] == [c for c in s[2] if c != silent_cid]
    assert any(e["node_id"] == 1000 + silent_cid and "deadline" in e["detail"] for e in events)
    # the silent node is not asked again: PM after round 3 averages the other clients
    assert any(e["event"] == "pm_partial" and e["cids"] == [silent_cid] for e in events)


# ----------------------------------------------------------------------------- teardown, CLI


def _write_cfg(cfg, path: Path) -> Path:
    import tomli_w

    from fedsplice.config import to_dict

    path.write_text(tomli_w.dumps(to_dict(cfg)))
    return path


@pytest.mark.integration
def test_ctrl_c_tears_everything_down(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    import subprocess
    import sys

    cfg = _write_cfg(cfg_factory(tiny_bert_dir, toy_jsonl), tmp_path / "cfg.toml")
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "fedsplice.app.cli", "flower", "up", str(cfg), "--out", str(out),
                          "--supernodes", "2"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    seen = []
    for line in p.stderr:
        seen.append(line)
        if "submitting the run" in line:
            break
    assert any("submitting the run" in s for s in seen), seen
    assert _ours_alive(out / "flower")  # SuperLink, SuperNodes, executors, flwr run are up
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    assert p.wait(timeout=60) == 130, rest
    assert "interrupted" in rest
    assert _ours_alive(out / "flower") == []


@pytest.mark.integration
def test_a_failed_run_tears_everything_down(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl)

    def all_nodes_die(cl):
        for i in list(cl.executors):
            cl.kill_supernode(i)

    with pytest.raises(launcher.FlowerLaunchError, match="SuperNode"):
        launcher.up(cfg, tmp_path / "run", launcher.Launch(supernodes=2, quiet=True, node_wait_s=3),
                    on_cluster=all_nodes_die)
    status = json.loads((tmp_path / "run" / "flower-status.json").read_text())
    assert status["ok"] is False and "only 0 SuperNode(s) connected" in status["error"]
    assert _ours_alive(tmp_path / "run" / "flower") == []


def test_flower_cli_errors_are_one_line(capsys, cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    from fedsplice.app.cli import main

    cfg = _write_cfg(cfg_factory(tiny_bert_dir, toy_jsonl), tmp_path / "cfg.toml")
    assert main(["flower", "up", str(cfg), "--supernodes", "9", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds the 3 training clients" in err[0]
    # `fedsplice run` with runtime.kind = "flower" goes the same way
    assert main(["run", str(cfg), "--set", "runtime.kind=flower", "--set", "runtime.num_supernodes=9",
                 "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds the 3 training clients" in err[0]


def test_flower_app_is_a_valid_flower_app(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    from flwr.cli.config_utils import load_and_validate

    from fedsplice.app.cli import main
    from fedsplice.federation import config_from_text
    from fedsplice.runtimes.flower.transport import CONFIG_KEY

    cfg = _write_cfg(cfg_factory(tiny_bert_dir, toy_jsonl), tmp_path / "cfg.toml")
    assert main(["flower", "app", str(cfg), "--app-dir", str(tmp_path / "app"), "--out", "/srv/run"]) == 0
    conf, _ = load_and_validate(tmp_path / "app" / "pyproject.toml")
    app = conf["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedsplice.app.flower.server:server_app",
                                 "clientapp": "fedsplice.runtimes.flower.client:client_app"}
    assert conf["project"]["dependencies"] == []  # nothing for Flower to install (no CUDA torch)
    back = config_from_text(app["config"][CONFIG_KEY])
    assert back.runtime.kind == "flower" and back.algorithm == "pfadapter"


def test_in_process_flower_equals_the_simulation_on_generated_answers(in_process, cfg_factory, tiny_llama_dir,
                                                                      instruct_jsonl):
    """model.task = "generate": the same response losses and answer scores through Flower's messages."""
    from conftest import GEN_BUDGET

    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.inprocess import run_rounds

    cfg = cfg_factory(tiny_llama_dir, instruct_jsonl, **{**GEN_BUDGET, "server__rounds": 2})
    exp_s, sim = build(cfg), []
    run_rounds(exp_s, MemoryStore(), sim.append)
    _, fl, events, _ = in_process(cfg)
    assert events == [] and "response_loss" in sim[-1]["gm"]
    for a, b in zip(sim, fl, strict=True):
        assert (a["gm"], a["pm"], a.get("clients"), a.get("train_loss")) == (b["gm"], b["pm"], b.get("clients"),
                                                                              b.get("train_loss"))
