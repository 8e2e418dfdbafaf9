"""The Python API (docs/api.md): the doc's example, run verbatim on the tiny BERT, and the typed
results checked against what the runs wrote to disk."""

import ast
import dataclasses
import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fedsplice
from fedsplice.algorithms import NoParams, Recipe, registry
from fedsplice.app import api
from fedsplice.app.rundir import write_config
from fedsplice.core import split as S
from fedsplice.federation import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "api.md"
CONFIG_LINE = 'CONFIG, SETS = None, ["server.rounds=2"]  # None: the embedded default (PFAdapter, MiniLM, fortunes)'


def doc_example() -> str:
    """The python block after the `<!-- api-example -->` marker of docs/api.md."""
    m = re.search(r"<!-- api-example -->\n```python\n(.*?)\n```", DOC.read_text(), re.S)
    assert m, "docs/api.md lost its example block"
    return m.group(1)


def _tiny_bert_sizes(model_dir: Path) -> tuple[int, int]:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return c["hidden_size"], c["num_hidden_layers"]


def _without_time(raw: dict) -> dict:
    return {k: v for k, v in raw.items() if k not in ("time_s", "cpu_s", "setup")}


@pytest.fixture(scope="module")
def example(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path_factory):
    """The doc's example, exec'd verbatim in a fresh folder, with only its CONFIG line pointed at
    a tiny-budget config file. Returns (namespace, folder, the tiny config)."""
    root = tmp_path_factory.mktemp("api")
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl)
    write_config(root, cfg)
    tiny = (root / "config.toml").rename(root / "tiny.toml")
    code = doc_example()
    assert code.count(CONFIG_LINE) == 1
    code = code.replace(CONFIG_LINE, f"CONFIG, SETS = {str(tiny)!r}, ['server.rounds=2']")
    mp = pytest.MonkeyPatch()
    mp.chdir(root)
    ns: dict = {"__name__": "api_example"}
    try:
        exec(compile(code, str(DOC), "exec"), ns)
    finally:
        mp.undo()
    return ns, root, cfg


# ----------------------------------------------------------------------------- the doc's example


def test_example_results_are_the_run_directories(example, tiny_bert_dir):
    ns, root, _ = example
    pf, lora = ns["pf"], ns["lora"]
    for res, label in ((pf, "pfadapter"), (lora, "fedavg-lora")):
        assert isinstance(res, fedsplice.RunResult)
        on_disk = json.loads((res.out / "results.json").read_text())
        assert res.raw == on_disk
        assert (res.algorithm, res.rounds, res.seed) == (label, 2, 0)
        assert (res.gm, res.pm, res.communication, res.params) == (
            on_disk["gm"], on_disk["pm"], on_disk["communication"], on_disk["params"])
        assert res.cold_start == on_disk["cold_start"] and len(res.cold_start["accuracy"]) == 2  # step 0, 1 epoch
        assert res.random_weights == () and res.time_s == on_disk["time_s"]
        assert res.out.is_absolute()
        assert res.out.resolve() == (root / "runs/api" / label.replace("fedavg-", "")).resolve()
        recs = res.records()
        assert [r["round"] for r in recs] == [0, 1, 2]
        assert recs[-1]["gm"] == res.gm and recs[-1]["pm"] == res.pm
        assert sum(r.get("up_bytes", 0) for r in recs) == res.communication["up_bytes"]
        assert dataclasses.asdict(res.config()) == dataclasses.asdict(fedsplice.load_config(res.out / "config.toml"))
    assert pf.method == "pfadapter" and lora.method == "lora"
    assert lora.config().algorithm == "lora" and lora.config().method == {}
    # the split, by hand: LoRA r = 4 on q,k,v,o of every layer: A (r x h) + B (h x r) per role
    h, layers = _tiny_bert_sizes(tiny_bert_dir)
    per_role = layers * 2 * 4 * h
    assert pf.params == {"global": 2 * per_role, "private": 2 * per_role}  # q,k GLOBAL; v,o PRIVATE
    assert lora.params == {"global": 4 * per_role, "private": 0}
    assert pf.communication["up_bytes"] < 0.6 * lora.communication["up_bytes"]
    # load_result reads the same thing back (the example asserts equality too)
    assert fedsplice.load_result(root / "runs/api/pfadapter").raw == pf.raw


