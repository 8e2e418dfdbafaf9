"""The ledger of what left each site (federation.ledger) and `fedsplice audit`."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from fedsplice.core import wire
from fedsplice.federation import ledger

pytestmark = pytest.mark.unit


def test_rows_hash_each_tensor_as_serialized():
    a = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    b = torch.tensor([7], dtype=torch.int8)
    rows = ledger.rows(wire.encode({"b": b, "a": a}), 3, 5, None)
    assert [r["name"] for r in rows] == ["a", "b"]
    assert rows[0] == {"round": 3, "client": 5, "name": "a", "shape": [2, 2], "dtype": "float32", "bytes": 16,
                       "sha256": hashlib.sha256(a.numpy().tobytes()).hexdigest(), "epsilon": None,
                       "local_epsilon": None, "secagg": False}
    assert rows[1]["bytes"] == 1 and rows[1]["sha256"] == hashlib.sha256(b"\x07").hexdigest()
    # bf16 has no numpy type: hashed through its raw bytes, 2 a value
    assert ledger.rows(wire.encode({"c": torch.ones(3, dtype=torch.bfloat16)}), 0, 0, 1.5)[0]["bytes"] == 6


def _run(tiny_cfg, tmp_path, **kw):
    from fedsplice.app.cli import main
    from fedsplice.app.rundir import write_config

    write_config(tmp_path, tiny_cfg(**kw))
    assert main(["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    return tmp_path / "run"


def test_a_run_ledgers_every_upload_and_the_audit_passes(tiny_cfg, tmp_path, capsys):
    from fedsplice.app.cli import main

    run = _run(tiny_cfg, tmp_path, privacy__mode='"central"', privacy__clip=1.0, privacy__noise_multiplier=1.0,
               privacy__noise='"seeded"')
    split = json.loads((run / "ledger" / "split.json").read_text())
    server = ledger.read(run / "ledger" / "server.jsonl")
    sites = {f.name: ledger.read(f) for f in sorted((run / "ledger").glob("site-*.jsonl"))}
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # one row per GLOBAL tensor per client per round, for exactly the clients each round trained
    for rec in metrics[1:]:
        got = sorted({r["client"] for r in server if r["round"] == rec["round"]})
        assert got == sorted(rec["clients"])
        for cid in got:
            names = [r["name"] for r in server if r["round"] == rec["round"] and r["client"] == cid]
            assert names == split["global"]
    assert split["private"] and not set(split["private"]) & {r["name"] for rs in sites.values() for r in rs}
    assert len(server) == sum(map(len, sites.values()))
    assert {r["epsilon"] for r in server if r["round"] == 2} == {metrics[2]["dp_epsilon"]}
    capsys.readouterr()
    assert main(["audit", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("audit: ok") and f"client {server[0]['client']}: 2 rounds" in out


def test_the_server_rows_hash_what_the_server_decoded(tiny_cfg, capture_uploads, tmp_path):
    from fedsplice.federation import build
    from fedsplice.federation.store import MemoryStore
    from fedsplice.runtimes.inprocess import run_rounds

    exp = build(tiny_cfg(server__rounds=1))
    exp.ledger = tmp_path
    run_rounds(exp, MemoryStore(), lambda r: None)
    server = ledger.read(tmp_path / "server.jsonl")
    for _, cid, up in capture_uploads:
        for name, t in wire.decode_update(up, exp.init_params).items():
            row = next(r for r in server if r["client"] == cid and r["name"] == name)
            assert row["sha256"] == hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def test_audit_catches_a_planted_private_name_and_a_changed_hash(tiny_cfg, tmp_path, capsys):
    from fedsplice.app.cli import main

    run = _run(tiny_cfg, tmp_path)
    private = json.loads((run / "ledger" / "split.json").read_text())["private"][0]
    site = sorted((run / "ledger").glob("site-*.jsonl"))[0]
    rows = ledger.read(site)
    ledger.append(site, [{**rows[0], "name": private}])
    assert main(["audit", str(run)]) == 1
    out = capsys.readouterr().out
    assert f"PRIVATE tensor {private} left the site" in out and "audit: 1 mismatches" in out

    site.write_text("".join(json.dumps(r) + "\n" for r in rows))  # restore, then change one hash the server saw
    server = run / "ledger" / "server.jsonl"
    srv = ledger.read(server)
    srv[1]["sha256"] = "0" * 64
    server.write_text("".join(json.dumps(r) + "\n" for r in srv))
    assert main(["audit", str(run)]) == 1
    assert f"{srv[1]['name']} differs from what the client sent (sha256)" in capsys.readouterr().out


def test_audit_refuses_a_folder_without_a_ledger(tmp_path, capsys):
    from fedsplice.app.cli import main

    assert main(["audit", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedsplice: error:") and "no ledger" in err and "\n" not in err


def test_a_run_that_sends_nothing_has_an_empty_ledger_that_audits(tiny_cfg, tmp_path, capsys):
    from fedsplice.app.cli import main

    run = _run(tiny_cfg, tmp_path, algorithm='"local"', method="{}")
    assert (run / "ledger" / "server.jsonl").read_text() == ""
    assert all(f.read_text() == "" for f in (run / "ledger").glob("site-*.jsonl"))
    assert main(["audit", str(run)]) == 0
    assert "server: 0 tensors received" in capsys.readouterr().out
