"""model.task = "generate" on a real local Flower deployment (a SuperLink and 3 SuperNodes as
separate processes, TLS, node authentication): PFAdapter instruction tuning on the tiny Llama
gives exactly the simulation's metrics, generated-answer scores included, and the real messages
carry no PRIVATE name (docs/instruct.md, docs/flower.md)."""

from __future__ import annotations

import json

import flwr  # noqa: F401  a pinned test dependency: a broken install must fail here, not skip
import pytest
from conftest import GEN_BUDGET

from fedsplice.app.flower import launcher
from fedsplice.app.runner import run_experiment
from fedsplice.federation.experiment import build


@pytest.mark.integration
def test_generate_on_flower_equals_the_simulation(cfg_factory, tiny_llama_dir, instruct_jsonl, tmp_path):
    cfg = cfg_factory(tiny_llama_dir, instruct_jsonl, **{**GEN_BUDGET, "data__num_clients": 3, "server__rounds": 2})
    run_experiment(cfg, tmp_path / "sim", overwrite=True, quiet=True)
    res = launcher.up(cfg, tmp_path / "fl", launcher.Launch(supernodes=3, overwrite=True, quiet=True))
    sim, fl = ([json.loads(s) for s in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
               for d in ("sim", "fl"))
    assert [x["round"] for x in fl] == [x["round"] for x in sim] == [0, 1, 2]
    for a, b in zip(sim, fl):
        assert b["gm"] == a["gm"] and b["pm"] == a["pm"], a["round"]
        assert b.get("clients") == a.get("clients") and b.get("train_loss") == a.get("train_loss")
    assert "rouge_l" in fl[-1]["gm"] and fl[-1]["gm"]["response_loss"] < fl[0]["gm"]["response_loss"]
    assert res["flower"]["supernodes"] == 3 and res["flower"]["events"] == 0
    exp = build(cfg)
    glob, private = set(exp.global_names), set(exp.private_names)
    audit = [json.loads(s) for s in (tmp_path / "fl" / "wire.jsonl").read_text().splitlines() if s.strip()]
    assert private and {m["kind"] for m in audit} >= {"train", "evaluate"}
    for m in audit:
        assert m["private_hits"] == [], m  # no PRIVATE name anywhere in the serialized bytes
        for names in m["arrays"].values():
            assert set(names) <= glob
