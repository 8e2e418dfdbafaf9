"""Bad configs and bad paths fail before training, as one line on stderr and exit code 2.

A hypothesis property test mutates the shipped configs (configs/*.toml) 200 ways — wrong types,
out-of-range and non-finite values, unknown keys, removed keys and sections, tables replaced by
scalars — and checks that `fedsplice validate` either accepts the result or exits 2 with one
line and no traceback. A smaller sample of mutations is *run* (on the tiny BERT and the toy data
set, with a tiny budget) with the same contract. Path checks (unwritable or full output folder,
an existing run directory, a missing asset) follow.
"""

import contextlib
import io
import json
import shutil
import tomllib
from collections import namedtuple
from pathlib import Path

import pytest
import tomli_w
from conftest import MICRO_BUDGET, as_table, set_args, zoo_as_tiny
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fedsplice.app.cli import main
from fedsplice.config import ExperimentConfig
from fedsplice.config import load_config as parse_config  # parse + the leaf checks only
from fedsplice.federation.validate import load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.toml"))
SHIPPED = [tomllib.loads(p.read_text()) for p in CONFIGS]


def _known_paths() -> list[tuple[str, ...]]:
    """Every field of the config dataclasses, plus every key present in a shipped config."""
    import dataclasses

    paths = set()
    for f in dataclasses.fields(ExperimentConfig):
        paths.add((f.name,))
        if dataclasses.is_dataclass(f.default_factory) if f.default_factory is not dataclasses.MISSING else False:
            paths.update((f.name, g.name) for g in dataclasses.fields(f.default_factory))
    for table in SHIPPED:
        for k, v in table.items():
            paths.add((k,))
            if isinstance(v, dict):
                paths.update((k, kk) for kk in v)
    paths.update([("method", "mu"), ("method", "selective_aggregation"), ("bogus",), ("server", "roundz"),
                  ("faults", "nonsense"), ("model", "")])
    return sorted(paths)


PATHS = _known_paths()

scalars = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 2, 3, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 0.5, 1.0, 1e-12, 1e300, float("nan"), float("inf")]),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["fedavg", "lora", "pfadapter", "local", "zoo:minilm", "zoo:nope", "q", "median",
                     "jsonl:/nonexistent.jsonl", "{label}", "{text}", "disk", "dual_encoder"]),
)
values = st.one_of(scalars, st.lists(scalars, max_size=4), st.dictionaries(st.text(max_size=5), scalars, max_size=2))

Mutation = namedtuple("Mutation", "kind path value")
mutations = st.one_of(
    st.builds(Mutation, st.just("set"), st.sampled_from(PATHS), values),
    st.builds(Mutation, st.just("remove"), st.sampled_from(PATHS), st.none()),
)


def _apply(table: dict, muts) -> dict:
    t = json.loads(json.dumps(table))  # a deep copy (shipped configs are plain TOML data)
    for m in muts:
        node = t
        for p in m.path[:-1]:
            if not isinstance(node.get(p), dict):
                if m.kind == "remove":
                    break
                node[p] = {}
            node = node[p]
        else:
            if m.kind == "remove":
                node.pop(m.path[-1], None)
            else:
                node[m.path[-1]] = m.value
    return t


def _cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _check_contract(rc: int, out: str, err: str, what) -> None:
    assert "Traceback" not in out + err, what
    assert rc in (0, 2), (rc, err, what)
    if rc == 2:
        lines = [s for s in err.splitlines() if s.strip()]
        assert len(lines) == 1 and lines[0].startswith("fedsplice: error:"), (err, what)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, len(SHIPPED) - 1), muts=st.lists(mutations, min_size=1, max_size=3))
def test_mutated_shipped_configs_validate_or_exit_2(tmp_path_factory, tiny_bert_dir, tiny_llama_dir, which, muts):
    table = _apply(SHIPPED[which], muts)
    path = tmp_path_factory.mktemp("fuzz") / "c.toml"
    try:
        path.write_text(tomli_w.dumps(table))
    except (TypeError, ValueError) as e:  # not representable as TOML
        event(f"not TOML: {type(e).__name__}")
        return
    what = (CONFIGS[which].name, muts)
    with zoo_as_tiny(tiny_bert_dir, tiny_llama_dir):  # the config and its plan: data reading has its own tests
        rc, out, err = _cli(["validate", "--no-data", str(path)])
    event(f"validate rc={rc}")
    _check_contract(rc, out, err, what)
    if rc == 0:
        assert out.splitlines()[-1].startswith("ok:")
        load_config(path)  # and it really loads


# ----------------------------------------------------------------------------- a sample, run for real

TINY = as_table(MICRO_BUDGET)
# mutate what does not set the budget, with values a tiny run can afford
RUN_PATHS = [p for p in PATHS if p not in {("server", "rounds"), ("data", "num_clients"), ("client", "max_steps"),
                                           ("client", "local_epochs"), ("eval", "cold_start_epochs"),
                                           ("data", "test_per_class"), ("data", "local_test_size"),
                                           ("model", "max_length"), ("peft", "r"), ("runtime", "threads"),
                                           ("data", "dataset"), ("model", "name"), ("data", "max_per_class"),
                                           ("runtime", "checkpoint_every"), ("server", "max_retries")}]
small = st.one_of(st.integers(-2, 4), st.floats(-1.0, 2.0), st.sampled_from([float("nan"), 0.0, 0.5]),
                  st.booleans(), st.sampled_from(["q", "lora", "median", "trimmed_mean", "fedyogi", "x"]),
                  st.lists(st.sampled_from(["q", "k", "v", "o", 0, 1, 7]), max_size=3))
