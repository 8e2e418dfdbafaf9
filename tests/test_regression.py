"""Regression set: every shipped config (and the embedded default), run on a tiny budget through
`python -m fedsplice run` with this interpreter (the installed package), gives the same
metrics.jsonl and results.json as recorded in tests/regression/golden (floats within the
script's FLOAT_TOL), apart from the wall-clock `time_s` fields. See scripts/regression.py for
the budget (its --set overrides) and the normalisation; re-record with `python
scripts/regression.py record --out-dir tests/regression/golden` only when a change of the numbers is intended.
"""

from __future__ import annotations

import importlib.util
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


@pytest.mark.slow
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
