"""docs/extending.md, run as written: its FedRep module, its three registration routes, and the
claims it makes about the split and the head-then-adapters schedule, on the tiny BERT."""

import dataclasses
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import TINY_BUDGET

import fedsplice
from fedsplice.algorithms import registry
from fedsplice.core import wire
from fedsplice.federation import build, fit_client
from fedsplice.federation.store import MemoryStore

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "extending.md"
CONFIG_LINE = 'CONFIG, SETS = None, ["server.rounds=2"]  # None: the embedded default (MiniLM, fortunes)'


def block(marker: str, lang: str) -> str:
    m = re.search(rf"<!-- {re.escape(marker)} -->\n```{lang}\n(.*?)\n```", DOC.read_text(), re.S)
    assert m, f"docs/extending.md lost its {marker!r} block"
    return m.group(1) + "\n"


def tiny_sets(model_dir, data) -> list[str]:
    """The tiny budget as --set items, with an encoder + head model; each phase (the doc's
    head_epochs, body_epochs) capped at 8 steps."""
    sets = {k: v for k, v in TINY_BUDGET.items() if k != "model.task"}
    sets.update({"model.name": json.dumps(str(model_dir)), "data.dataset": json.dumps(f"jsonl:{data}"),
                 "model.task": '"encoder_head"', "client.local_epochs": "2", "client.max_steps": "8"})
    return [f"{k}={v}" for k, v in sets.items()]


@pytest.fixture
def mypkg(tmp_path, monkeypatch):
    """The doc's module saved as mypkg/fedrep.py on sys.path; a registry of this test's own."""
    pkg = tmp_path / "src" / "mypkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "fedrep.py").write_text(block("file: mypkg/fedrep.py", "python"))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    for name in ("mypkg", "mypkg.fedrep"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(registry, "ALGORITHMS", dict(registry.ALGORITHMS))
    return pkg


@pytest.fixture
def wire_names(monkeypatch):
    """The tensor names of every payload encoded for the wire (down, up and evaluation tasks)."""
    seen: list[list[str]] = []
    orig = wire.encode

    def spy(tensors):
        seen.append(sorted(tensors))
        return orig(tensors)

    monkeypatch.setattr(wire, "encode", spy)
    return seen


def _sizes(model_dir) -> tuple[int, int]:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return c["hidden_size"], c["num_hidden_layers"]


def test_the_module_is_short_and_the_doc_says_how_long():
    code = block("file: mypkg/fedrep.py", "python")
    n = len(code.splitlines())
    assert n < 60
    text = DOC.read_text()
    assert f"in one\n{n}-line file" in text or f"in one {n}-line file" in text
    assert f"on your `PYTHONPATH` ({n} lines)" in text


def test_register_route_runs_and_splits_adapters_from_head(mypkg, wire_names, tiny_bert_dir, toy_jsonl, tmp_path,
                                                           monkeypatch):
    code = block("example: register", "python")
    assert code.count(CONFIG_LINE) == 1
    sets = tiny_sets(tiny_bert_dir, toy_jsonl) + ["server.rounds=2"]
    code = code.replace(CONFIG_LINE, f"CONFIG, SETS = None, {sets!r}")
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "extending_example"}
    exec(compile(code, str(DOC), "exec"), ns)
    res = ns["res"]
    assert res.out.resolve() == (tmp_path / "runs" / "fedrep").resolve()
    assert res.algorithm == res.method == "fedrep"
    assert fedsplice.list_algorithms()["fedrep"].paper == "https://arxiv.org/abs/2102.07078"
    cfg = res.config()
    assert (cfg.algorithm, cfg.method, cfg.model.task) == ("fedrep", {"head_epochs": 1, "body_epochs": 1},
                                                           "encoder_head")
    # by hand: LoRA r = 4 on q,k,v,o of every layer (A: r x h, B: h x r) is GLOBAL; the 3-class head PRIVATE
    h, layers = _sizes(tiny_bert_dir)
    r, classes = cfg.peft.r, 3
    assert res.params == {"global": layers * 4 * 2 * r * h, "private": h * classes + classes}
    # on the wire: exactly the LoRA tensors, every time; never the head
    names = {n for payload in wire_names for n in payload}
    assert wire_names and all(payload == sorted(names) for payload in wire_names if payload)
    assert len(names) == layers * 4 * 2 and all("lora_A" in n or "lora_B" in n for n in names)
    assert not any(n.startswith("head.") for n in names)
    assert res.communication["up_bytes"] > 0 and res.cold_start is not None
    assert [r["round"] for r in res.records()] == [0, 1, 2]