def test_example_compare_rows_are_the_individual_runs(example):
    ns, root, _ = example
    rows, refs = ns["rows"][:2], ns["rows"][2:]
    assert [r.method for r in rows] == ["pfadapter", "fedavg-lora"]
    assert [r.algorithm for r in rows] == ["pfadapter", "fedavg-lora"]
    assert [(r.method, r.n_seeds, r.runs) for r in refs] == [("majority (reference)", 2, ()),
                                                             ("local-prior (reference)", 2, ())]
    pm = [r.references["local_prior"]["pm"]["accuracy"] for r in rows[0].runs]
    assert refs[1].metrics["PM acc"] == pytest.approx((np.mean(pm), np.std(pm)))
    for row, single in zip(rows, (ns["pf"], ns["lora"])):
        assert isinstance(row, fedsplice.CompareRow) and row.n_seeds == 2
        assert [r.seed for r in row.runs] == [0, 1]
        runs_dir = root / "runs/api/compare/runs" / row.method
        assert [r.out.resolve() for r in row.runs] == [(runs_dir / f"seed-{s}").resolve() for s in (0, 1)]
        # seed 0 of the comparison is the same run as the individual one (same config and seed)
        assert _without_time(row.runs[0].raw) == _without_time(single.raw)
        assert row.runs[1].raw != row.runs[0].raw
        for col, get in (("GM acc", lambda r: r.gm["accuracy"]), ("PM acc", lambda r: r.pm["accuracy"]),
                         ("up B/round", lambda r: r.communication["up_bytes_per_round"])):
            vals = [get(r) for r in row.runs]
            assert row.metrics[col] == pytest.approx((np.mean(vals), np.std(vals)))
            assert (row.mean(col), row.std(col)) == row.metrics[col]
        assert row.metrics["GM many"] is None and row.mean("GM many") is None  # no class has > 100 samples
    with pytest.raises(KeyError, match="GM acc"):
        rows[0].mean("accuracy")
    table = (root / "runs/api/compare/table.md").read_text()
    assert f"{rows[0].mean('GM acc'):.3f} ± {rows[0].std('GM acc'):.3f}" in table


def test_rerun_and_resume_give_the_same_result(example, tmp_path):
    ns, root, _ = example
    pf = ns["pf"]
    # a run killed after round 1: its last checkpoint and its results are gone
    killed = tmp_path / "killed"
    shutil.copytree(pf.out, killed)
    shutil.rmtree(killed / ckpt.DIRNAME / "round-000002")
    for f in ("results.json", "results.csv"):
        (killed / f).unlink()
    with pytest.raises(fedsplice.ConfigError, match="no results.json"):
        fedsplice.load_result(killed)
    res = fedsplice.resume(killed)
    assert res.out == killed and _without_time(res.raw) == _without_time(pf.raw)
    assert [{k: v for k, v in r.items() if k != "time_s"} for r in res.records()] == \
        [{k: v for k, v in r.items() if k != "time_s"} for r in pf.records()]
    # an existing run directory is refused without overwrite
    with pytest.raises(fedsplice.ConfigError, match="--overwrite"):
        fedsplice.run(pf.config(), killed)


# ----------------------------------------------------------------------------- configs


def test_load_config_overrides_both_forms(example):
    _, root, _ = example
    tiny = root / "tiny.toml"
    a = fedsplice.load_config(tiny, ["server.rounds=3", "algorithm=lora", "method={}", 'peft.roles=["q", "v"]',
                                     "client.lr=0.5", "runtime.cache=false"])
    b = fedsplice.load_config(str(tiny), {"server.rounds": 3, "algorithm": "lora", "method": {},
                                          "peft.roles": ("q", "v"), "client.lr": 0.5, "runtime.cache": False})
    assert dataclasses.asdict(a) == dataclasses.asdict(b)
    assert (a.server.rounds, a.algorithm, a.peft.roles, a.client.lr, a.runtime.cache) == (3, "lora", ["q", "v"], 0.5,
                                                                                          False)
    c = fedsplice.load_config(tiny, {"method": {"global_roles": ["q"], "ortho_lambda": 0.0}})
    assert c.method == {"global_roles": ["q"], "ortho_lambda": 0.0}
    assert fedsplice.load_config(tiny, "server.rounds=4").server.rounds == 4  # one item as a str
    # strings stay strings, whatever they look like
    assert fedsplice.load_config(tiny, {"data.class_prompt": "[1, 2] {label}"}).data.class_prompt == "[1, 2] {label}"
    d = fedsplice.load_config(None)  # the embedded default
    assert (d.algorithm, d.model.name, d.data.dataset) == ("pfadapter", "zoo:minilm", "fortunes")


@pytest.mark.parametrize("overrides, field", [
    (["server.roundz=2"], "server.roundz"),
    ({"server.rounds": "two"}, "server.rounds"),
    ({"server.rounds": 0}, "server.rounds"),
    (["algorithm=nosuch"], "nosuch"),
    (["method.ortho_lambdaa=1"], "method.ortho_lambdaa"),
    ({"client.lr": None}, "client.lr"),
    ({"seed": object()}, "seed"),
])
def test_bad_override_raises_config_error_naming_the_field(overrides, field):
    with pytest.raises(fedsplice.ConfigError) as e:
        fedsplice.load_config(None, overrides)
    assert field in str(e.value)
    assert isinstance(e.value, fedsplice.FedspliceError)


