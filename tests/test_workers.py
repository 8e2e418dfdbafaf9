"""runtime.workers = N (fedsplice.runtimes.workers): a round's clients run in N persistent worker
processes, and the run is the one `workers = 1` gives, byte for byte (metrics.jsonl apart from
its wall-clock time_s, results, checkpoints), with faults, checkpoints and resume; a worker that
fails or dies is one line, and no worker outlives its run.

Each run with workers spawns processes that import torch and build the tiny experiment again
(seconds each on a loaded 2-core box), so the runs are few and shared by the tests."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import signal

import pytest

from fedsplice.app.runner import resume_experiment, run_experiment
from fedsplice.errors import ConfigError
from fedsplice.federation import build, make_store, wire
from fedsplice.federation import checkpoint as ckpt
from fedsplice.runtimes.workers import WorkerError, Workers

pytestmark = pytest.mark.integration  # worker processes

# clients drop out and straggle past the deadline; a round needs 2 replies, so some are retried.
# Byte for byte: one client's PM at a time, as each worker scores its own (runtime.batch_eval's
# "auto" scores one process's clients together, equal within rounding: tests/test_grouped.py)
FAULTS = dict(server__rounds=3, server__clients_per_round=3, server__min_replies=2, server__round_deadline_s=1.0,
              faults__dropout=0.3, faults__straggler=0.3, faults__straggler_delay_s=60.0,
              runtime__keep_checkpoints=5, runtime__batch_eval='"off"')


def metrics_text(run) -> str:
    """metrics.jsonl as written, with only the wall-clock time_s blanked."""
    return re.sub(r'"time_s": [-+0-9.eE]+', '"time_s": 0', (run / "metrics.jsonl").read_text())


def results(run) -> dict:
    r = json.loads((run / "results.json").read_text())
    r.pop("time_s"), r.pop("cpu_s"), r.pop("setup", None)
    return r


def tensor_files(run, rnd: int) -> dict:
    """The checkpoint of round `rnd`: GLOBAL tensors, server state, every client's PRIVATE state."""
    d = run / ckpt.DIRNAME / f"round-{rnd:06d}"
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.safetensors"))
            if p.name != "rng.safetensors"}  # the main process's torch RNG: it trains nothing with workers


def assert_same_run(run, ref, rounds: int) -> None:
    assert metrics_text(run) == metrics_text(ref)
    assert results(run) == results(ref)
    assert (run / "results.csv").read_bytes() == (ref / "results.csv").read_bytes()
    assert tensor_files(run, rounds) == tensor_files(ref, rounds)


def live_workers() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("fedsplice-worker")]


@pytest.fixture(scope="module")
def faulty(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path_factory):
    """PFAdapter (PRIVATE v, o LoRA tensors) with failing clients: workers = 1 and workers = 2."""
    root = tmp_path_factory.mktemp("workers")
    runs = {}
    for w in (1, 2):
        cfg = cfg_factory(tiny_bert_dir, toy_jsonl, runtime__workers=w, **FAULTS)
        runs[w] = root / f"w{w}"
        run_experiment(cfg, runs[w], quiet=True)
    return runs


def test_two_workers_give_the_one_process_run_byte_for_byte(faulty):
    records = [json.loads(s) for s in (faulty[1] / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("dropped") for r in records) and any(r.get("late") for r in records)  # faults did happen
    assert any(r.get("attempts", 1) > 1 for r in records)
    assert_same_run(faulty[2], faulty[1], FAULTS["server__rounds"])
    assert not live_workers()


def test_interrupted_then_resumed_with_workers_equals_the_uninterrupted_run(
        faulty, cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    """Ctrl-C after round 2 is logged (its checkpoint not yet written) stops the workers; the
    resumed run, on a disk store the workers share, restores round 1's clients into it."""
    cfg = cfg_factory(tiny_bert_dir, toy_jsonl, runtime__workers=2, runtime__store='"disk"', **FAULTS)
    run = tmp_path / "run"

    def interrupt(ev: dict) -> None:
        if ev["kind"] == "round" and ev["record"]["round"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, run, quiet=True, progress=interrupt)
    assert not live_workers()
    assert [r for r, _ in ckpt.checkpoints(run / ckpt.DIRNAME)] == [1]
    resume_experiment(run, quiet=True)
    assert_same_run(run, faulty[1], FAULTS["server__rounds"])
    assert not live_workers()


def test_fedpurel_phase_two_and_cold_start_on_workers(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    """FedPuReL (zero-shot train logits, the personalization task), held-out clients' cold start,
    and the frozen-prefix cache (LoRA above layer 0) in every process."""
    outs = []
    for w in (1, 2):
        cfg = cfg_factory(tiny_bert_dir, toy_jsonl, algorithm='"fedpurel"',
                          method='{personal_rounds = 1, phase2 = "after"}',
                          peft__layers=[1], runtime__workers=w, server__rounds=2,
                          runtime__batch_eval='"off"')  # byte for byte: each client scored alone, as FAULTS
        outs.append(tmp_path / f"w{w}")
        run_experiment(cfg, outs[-1], quiet=True)
    last = json.loads(metrics_text(outs[0]).splitlines()[-1])
    assert last["phase"] == "personalization"
    assert results(outs[0])["cold_start"]["clients"]
    assert_same_run(outs[1], outs[0], 2)


def test_a_failing_or_dead_worker_is_one_line_and_no_worker_is_left(tiny_cfg):
    exp = build(tiny_cfg(runtime__workers=2))
    down = wire.encode({n: exp.init_params[n] for n in exp.global_names})
    with Workers(exp, make_store("memory", None)) as pool:
        assert len(live_workers()) == 2
        with pytest.raises(WorkerError, match=r"^worker 0 failed during the nonsense task: ValueError: "
                                              r"unknown client task 'nonsense'") as e:
            pool.run("nonsense", [0, 2], down)
        assert "\n" not in str(e.value)
        assert set(pool.run("evaluate", [0, 1], down)) == {0, 1}  # a task's error leaves the worker serving
        os.kill(next(p.pid for p in live_workers() if p.name == "fedsplice-worker-1"), signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"^worker 1 \(pid \d+\) was killed by signal 9 .* during the "
                                              r"evaluate task") as e:
            pool.run("evaluate", [0, 1], down)
        assert "\n" not in str(e.value)
    assert not live_workers()


def test_workers_are_the_simulations(tiny_cfg, tmp_path):
    with pytest.raises(ConfigError, match=r"^runtime.workers = 2 .* simulation only.*runtime.workers = 1") as e:
        tiny_cfg(runtime__workers=2, runtime__kind='"flower"')  # refused as the config loads
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="runtime.workers"):  # Flower's own path gives its transport
        run_experiment(tiny_cfg(runtime__workers=2), tmp_path / "run", quiet=True,
                       make_transport=lambda exp, store: None)
    assert not (tmp_path / "run").exists()
