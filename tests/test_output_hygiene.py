"""Output hygiene: every JSON file a run writes is strict JSON (an undefined metric is null,
never Python's bare NaN token), and every file respects the umask (mkstemp's 0600 and
mkdtemp's 0700 are widened to what a plain open()/mkdir() would give)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsplice.data.assets import atomic_write_json, atomic_write_text, current_umask, dumps, strict_json


def _no_constant(name):
    raise AssertionError(f"non-strict JSON constant {name}")


def strict_loads(text: str):
    return json.loads(text, parse_constant=_no_constant)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _assert_modes(root: Path, mask: int) -> list[Path]:
    """Every file under root has 0666 & ~mask, every folder 0777 & ~mask; returns the files."""
    files = []
    for p in [root, *root.rglob("*")]:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert _mode(p) == want, f"{p.relative_to(root.parent)}: {oct(_mode(p))}, expected {oct(want)}"
        if p.is_file():
            files.append(p)
    return files


# ----------------------------------------------------------------------------- strict JSON


def test_strict_json_replaces_every_non_finite_float():
    obj = {"nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"), "f32": np.float32("nan"),
           "ok": np.float64(0.5), "i": np.int64(3), "b": np.bool_(True), "arr": np.array([1.0, np.nan]),
           "nested": [1, (2.0, float("nan")), {"deep": [np.float32("inf"), "s", None]}]}
    got = strict_json(obj)
    assert got == {"nan": None, "inf": None, "ninf": None, "f32": None, "ok": 0.5, "i": 3, "b": True,
                   "arr": [1.0, None], "nested": [1, [2.0, None], {"deep": [None, "s", None]}]}
    assert type(got["ok"]) is float and type(got["i"]) is int and type(got["b"]) is bool
    assert strict_loads(dumps(obj, indent=2)) == got
    assert strict_json({"x": 1.5}) == {"x": 1.5}


def test_atomic_write_json_and_metrics_log_are_strict(tmp_path):
    from fedsplice.app import rundir

    atomic_write_json(tmp_path / "a.json", {"auc": float("nan"), "v": [np.float32("inf")]})
    assert strict_loads((tmp_path / "a.json").read_text()) == {"auc": None, "v": [None]}
    log = rundir.MetricsLog(tmp_path / "metrics.jsonl")
    log.append({"round": 1, "pm": {"accuracy": 0.5, "auc": float("nan")}})
    log.append({"round": 2, "pm": {"accuracy": np.float64(0.75), "auc": np.float32("nan")}})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [strict_loads(s)["pm"]["auc"] for s in lines] == [None, None]
    assert log.records()[1]["pm"] == {"accuracy": 0.75, "auc": None}


def test_flower_logs_are_strict(tmp_path):
    from fedsplice.runtimes.flower.records import strict_record
    from fedsplice.runtimes.flower.transport import JsonLog

    log = JsonLog(tmp_path / "events.jsonl")
    log({"event": "x", "a": float("nan"), "b": np.float32("inf"), "t": torch.tensor(float("nan")),
         "ok": torch.tensor(2.0), "l": [np.int64(1), (float("-inf"),)]})
    rec = strict_loads((tmp_path / "events.jsonl").read_text())
    assert {k: rec[k] for k in ("a", "b", "t", "ok", "l")} == {"a": None, "b": None, "t": None, "ok": 2.0,
                                                               "l": [1, [None]]}
    assert strict_record({"x": np.float64(1.0)}) == {"x": 1.0}


def test_readers_print_undefined_metrics_as_na(tmp_path):
    """A run directory whose metrics are null: report and RunResult show n/a, not a crash."""
    from fedsplice.app import report, rundir
    from fedsplice.app.api import load_result

    m = {"accuracy": None, "f1_macro": float("nan"), "balancedness": None}
    res = {"algorithm": "a", "dataset": "d", "model": "m", "rounds": 1, "seed": 0, "gm": m, "pm": m,
           "communication": {"up_bytes": 1, "up_bytes_per_round": 1.0}, "params": {}, "random_weights": []}
    rundir.write_results(tmp_path, res)
    rundir.MetricsLog(tmp_path / "metrics.jsonl").append({"round": 1, "gm": m, "pm": m, "up_bytes": 1})
    page = report.render(tmp_path)
    assert "n/a" in page
    assert "GM acc n/a, PM acc n/a" in repr(load_result(tmp_path))
    rundir.plot_accuracy(tmp_path, [{"round": 1, "gm": m, "pm": m}], "t")  # a gap, not a crash


# ----------------------------------------------------------------------------- umask


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_atomic_writes_respect_the_umask(tmp_path, mask):
    from fedsplice.federation.store import DiskStore

    with umask(mask):
        assert current_umask() == mask
        atomic_write_json(tmp_path / "d" / "a.json", {"x": 1})
        atomic_write_text(tmp_path / "d" / "b.txt", "hi")
        atomic_write_text(tmp_path / "d" / "b.txt", "again")  # a replaced file too
        DiskStore(tmp_path / "d" / "store").put(3, {"w": torch.ones(2)})
    files = _assert_modes(tmp_path / "d", mask)
    assert len(files) == 3
    assert _mode(files[0]) == {0o022: 0o644, 0o077: 0o600}[mask]


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_checkpoints_are_strict_and_respect_the_umask(tmp_path, mask):
    from fedsplice.federation import checkpoint as ckpt
    from fedsplice.federation.store import MemoryStore
    from fedsplice.federation.validate import load_config

    cfg = load_config(None, [])
    store = MemoryStore()
    store.put(0, {"p": torch.zeros(3)})
    state = ckpt.RoundState(1, {"g": torch.ones(2)}, {"s": torch.zeros(1)}, 10, 20)
    with umask(mask):
        path = ckpt.Checkpointer(tmp_path / "run", cfg, [[0]], keep=2).save(state, store, [dumps({"auc": None})])
    _assert_modes(tmp_path / "run", mask)
    meta = strict_loads((path / "state.json").read_text())
    assert meta["round"] == 1 and meta["clients"] == [0]
    assert _mode(path) == 0o777 & ~mask  # the renamed mkdtemp folder, not 0700


# ----------------------------------------------------------------------------- a whole run


@pytest.fixture(scope="module")
def binary_jsonl(toy_jsonl, tmp_path_factory) -> Path:
    """The toy data set without one class: binary, so the AUC is computed."""
    lines = [s for s in toy_jsonl.read_text().splitlines() if json.loads(s)["label"] != "music"]
    path = tmp_path_factory.mktemp("binary") / "binary.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_run_outputs_are_strict_json_and_respect_the_umask(cfg_factory, tiny_bert_dir, binary_jsonl, tmp_path):
    """A binary run where a client's local test set has one class: its AUC, and so PM auc, is
    undefined, and it is null in results.json and metrics.jsonl; every file is 0644 under 0022."""
    from fedsplice.app.runner import run_experiment

    cfg = cfg_factory(tiny_bert_dir, binary_jsonl, data__alpha="0.05", runtime__store='"disk"')
    out = tmp_path / "run"
    with umask(0o022):
        run_experiment(cfg, out, quiet=True)
    results = strict_loads((out / "results.json").read_text())
    assert "auc" in results["pm"] and results["pm"]["auc"] is None
    assert isinstance(results["gm"]["auc"], float)  # the balanced global test set: defined
    records = [strict_loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("pm", {}).get("auc", 0.0) is None for r in records)
    for p in out.rglob("*.json*"):  # scenario.json, checkpoint state.json and metrics.jsonl too
        for text in (p.read_text().splitlines() if p.suffix == ".jsonl" else [p.read_text()]):
            strict_loads(text)
    files = {p.relative_to(out).as_posix() for p in _assert_modes(out, 0o022)}
    assert {"results.json", "metrics.jsonl", "results.csv", "config.toml", "accuracy.png"} <= files
    assert any(f.startswith("checkpoints/round-") for f in files)
    assert any(f.startswith("client_state/") for f in files)


def test_printed_lines_are_not_wrapped_into_a_file(capsys):
    # rich wraps at 80 columns when stdout is no terminal; a run's log in a file keeps its lines
    from fedsplice.app.console import make_console
    from fedsplice.app.summary import print_table

    res = {"algorithm": "pfadapter", "dataset": "csv:/data/a-long-folder-name/food-reviews-5000.csv", "rounds": 3,
           "gm": {"accuracy": 0.5932, "f1_macro": 0.5}, "pm": {"accuracy": 0.775, "f1_macro": 0.7, "accuracy_std": 0.1,
                                                             "accuracy_min": 0.5},
           "communication": {"up_bytes": 1e6, "up_bytes_per_round": 3.3e5, "down_bytes": 1e6}}
    print_table(res)
    lines = capsys.readouterr().out.splitlines()
    assert any(f"pfadapter — {res['dataset']}, 3 rounds" in ln for ln in lines)  # the title: one line
    print_table({**res, "rounds": 1})
    assert f"{res['dataset']}, 1 round\n" in capsys.readouterr().out
    assert any("upload 1.00 MB total, 330.0 kB/round; download 1.00 MB" in ln for ln in lines)
    make_console().print("x" * 300)
    assert capsys.readouterr().out == "x" * 300 + "\n"
