"""Regression set: every shipped config (and the embedded default), run on a tiny budget through
`python -m fedsplice run` with this interpreter (the installed package), gives the same
metrics.jsonl and results.json as recorded in tests/regression/golden, apart from the
wall-clock `time_s` fields: keys, strings, integers and lengths exactly, floats within the
config's measured cross-CPU tolerance (scripts/regression.py: FLOAT_TOL, VLM_TOL). Each config
runs twice at once, with this CPU's kernels and with torch/MKL/oneDNN/numpy held to AVX2, so a
golden that holds here holds on a CPU without AVX-512 too. Re-record with `python
scripts/regression.py record --out-dir tests/regression/golden` only when a change of the
numbers is intended.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "regression" / "golden"


def _load_script():
    spec = importlib.util.spec_from_file_location("fedsplice_regression", ROOT / "scripts" / "regression.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


regression = _load_script()
# Every config, and every recorded folder: a config without a golden folder, or a golden
# folder without a config, fails too.
STEMS = sorted(set(regression.stems()) | {p.name for p in GOLDEN.iterdir() if p.is_dir()})


@pytest.mark.real_weights
@pytest.mark.parametrize("stem", STEMS)
def test_config_matches_golden(stem):
    if stem not in regression.stems():
        pytest.fail(f"{GOLDEN / stem}: golden folder without a config in configs/ (record the set again)")
    try:
        diff = regression.check_one(stem, GOLDEN)
    except RuntimeError as e:  # the run itself failed: its command and the end of its stderr
        pytest.fail(f"the run of {stem} failed:\n{e}", pytrace=False)
    if diff is not None:
        pytest.fail(f"{stem} differs from {GOLDEN / stem}: {diff}", pytrace=False)


# ----------------------------------------------------------------------------- the comparison itself


def _write(folder: Path, records: list[dict], results: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(regression.json.dumps(r, sort_keys=True) + "\n" for r in records))
    (folder / "results.json").write_text(regression.json.dumps(results, sort_keys=True, indent=1) + "\n")
    return folder


def test_floats_within_tolerance_everything_else_exact(tmp_path):
    rec = [{"round": 0, "gm": {"accuracy": 0.5, "tkl": 1e-8}}, {"round": 1, "task_loss": 4.650650084018707}]
    g = _write(tmp_path / "g", rec, {"gm": {"accuracy": 0.5}, "clients": [1, 2]})
    # the AVX2 EPYC's round-1 loss (1.7e-6 relative) and round-0 TKL noise: the same within 1e-5
    near = [{"round": 0, "gm": {"accuracy": 0.5, "tkl": 3e-9}}, {"round": 1, "task_loss": 4.650641977787018}]
    assert regression.first_difference(
        g, _write(tmp_path / "a", near, {"gm": {"accuracy": 0.5}, "clients": [1, 2]})) is None
    # ... but not within the old 1e-6
    assert "task_loss" in regression.first_difference(g, tmp_path / "a", tol=1e-6)
    far = [rec[0], {"round": 1, "task_loss": 4.6507}]  # 1.1e-5 relative
    diff = regression.first_difference(g, _write(tmp_path / "b", far, {"gm": {"accuracy": 0.5}, "clients": [1, 2]}))
    assert diff.startswith("metrics.jsonl line 2, field task_loss (golden 4.650650084018707, now 4.6507)")
    # integers, lengths and keys stay exact
    diff = regression.first_difference(g, _write(tmp_path / "c", rec, {"gm": {"accuracy": 0.5}, "clients": [1, 3]}))
    assert diff == "results.json, field clients[1] (golden 2, now 3)"
    extra = [rec[0], {**rec[1], "purified_steps": 0.5}]
    diff = regression.first_difference(g, _write(tmp_path / "d", extra, {"gm": {"accuracy": 0.5}, "clients": [1, 2]}))
    assert "field purified_steps (golden \"<absent>\", now 0.5)" in diff


def test_purification_geometry_has_its_own_tolerance(tmp_path):
    # fedpurel-lora-fortunes' measured avx2 difference of purify_cos (3.2e-5) passes; beyond 1e-3 not,
    # and other fields keep FLOAT_TOL
    g = _write(tmp_path / "g", [{"round": 1, "purify_cos": -0.05921103269793093, "task_loss": 1.0}], {})
    near = _write(tmp_path / "a", [{"round": 1, "purify_cos": -0.05917878006584942, "task_loss": 1.0}], {})
    assert regression.first_difference(g, near) is None
    far = _write(tmp_path / "b", [{"round": 1, "purify_cos": -0.0579, "task_loss": 1.0}], {})
    assert "field purify_cos" in regression.first_difference(g, far)
    loss = _write(tmp_path / "c", [{"round": 1, "purify_cos": -0.05921103269793093, "task_loss": 1.0001}], {})
    assert "field task_loss" in regression.first_difference(g, loss)


def test_left_out_values_keep_their_structure(tmp_path):
    rec = [{"round": 1, "task_loss": 1.0}]
    g = _write(tmp_path / "g", rec, {"cold_start": {"accuracy": [0.25, 0.5], "clients": [8, 9]}})
    flip = _write(tmp_path / "a", rec, {"cold_start": {"accuracy": [0.25, 1.0], "clients": [8, 9]}})
    left = frozenset({"cold_start"})
    assert regression.first_difference(g, flip, left_out=left) is None
    assert "cold_start.accuracy[1]" in regression.first_difference(g, flip)
    shorter = _write(tmp_path / "b", rec, {"cold_start": {"accuracy": [0.25], "clients": [8, 9]}})
    assert regression.first_difference(g, shorter, left_out=left) is not None
    assert regression.spread(g, flip) == (0.5, "results.json:1 cold_start.accuracy[1]", 0)
    assert regression.spread(g, flip, left) == (0.0, "-", 0)


def test_tolerance_per_config():
    assert regression.tolerance("fedpurel-lora-fortunes") == (regression.FLOAT_TOL, frozenset())
    assert regression.tolerance("default") == (regression.FLOAT_TOL, frozenset())
    assert regression.tolerance("pfadapter-easyvqa") == (regression.VLM_TOL, frozenset({"cold_start"}))
    assert regression.tolerance("pfadapter-smollm2")[0] == regression.FLOAT_TOL  # text: as tight as MiniLM


@pytest.mark.integration
def test_the_avx2_kernels_are_really_used():
    # the check under "avx2" means something only if torch's dispatch follows the variable
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**regression.os.environ, **regression.ISAS["avx2"]}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "AVX2"