def test_run_validates_an_edited_config(example, tmp_path):
    _, root, _ = example
    cfg = fedsplice.load_config(root / "tiny.toml")
    cfg.server.clients_per_round = 99
    with pytest.raises(fedsplice.ConfigError, match="clients_per_round"):
        fedsplice.run(cfg, tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_flower_config_goes_to_the_flower_launcher(example, tmp_path, monkeypatch):
    """runtime.kind = "flower" takes the path of `fedsplice run`: app.flower.cli.run_flower."""
    ns, root, _ = example
    calls = []

    def fake_run_flower(cfg, out, overwrite=False, quiet=False, **kw):
        calls.append((cfg.runtime.kind, Path(out), overwrite, quiet, kw))
        shutil.copytree(ns["pf"].out, out)  # as if the SuperNodes had run it
        return json.loads((Path(out) / "results.json").read_text())

    monkeypatch.setattr("fedsplice.app.flower.cli.run_flower", fake_run_flower)
    monkeypatch.setattr("fedsplice.app.runner.run_experiment", lambda *a, **k: pytest.fail("ran in-process"))
    cfg = fedsplice.load_config(root / "tiny.toml", ["runtime.kind=flower"])
    res = fedsplice.run(cfg, tmp_path / "fl", quiet=False)
    assert calls == [("flower", tmp_path / "fl", False, False, {})]
    assert res.raw == ns["pf"].raw and res.out == tmp_path / "fl"


# ----------------------------------------------------------------------------- algorithms


def test_register_and_list_algorithms(example, tmp_path, monkeypatch):
    _, root, _ = example
    monkeypatch.setattr(registry, "ALGORITHMS", dict(registry.ALGORITHMS))  # this test's registrations only
    listed = fedsplice.list_algorithms()
    assert list(listed)[:len(registry.ALGORITHMS)] == list(registry.ALGORITHMS)
    assert {"pfadapter", "fedpurel", "lora", "fedper", "local"} <= set(listed)
    assert listed["pfadapter"].params.__name__ == "PFAdapterParams" and listed["fedper"].paper

    def q_only(p: NoParams, spec) -> Recipe:
        """only q LoRA shared"""
        return Recipe({n: S.GLOBAL if i.role == "q" else S.PRIVATE for n, i in spec.infos.items()})

    algo = fedsplice.register_algorithm("q-only", NoParams, q_only)
    assert fedsplice.list_algorithms()["q-only"] is algo and algo.description == "only q LoRA shared"
    with pytest.raises(fedsplice.ConfigError, match="already registered"):
        fedsplice.register_algorithm("q-only", NoParams, q_only)
    res = fedsplice.run(fedsplice.load_config(root / "tiny.toml", ["algorithm=q-only", "method={}",
                                                                    "server.rounds=1"]), tmp_path / "q")
    total = sum(fedsplice.load_result(root / "runs/api/lora").params.values())
    assert res.params == {"global": total // 4, "private": 3 * total // 4}
    assert res.algorithm == "q-only"


# ----------------------------------------------------------------------------- the package


@pytest.mark.integration
def test_import_is_lazy_and_cheap():
    code = ("import sys, fedsplice; assert fedsplice.__version__; "
            "heavy = [m for m in ('torch', 'transformers', 'fedsplice.app.api', 'fedsplice.app') if m in sys.modules]; "
            "assert not heavy, heavy; fedsplice.run; assert 'fedsplice.app.api' in sys.modules; "
            "import fedsplice.version as v; assert v.__version__ == fedsplice.__version__")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert fedsplice.__version__ == api_version()
    assert set(fedsplice.__all__) == {"__version__", *api.__all__}
    for name in api.__all__:
        assert getattr(fedsplice, name) is getattr(api, name)
        assert name in dir(fedsplice)
    with pytest.raises(AttributeError, match="nosuch"):
        _ = fedsplice.nosuch


def api_version() -> str:
    from fedsplice.version import __version__

    return __version__


def test_no_module_imports_the_top_package():
    """`from fedsplice import X` where X is not a submodule is an edge back to the package: with the
    lazy API in fedsplice/__init__.py it would be an import cycle."""
    src = ROOT / "src" / "fedsplice"
    offenders = []
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "fedsplice" and node.level == 0:
                for a in node.names:
                    if not ((src / a.name).is_dir() or (src / f"{a.name}.py").is_file()):
                        offenders.append(f"{path.relative_to(src)}: from fedsplice import {a.name}")
            if isinstance(node, ast.Import) and any(a.name == "fedsplice" for a in node.names):
                offenders.append(f"{path.relative_to(src)}: import fedsplice")
    assert offenders == []


def _plain_signature(fn) -> str:
    """`(a, b=None, *, c=False)`: the signature without annotations, classes by their name."""
    params = []
    for p in inspect.signature(fn).parameters.values():
        default = p.default
        if default is not p.empty and isinstance(default, type):
            default = _Name(default.__name__)
        params.append(p.replace(annotation=inspect.Parameter.empty, default=default))
    return str(inspect.Signature(params))


class _Name:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return self.name


def test_doc_lists_every_public_name_with_its_signature():
    doc = DOC.read_text()
    for name in fedsplice.__all__:
        obj = getattr(fedsplice, name)
        if inspect.isfunction(obj):
            heading = f"### `fedsplice.{name}{_plain_signature(obj)}`"
        else:
            heading = f"`fedsplice.{name}`"
        assert heading in doc, heading
    for cls in (fedsplice.RunResult, fedsplice.CompareRow):  # every field in the doc's table
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in doc, (cls.__name__, f.name)