def test_config_file_route_runs_the_same_method(mypkg, tiny_bert_dir, toy_jsonl, tmp_path, monkeypatch):
    toml = tmp_path / "fedrep.toml"
    toml.write_text(block("file: fedrep.toml", "toml"))
    sets = tiny_sets(tiny_bert_dir, toy_jsonl)
    by_file = fedsplice.load_config(toml, sets)
    assert by_file.algorithm == "mypkg.fedrep:build" and by_file.method == {"head_epochs": 1, "body_epochs": 1}
    ref = registry.get_algorithm("mypkg.fedrep:build")
    assert ref.params.__name__ == "FedRepParams" and ref.params.__module__ == "mypkg.fedrep"
    a = fedsplice.run(by_file, tmp_path / "by-file")
    # the same method registered by name, on the same config otherwise: the same numbers
    from mypkg.fedrep import FedRepParams
    from mypkg.fedrep import build as fedrep_build

    fedsplice.register_algorithm("fedrep", FedRepParams, fedrep_build)
    by_name = fedsplice.load_config(toml, [*sets, "algorithm=fedrep"])
    assert {k: v for k, v in dataclasses.asdict(by_name).items() if k != "algorithm"} == \
        {k: v for k, v in dataclasses.asdict(by_file).items() if k != "algorithm"}
    b = fedsplice.run(by_name, tmp_path / "by-name")
    assert (a.algorithm, b.algorithm) == ("mypkg.fedrep:build", "fedrep")
    for field in ("gm", "pm", "communication", "params", "cold_start"):
        assert getattr(a, field) == getattr(b, field), field


