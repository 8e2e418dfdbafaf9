"""The shape of the house (docs/design.md §9-§10): the layer contracts, file and function sizes."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "fedsplice"
MAX_FILE, MAX_FUNC = 400, 60
# a file or function may be longer only if its docstring says why, starting with this phrase
WHY = "Longer than"


@pytest.mark.integration
def test_import_contracts_hold():
    """.importlinter: layers, config a leaf, core pure, runtimes on federation's public API, no cycles."""
    lint = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "BROKEN" not in r.stdout and r.stdout.count("KEPT") >= 7


@pytest.mark.integration
def test_ruff_is_clean_on_src_and_tests():
    """ruff (pyproject's [tool.ruff]: pycodestyle, pyflakes, bugbear; 120 columns) finds nothing in
    src/ or tests/."""
    ruff = Path(sys.executable).parent / "ruff"
    r = subprocess.run([str(ruff), "check", "--no-cache", "src", "tests"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.integration
def test_mypy_is_clean_on_src():
    """mypy on pyproject's [tool.mypy] packages: all of src/fedsplice, every file counted."""
    mypy = Path(sys.executable).parent / "mypy"
    r = subprocess.run([str(mypy), "--no-incremental"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Success" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]
    import re

    checked = int(re.search(r"in (\d+) source files", r.stdout).group(1))
    assert checked >= len(list(SRC.rglob("*.py"))), r.stdout  # no file left out


STATE_PROBE = """
from dataclasses import dataclass

import numpy as np

from fedsplice.algorithms import ClientOps, Exchange, ModelSpec, Personal, Recipe
from fedsplice.algorithms.hooks import Tensors


@dataclass
class Mine:
    rank: int = 0


@dataclass
class Other:
    name: str = ""


def receive(ops: ClientOps, rnd: int, received: Tensors, st: Mine) -> tuple[Tensors, Mine]:
    return received, st


def predict(ops: ClientOps, params: Tensors, st: {state}) -> np.ndarray:
    return np.zeros(1)


def build(p: object, spec: ModelSpec) -> Recipe[Mine]:
    return Recipe({{}}, personalize=Personal(predict=predict), exchange=Exchange(receive), state=Mine)
"""


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_mypy_checks_a_methods_hooks_against_its_state(tmp_path):
    """Issue 49: a build annotated `-> Recipe[Mine]` whose predict hook reads another state type is
    a mypy error; the same method with hooks that agree passes."""
    mypy = Path(sys.executable).parent / "mypy"
    out = {}
    for state in ("Other", "Mine"):
        (tmp_path / "probe.py").write_text(STATE_PROBE.format(state=state))
        r = subprocess.run([str(mypy), "--cache-dir", str(tmp_path / "cache"), "--ignore-missing-imports",
                            "probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=500,
                           env={**os.environ, "MYPYPATH": str(ROOT / "src")})
        out[state] = r
    bad = out["Other"].stdout
    assert out["Other"].returncode == 1 and 'expected "Predict[Mine] | None"' in bad, bad
    assert out["Mine"].returncode == 0, out["Mine"].stdout


def _sizes():
    for p in sorted(SRC.rglob("*.py")):
        tree = ast.parse(p.read_text())
        n = len(p.read_text().splitlines())
        yield p, tree, n


def test_files_are_short_or_say_why():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p, tree, n in _sizes()
            if n > MAX_FILE and WHY not in (ast.get_docstring(tree) or "")]
    assert not long, f"files over {MAX_FILE} lines without a '{WHY} …' reason in their docstring: {long}"


def test_functions_are_short_or_say_why():
    long = []
    for p, tree, _ in _sizes():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNC and WHY not in (ast.get_docstring(node) or ""):
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({size} lines)")
    assert not long, f"functions over {MAX_FUNC} lines without a '{WHY} …' reason in their docstring: {long}"


@pytest.mark.parametrize("where, bad, rule", [
    ("config/checks.py", "from fedsplice.federation import build\n", "config is a leaf"),
    ("core/split.py", "import transformers\n", "core imports only torch and numpy"),
    ("app/compare.py", "from fedsplice.study import stats\n", "the library never imports the study"),
])
@pytest.mark.integration
def test_the_contracts_can_fail(tmp_path, where, bad, rule):
    """The linter really reads our tree: an upward import in a copy of it breaks a contract."""
    import shutil

    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "fedsplice", copy / "fedsplice", ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / "fedsplice" / where
    target.write_text(target.read_text() + "\n" + bad)
    lint = Path(sys.executable).parent / "lint-imports"
    r = subprocess.run([str(lint), "--config", str(ROOT / ".importlinter")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and f"{rule}" in r.stdout and "BROKEN" in r.stdout, r.stdout[-3000:]


GENERIC = ("model", "federation", "core", "runtimes", "config", "data")  # no method is named in their code
METHOD = (r"fedotp|fedpgp|pfedlora|feddpa|fedpurel|pfadapter|promptfolio|fedclip|promptfl|fedsa|fedper|fedprox|"
          r"fedrep|cliplora|hetlora|flora")


def _method_branches(tree: ast.AST, path: str) -> list[str]:
    """`x.algorithm == "name"` / `in (...)` comparisons, and identifiers naming a method."""
    import re

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(s, ast.Attribute) and s.attr == "algorithm"
                                                 for s in [node.left, *node.comparators]):
            found.append(f"{path}:{node.lineno}: compares `algorithm` with a name")
        name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
        if name and re.search(METHOD, name, re.I):
            found.append(f"{path}:{node.lineno}: identifier {name}")
    return found


def test_generic_layers_hold_no_method_branches():
    """Methods own their parts (docs/extending.md): the generic layers never branch on an algorithm's
    name nor name one in code (error messages may name a method for the user)."""
    found = [f for p, tree, _ in _sizes() if p.relative_to(SRC).parts[0] in GENERIC
             for f in _method_branches(tree, str(p.relative_to(ROOT)))]
    assert not found, found
    bad = ast.parse('if cfg.algorithm == "fedotp":\n    fedotp_head = 1\n')  # the scan sees both kinds
    assert len(_method_branches(bad, "x.py")) == 2
