"""A machine that never ran the suite (issue 46): no cache decides a result, a test that overruns
fails alone, and CI proves both by running with fresh cache folders (.ci/fresh_caches)."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from timeouts import in_gc_callback

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def test_matplotlib_cache_belongs_to_the_run():
    """conftest points MPLCONFIGDIR at a folder of this run and builds the font list there before
    the unit guard: drawing in a unit test starts no `fc-list`, whatever the machine had cached."""
    import matplotlib
    import matplotlib.pyplot as plt

    folder = Path(os.environ["MPLCONFIGDIR"])
    assert folder.name.startswith("fedsplice-test-mpl-") and Path(matplotlib.get_cachedir()) == folder
    assert list(folder.glob("fontlist-*.json"))
    fig = plt.figure()
    fig.text(0.5, 0.5, "drawn")
    fig.canvas.draw()  # a unit test: the guard would fail it, had this started a process
    plt.close(fig)


def test_in_gc_callback_sees_a_collection_and_nothing_else():
    seen: list[bool] = []

    def callback(phase, info):
        seen.append(in_gc_callback(sys._getframe()))

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert seen == [True, True]  # the "start" and "stop" phases
    assert not in_gc_callback(sys._getframe())


OVERRUNS = textwrap.dedent('''
    import ast, gc, time
    from pathlib import Path

    import pytest
    from hypothesis import given, settings, strategies as st

    HERE = Path(__file__).parent
    SOURCE = "x = [" + "(1, 'a', [2.0])," * 3000 + "]\\n"


    @pytest.mark.timeout(2)
    def test_sleeps():
        time.sleep(8)
        (HERE / "sleeps-survived").touch()


    @pytest.mark.timeout(1)
    def test_overruns_inside_a_gc_callback():
        def slow(phase, info):  # the timer fires while the main thread runs this callback
            if phase == "start":
                end = time.monotonic() + 2
                while time.monotonic() < end:
                    pass
        gc.callbacks.append(slow)
        try:
            gc.collect()
        finally:
            gc.callbacks.remove(slow)
        time.sleep(8)
        (HERE / "gc-survived").touch()


    @pytest.mark.timeout(3)
    @settings(max_examples=1000, deadline=None, database=None)
    @given(st.lists(st.text(), min_size=3))
    def test_property_overruns_while_shrinking(xs):
        end = time.monotonic() + 1
        while time.monotonic() < end:  # allocation-heavy: collections run hypothesis' gc callback
            ast.parse(SOURCE)
        assert not xs  # fails on every example, so hypothesis shrinks until the timer fires


    def test_after():
        assert sum(range(4)) == 6
''')


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "overruns.py"],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration
def test_an_overrun_fails_alone_and_the_run_reaches_its_summary(tmp_path):
    (tmp_path / "overruns.py").write_text(OVERRUNS)
    r = _pytest(tmp_path, "-p", "timeouts")
    out = r.stdout + r.stderr
    assert "INTERNALERROR" not in out, out[-4000:]
    assert r.returncode == 1, out[-4000:]
    assert out.strip().splitlines()[-1].startswith("3 failed, 1 passed"), out[-4000:]
    assert out.count("TestTimeout: Timeout (>") >= 3, out[-4000:]
    assert not list(tmp_path.glob("*-survived")), out[-4000:]  # no overrun ran on past its timer

    # pytest-timeout's own signal timer raises inside the gc callback, where CPython drops the
    # exception: that test runs on past its limit and passes. This is what tests/timeouts.py fixes.
    (tmp_path / "gc-survived").unlink(missing_ok=True)
    stock = _pytest(tmp_path, "-k", "gc_callback")
    assert stock.returncode == 0 and (tmp_path / "gc-survived").exists(), (stock.stdout + stock.stderr)[-3000:]


CACHE_VARS = ["XDG_CACHE_HOME", "MPLCONFIGDIR", "FEDSPLICE_CACHE", "HF_HOME", "TORCH_HOME",
              "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "WANDB_CACHE_DIR", "WANDB_DIR"]


def _fresh_env() -> dict[str, str]:
    r = subprocess.run(["bash", "-c", "set -euo pipefail; source .ci/fresh_caches >/dev/null; env -0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60, check=True)
    return dict(kv.split("=", 1) for kv in r.stdout.split("\0") if "=" in kv)


@pytest.mark.integration
def test_ci_runs_the_suite_with_fresh_empty_cache_folders():
    first, second = _fresh_env(), _fresh_env()
    try:
        for env in (first, second):
            root = Path(env["FRESH_CACHE_ROOT"])
            folders = [Path(env[v]) for v in CACHE_VARS]
            assert all(f.parent == root and f.is_dir() and not any(f.iterdir()) for f in folders), env
            assert len(set(folders)) == len(folders)
            assert not Path(env["PIP_CACHE_DIR"]).is_relative_to(root)  # downloads may be reused
        assert first["FRESH_CACHE_ROOT"] != second["FRESH_CACHE_ROOT"]
    finally:
        for env in (first, second):
            shutil.rmtree(env["FRESH_CACHE_ROOT"])
    steps = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert steps.index("source .ci/fresh_caches") < steps.index("make check") < steps.index("make test")
    assert steps[-1] == "make test" and "make test" in (ROOT / "README.md").read_text()