def test_entry_point_route(mypkg, tmp_path, monkeypatch, tiny_bert_dir, toy_jsonl):
    """The doc's pyproject snippet, installed as a distribution's entry_points.txt."""
    eps = tomllib.loads(block("file: pyproject.toml", "toml"))["project"]["entry-points"]
    assert list(eps) == [registry.ENTRY_POINT_GROUP]
    dist = tmp_path / "site" / "mypkg-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mypkg\nVersion: 0.1\n")
    lines = [f"[{registry.ENTRY_POINT_GROUP}]"] + [f"{k} = {v}" for k, v in eps[registry.ENTRY_POINT_GROUP].items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    assert "fedrep" not in registry.ALGORITHMS
    algo = registry.get_algorithm("fedrep")
    from mypkg import fedrep

    assert algo.build is fedrep.build and algo.params is fedrep.FedRepParams
    assert fedsplice.list_algorithms()["fedrep"].build is fedrep.build
    cfg = fedsplice.load_config(None, [*tiny_sets(tiny_bert_dir, toy_jsonl), "algorithm=fedrep",
                                       "method={head_epochs=2}"])
    assert cfg.method == {"head_epochs": 2}


@pytest.mark.parametrize("head_epochs, body_epochs, head_moves, adapters_move",
                         [(0, 1, False, True), (1, 1, True, True), (2, 0, True, False)])
def test_schedule_head_first_then_adapters(mypkg, tiny_bert_dir, toy_jsonl, head_epochs, body_epochs, head_moves,
                                           adapters_move):
    """One client's local update: the head's epochs, then the adapters' (each phase capped at 8
    steps); with body_epochs = 0 the uploaded adapters are the received ones, bit for bit, and
    only the head moved; with head_epochs = 0 the head stays at its init."""
    cfg = fedsplice.load_config(None, [*tiny_sets(tiny_bert_dir, toy_jsonl), 'algorithm="mypkg.fedrep:build"',
                                       f"method={{head_epochs={head_epochs}, body_epochs={body_epochs}}}"])
    exp = build(cfg)
    assert exp.private_names == ["head.bias", "head.weight"]
    assert exp.global_names and all("lora_" in n for n in exp.global_names)
    store = MemoryStore()
    down = {n: exp.init_params[n] for n in exp.global_names}
    up, stats = fit_client(exp, store, exp.train_ids[0], 1, wire.encode(down))
    n = len(exp.clients[exp.train_ids[0]].train_idx)
    per_epoch = -(-n // 8)  # batches of 8
    assert (stats["private_steps"], stats["global_steps"]) == (min(8, head_epochs * per_epoch),
                                                             min(8, body_epochs * per_epoch))
    sent = wire.decode(up)
    assert sorted(sent) == exp.global_names
    kept = store.get(exp.train_ids[0])
    moved_head = any(not torch.equal(kept[f"param/{n}"], exp.init_params[n]) for n in exp.private_names)
    moved_adapters = any(not torch.equal(sent[n], down[n]) for n in exp.global_names)
    assert (moved_head, moved_adapters) == (head_moves, adapters_move)
    assert all(p.requires_grad for p in exp.model.trainable().values())  # the phases restored them
    assert sorted(exp.model.trainable()) == sorted(exp.init_params)


def test_fedrep_errors_name_the_fix(mypkg, tiny_bert_dir, toy_jsonl, tmp_path):
    with pytest.raises(fedsplice.ConfigError, match="method.head_epochs and method.body_epochs must be >= 0"):
        fedsplice.load_config(None, [*tiny_sets(tiny_bert_dir, toy_jsonl), 'algorithm="mypkg.fedrep:build"',
                                     "method={head_epochs=-1}"])
    cfg = fedsplice.load_config(None, [*tiny_sets(tiny_bert_dir, toy_jsonl), 'algorithm="mypkg.fedrep:build"',
                                       "method={}", "model.task=dual_encoder"])  # validates: no model yet
    with pytest.raises(fedsplice.ConfigError, match="model.task = 'encoder_head'"):
        fedsplice.run(cfg, tmp_path / "no-head")


def test_a_method_with_model_parts_of_its_own(mypkg, wire_names, tiny_bert_dir, toy_jsonl, tmp_path):
    """The page's dualprompt module, named by reference: its private prompt is built into the
    model, trains, and never travels; the class side is its mix; a wrong PEFT type is refused."""
    (mypkg / "dualprompt.py").write_text(block("file: mypkg/dualprompt.py", "python"))
    n = len(block("file: mypkg/dualprompt.py", "python").splitlines())
    assert f"this method of {n} lines" in DOC.read_text()
    sets = [f"{k}={v}" for k, v in TINY_BUDGET.items()] + [
        f"model.name={json.dumps(str(tiny_bert_dir))}", f"data.dataset={json.dumps(f'jsonl:{toy_jsonl}')}",
        'algorithm="mypkg.dualprompt:DUALPROMPT"', 'peft.type="prompt"', "method={weight = 0.3}",
        "server.rounds=2"]
    cfg = fedsplice.load_config(None, sets)
    exp = build(cfg)
    assert exp.global_names == ["prompt.ctx"] and exp.private_names == ["mine.ctx"]
    m = exp.model
    with torch.no_grad():
        enc = m.encode_prompt
        want = torch.nn.functional.normalize(0.7 * enc(m.prompt) + 0.3 * enc(m.mine), dim=-1)
        assert torch.allclose(m.class_embeddings(), want, atol=1e-6)
    res = fedsplice.run(cfg, tmp_path / "dual")
    assert res.params == {"global": m.prompt.ctx.numel(), "private": m.mine.ctx.numel()}
    assert wire_names and all(payload == ["prompt.ctx"] for payload in wire_names if payload)
    assert [r["round"] for r in res.records()] == [0, 1, 2]
    with pytest.raises(fedsplice.ConfigError, match="dualprompt adds a private prompt: set peft.type = 'prompt'"):
        fedsplice.load_config(None, [*sets, 'peft.type="lora"'])


def test_the_new_switch_composes_onto_a_method(tiny_bert_dir, toy_jsonl):
    """docs/extending.md's label-smoothing switch, as written: registered, turned on by its table,
    named in results, its loss by hand, refused in one line out of range; a run trains with it."""
    from conftest import make_cfg

    from fedsplice.algorithms import switches
    from fedsplice.core.context import cross_entropy
    from fedsplice.errors import ConfigError
    from fedsplice.federation.tasks import start_switches, train_context
    from fedsplice.runtimes.inprocess import run_rounds

    exec(compile(block("smooth.py", "python"), "smooth.py", "exec"), {"__name__": "smooth"})
    try:
        cfg = make_cfg(tiny_bert_dir, toy_jsonl, algorithm='"lora"', switch__smooth="{eps = 0.2}")
        assert registry.display_name(cfg) == "fedavg-lora+ls"
        exp = build(cfg)
        ctx = train_context(exp, 0, start_switches(exp, 0, None, {}).values())
        z, y = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]]), torch.tensor([0, 2])
        logp = torch.log_softmax(z, -1)
        by_hand = -(0.8 * logp[[0, 1], [0, 2]] + 0.2 * logp.mean(-1)).mean()
        assert float(ctx.task_loss(z, y)) == pytest.approx(float(by_hand), rel=1e-6)
        assert float(ctx.task_loss(z, y)) != pytest.approx(float(cross_entropy(z, y)), rel=1e-3)
        recs: list = []
        run_rounds(exp, MemoryStore(), recs.append)
        assert recs[-1]["round"] == 2 and all(r.get("train_loss", 0) > 0 for r in recs[1:])
        with pytest.raises(ConfigError, match=r"^switch.smooth.eps must be in \[0, 1\), got 1.0$"):
            make_cfg(tiny_bert_dir, toy_jsonl, algorithm='"lora"', switch__smooth="{eps = 1.0}")
    finally:
        del switches.SWITCHES["smooth"]