run_mutations = st.one_of(st.builds(Mutation, st.just("set"), st.sampled_from(RUN_PATHS), small),
                          st.builds(Mutation, st.just("remove"), st.sampled_from(RUN_PATHS), st.none()))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          database=None)
@given(which=st.integers(0, len(SHIPPED) - 1), muts=st.lists(run_mutations, min_size=1, max_size=2))
def test_mutated_configs_run_tiny_or_exit_2(tmp_path_factory, tiny_bert_dir, toy_jsonl, which, muts):
    # causal-LM task on the tiny BERT would only test the model; a CUDA config only the device
    if "smollm2" in CONFIGS[which].name or SHIPPED[which].get("runtime", {}).get("device", "").startswith("cuda"):
        which = 0
    base = json.loads(json.dumps(SHIPPED[which]))
    for section, fields in TINY.items():
        base.setdefault(section, {}).update(fields)
    base["model"]["name"] = str(tiny_bert_dir)
    base["data"]["dataset"] = f"jsonl:{toy_jsonl}"
    table = _apply(base, muts)
    d = tmp_path_factory.mktemp("fuzzrun")
    (d / "c.toml").write_text(tomli_w.dumps(table))
    rc, out, err = _cli(["run", str(d / "c.toml"), "--out", str(d / "out"), "--quiet"])
    event(f"run rc={rc}")
    _check_contract(rc, out, err, muts)
    if rc == 0:  # results.json agrees with the resolved config and with metrics.jsonl
        r = json.loads((d / "out" / "results.json").read_text())
        ran = parse_config(d / "out" / "config.toml")
        want = 0 if ran.algorithm in ("zeroshot", "majority", "local-prior") else ran.server.rounds  # train nothing
        assert r["rounds"] == want, (r["rounds"], want, muts)
        recs = [json.loads(x) for x in (d / "out" / "metrics.jsonl").read_text().splitlines()]
        assert sorted({x["round"] for x in recs}) == list(range(want + 1)), muts


# ----------------------------------------------------------------------------- paths, before training


def _tiny_args(tiny_bert_dir, toy_jsonl):
    return [*set_args(MICRO_BUDGET, model__name=f"'{tiny_bert_dir}'", data__dataset=f"'jsonl:{toy_jsonl}'"),
            "--quiet"]


@pytest.fixture
def no_training(monkeypatch):
    """Fail the test if a client ever trains."""
    from fedsplice.runtimes import inprocess as simulation

    def boom(*a, **k):
        raise AssertionError("training started")

    monkeypatch.setattr(simulation, "fit_client", boom)


def _one_line(argv) -> str:
    rc, out, err = _cli(argv)
    _check_contract(rc, out, err, argv)
    assert rc == 2, err
    return err.strip()


def test_unwritable_out_is_refused_before_training(tmp_path, tiny_bert_dir, toy_jsonl, no_training):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    line = _one_line(["run", "--out", str(blocker / "run"), *_tiny_args(tiny_bert_dir, toy_jsonl)])
    assert "--out" in line and "not a directory" in line
    probe = Path("/proc/fedsplice-cannot-write-here")  # procfs refuses new files, even to root
    if probe.parent.is_dir():
        line = _one_line(["run", "--out", str(probe), *_tiny_args(tiny_bert_dir, toy_jsonl)])
        assert "cannot write" in line
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        import os

        if not os.access(ro, os.W_OK):  # not root: permissions apply
            line = _one_line(["run", "--out", str(ro / "run"), *_tiny_args(tiny_bert_dir, toy_jsonl)])
            assert "cannot write" in line
    finally:
        ro.chmod(0o700)


def test_full_disk_is_refused_before_training(tmp_path, tiny_bert_dir, toy_jsonl, monkeypatch, no_training):
    from fedsplice.federation import checkpoint

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 10**5, 10**5))
    line = _one_line(["run", "--out", str(tmp_path / "run"), *_tiny_args(tiny_bert_dir, toy_jsonl)])
    assert "MB free" in line and "--out" in line
    assert not (tmp_path / "run").exists()
    # enough for the start but not for the checkpoints this run will keep: refused after the
    # build, still before any client trains
    monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                        lambda p: Usage(10**9, 0, checkpoint.MIN_FREE + 10))
    line = _one_line(["run", "--out", str(tmp_path / "run2"), *_tiny_args(tiny_bert_dir, toy_jsonl)])
    assert "checkpoints" in line and not (tmp_path / "run2" / "metrics.jsonl").exists()


def test_existing_run_dir_and_missing_assets_are_refused(tmp_path, tiny_bert_dir, toy_jsonl, no_training):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    assert "--overwrite" in _one_line(["run", "--out", str(out), *_tiny_args(tiny_bert_dir, toy_jsonl)])
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    missing_model = tmp_path / "gone"
    shutil.copytree(tiny_bert_dir, missing_model)
    (missing_model / "model.safetensors").unlink()
    line = _one_line(["run", "--out", str(tmp_path / "r2"), *_tiny_args(tiny_bert_dir, toy_jsonl),
                      "--set", f"model.name='{missing_model}'"])
    assert "model.name" in line
    line = _one_line(["run", "--out", str(tmp_path / "r3"), *_tiny_args(tiny_bert_dir, toy_jsonl),
                      "--set", f"data.dataset='jsonl:{tmp_path / 'none.jsonl'}'"])
    assert "none.jsonl" in line
