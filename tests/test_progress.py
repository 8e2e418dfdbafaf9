"""Progress a person can read: `fedsplice run` names each stage (train, evaluate, cold start) with
client-task counts and an ETA, and `fedsplice compare` streams each run's rounds as they end."""

from __future__ import annotations

import io
import pickle
import re

import pytest
from rich.console import Console

from fedsplice.app import compare as C
from fedsplice.app import progress, runner
from fedsplice.app.rundir import write_config
from fedsplice.federation import build, make_store
from fedsplice.runtimes.inprocess import InProcess, run_rounds

# TINY_RUN: 4 clients, 1 held out (3 train), 2 rounds of 2 clients, every round evaluated
FITS, EVALS, COLD = 2 * 2, 3 * 3, 1  # round 0 and both rounds evaluate all 3 training clients
TOTAL = FITS + EVALS + COLD


def _stages(events):
    return [e["stage"] for e in events if e["kind"] == "stage"]


def test_run_events_name_every_stage_with_counts_and_eta(tiny_cfg, tmp_path):
    events = []
    runner.run_experiment(tiny_cfg(), tmp_path / "run", quiet=True, progress=events.append)
    assert _stages(events) == ["round 0/2 evaluate", "round 1/2 train", "round 1/2 evaluate",
                               "round 2/2 train", "round 2/2 evaluate", "cold start"]
    assert all(e["total"] == TOTAL and "eta_s" in e and e["rounds"] == 2 for e in events)
    assert [e["done"] for e in events] == sorted(e["done"] for e in events)
    by = {e["stage"]: e for e in events if e["kind"] == "stage"}
    assert by["round 0/2 evaluate"]["done"] == 0 and by["round 0/2 evaluate"]["eta_s"] is None
    assert by["round 1/2 train"]["done"] == 3  # round 0's evaluation counted, client by client
    cs = by["cold start"]  # the ETA: the run's mean pace per unit of work, over the work left
    cost = progress.task_costs(tiny_cfg(), build(tiny_cfg()))
    worked = FITS * cost["train"] + EVALS * cost["evaluate"]
    assert cs["done"] == TOTAL - COLD
    assert cs["eta_s"] == pytest.approx(cs["elapsed_s"] / worked * COLD * cost["cold start"])
    rounds = [e for e in events if e["kind"] == "round"]
    assert [e["record"]["round"] for e in rounds] == [0, 1, 2] and [e["done"] for e in rounds] == [3, 8, 13]
    line = progress.progress_line(by["round 2/2 evaluate"])
    assert line.startswith("round 2/2 evaluate: 10/14 client tasks, ") and " elapsed, ETA " in line


def test_personalize_and_zero_shot_stages_count_too(tiny_cfg, tmp_path):
    events = []
    runner.run_experiment(tiny_cfg(algorithm='"fedpurel"'), tmp_path / "purel", quiet=True, progress=events.append)
    assert _stages(events)[-3:] == ["round 2/2 evaluate", "personalize", "cold start"]
    assert events[-1]["total"] == TOTAL + 3 and events[-1]["done"] == TOTAL + 3 - COLD
    events.clear()
    runner.run_experiment(tiny_cfg(algorithm='"zeroshot"'), tmp_path / "zs", quiet=True, progress=events.append)
    assert _stages(events) == ["evaluate"] and {e["total"] for e in events} == {3}
    assert progress.progress_line(events[-1]).startswith("evaluation done, GM acc ")


def test_quiet_run_prints_nothing(tiny_cfg, tmp_path, capsys):
    runner.run_experiment(tiny_cfg(), tmp_path / "run", quiet=True)
    assert capsys.readouterr().err == ""


def test_run_to_a_log_file_prints_stage_lines(tiny_cfg, tmp_path, capsys):
    """stderr not a terminal: no animation, but a line as each stage starts, between the round lines."""
    runner.run_experiment(tiny_cfg(), tmp_path / "run", quiet=False)
    err = capsys.readouterr().err.splitlines()
    at = {s: next(i for i, line in enumerate(err) if line.startswith(s)) for s in (
        "round 0/2 evaluate: 0/14 client tasks", "round   0  GM acc", "round 1/2 train: 3/14 client tasks",
        "round 1/2 evaluate: 5/14", "round   1  loss", "round 2/2 evaluate: 10/14", "cold start: 13/14")}
    assert list(at.values()) == sorted(at.values())
    assert all(" ETA " in err[i] for s, i in at.items() if "client tasks" in s or s.startswith("cold"))


def test_run_on_a_terminal_draws_a_bar_with_eta(tiny_cfg, tmp_path, monkeypatch):
    out = io.StringIO()
    term = Console(file=out, force_terminal=True, width=160)
    monkeypatch.setattr(runner, "console", term)
    monkeypatch.setattr(progress, "console", term)
    runner.run_experiment(tiny_cfg(), tmp_path / "run", quiet=False)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # no colours, no cursor moves
    assert "client tasks" in text and "ETA" in text and "/14" in text  # the bar (drawn as it stops)
    assert "round   2  loss" in text  # round lines above it
    assert "round 1/2 train:" not in text  # the stage lines are for log files only


def test_progress_counts_what_a_runtime_does_not_report(tiny_cfg, tmp_path):
    """Dropped clients and retries (InProcess skips them) and a runtime without per-client
    progress (Flower) still add up: every planned and retried task is counted once."""
    class Opaque:  # a runtime that says nothing until a call returns
        def __init__(self, exp, store):
            self.inner = InProcess(exp, store)

        def fit(self, *a):
            return self.inner.fit(*a)

        def run(self, *a):
            return self.inner.run(*a)

    for kw in ({"make_transport": Opaque}, {}):
        events = []
        cfg = tiny_cfg(faults__dropout="0.5", server__min_replies="2", server__max_retries="2")
        runner.run_experiment(cfg, tmp_path / str(len(kw)), quiet=True, progress=events.append, **kw)
        cold = next(e for e in events if e["stage"] == "cold start")
        assert cold["total"] >= TOTAL and cold["done"] == cold["total"] - COLD


@pytest.mark.parametrize("together", ['"off"', '"on"'])
def test_an_observer_sees_every_call_and_each_client_task(tiny_cfg, together, monkeypatch):
    """The loop's calls tell the transport's observer when they begin and end; InProcess ticks
    it as each client task ends (trained together, runtime.batch_train: as each client's last
    step ends, inside the call). Observing changes nothing: the run's records are the same."""
    class Names:
        def __init__(self):
            self.calls, self.ticks = [], []

        def begin(self, task, rnd, cids):
            self.calls.append(("begin", task, rnd, len(cids)))

        def client_done(self, task):
            self.ticks.append(task)
            self.calls.append(("tick", task))

        def end(self, task, cids):
            self.calls.append(("end", task, len(cids)))

    seen, runs = Names(), []
    from fedsplice.federation import batched_train

    end = batched_train.fit_end  # trained together, every tick comes before the uploads are built
    monkeypatch.setattr(batched_train, "fit_end", lambda *a: (seen.calls.append(("upload", "fit")), end(*a))[1])
    for observer in (seen, None):
        recs = []
        exp = build(tiny_cfg(runtime__batch_train=together))
        assert exp.batch_train == (together == '"on"')
        run_rounds(exp, make_store("memory", None), recs.append, observer=observer)
        runs.append(recs)
    assert seen.ticks.count("fit") == FITS and seen.ticks.count("evaluate") == EVALS
    fit_begin = [i for i, c in enumerate(seen.calls) if c[:2] == ("begin", "fit")]
    for i in fit_begin:  # each training call's clients ticked before the call ended
        j = next(j for j in range(i, len(seen.calls)) if seen.calls[j][:2] == ("end", "fit"))
        between = [c for c in seen.calls[i + 1:j] if c[0] == "tick"]
        assert between == [("tick", "fit")] * seen.calls[i][3]
        if together == '"on"':
            assert seen.calls[i + 1:j] == between + [("upload", "fit")] * seen.calls[i][3]
    seen.calls = [c for c in seen.calls if c[0] in ("begin", "end")]
    begins = [c for c in seen.calls if c[0] == "begin"]
    assert [c[1] for c in begins].count("fit") == 2 and begins[0][1:] == ("evaluate", 0, 3)  # 3 training clients
    assert [(c[1], c[-1]) for c in seen.calls if c[0] == "end"] == [(c[1], c[-1]) for c in begins]
    drop = ("time_s", "wall_s")
    assert [{k: v for k, v in r.items() if k not in drop} for r in runs[0]] == \
        [{k: v for k, v in r.items() if k not in drop} for r in runs[1]]


@pytest.fixture
def configs(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    paths = []
    for algo in ("pfadapter", "lora"):
        d = tmp_path / "cfg" / algo
        d.mkdir(parents=True)
        write_config(d, cfg_factory(tiny_bert_dir, toy_jsonl, algorithm=algo))
        paths.append((d / "config.toml").rename(tmp_path / "cfg" / f"{algo}.toml"))
    return paths


def test_compare_streams_rounds_before_each_result(configs, tmp_path, capsys):
    runs = C.plan(configs, 1, [], tmp_path / "cmp")
    C.run_all(runs, quiet=False)
    err = capsys.readouterr().err.splitlines()

    def first(prefix, part):
        return next(i for i, line in enumerate(err) if line.startswith(prefix) and part in line)

    assert err[0] == f"run 1/2 pfadapter seed 0: starting in {runs[0][3]}"
    # the data report, as `run` prints it, before the rounds; no round line twice
    assert err[1].startswith("run 1/2 pfadapter seed 0: data: ") and "classes" in err[1]
    assert err[2].startswith("run 1/2 pfadapter seed 0:   split: ")
    assert not any(": round " in line and " loss " in line and "client tasks" not in line for line in err)
    assert first("run 1/2 pfadapter seed 0: ", "round 0/2 evaluate: 0/14 client tasks") \
        < first("run 1/2 pfadapter seed 0: ", "round 1/2 done, loss") \
        < first("run 1/2 pfadapter seed 0: ", "cold start: 13/14 client tasks") \
        < first("run 1/2 pfadapter seed 0: ", "done in ") < first("run 2/2 lora seed 0: ", "round 0/2")
    assert "1/2 runs done, ETA " in err[first("run 1/2", "done in ")]
    assert all(" ETA " in line for line in err if "client tasks" in line)
    assert capsys.readouterr().err == ""
    C.run_all(runs, quiet=True)  # all done already, and quiet: nothing to say
    assert capsys.readouterr().err == ""


def test_a_jobs_worker_prints_its_own_prefixed_lines(capsys):
    lines = pickle.loads(pickle.dumps(C.RunLines("run 2/3 lora seed 1")))  # what a --jobs worker gets
    lines({"kind": "tick", "stage": "round 3/10 evaluate", "rounds": 10, "done": 40, "total": 140,
           "elapsed_s": 62.0, "eta_s": 3725.0})
    assert capsys.readouterr().err == "run 2/3 lora seed 1: round 3/10 evaluate: 40/140 client tasks, 1:02 " \
                                      "elapsed, ETA 1:02:05\n"


def test_eta_weighs_each_stage_by_its_cost(tiny_cfg):
    """A cold start of E local epochs costs far more than one evaluation: counted as one task
    each, the ETA stayed at seconds through minutes of cold start. It also grows while a long
    task runs and nothing ends."""
    cfg = tiny_cfg(eval__cold_start_epochs="5")
    exp = build(cfg)
    cost = progress.task_costs(cfg, exp)
    b, k = cfg.client.batch_size, exp.holdout_ids[0]
    n, t = len(exp.clients[k].train_idx), len(exp.clients[k].test_idx)
    assert cost["cold start"] == 3.0 * 5 * n + 6 * t  # 5 epochs forward+backward, 6 evaluations
    steps = [min(cfg.client.max_steps, -(-len(exp.clients[c].train_idx) // b)) for c in exp.train_ids]
    assert cost["train"] == pytest.approx(3.0 * b * sum(steps) / len(steps))
    track = progress.RunProgress(cfg, exp, 0, quiet=True)
    plan = track.planned
    assert plan == {"evaluate": 9, "train": 4, "cold start": 1, "personalize": 0}
    assert track.eta(track.t0 + 5) is None  # nothing has ended: no pace yet
    track._advance(3)  # round 0's three evaluations: every stage goes at their pace
    later = [track.eta(track.t0 + s) for s in (10.0, 20.0)]
    assert later[1] == pytest.approx(2 * later[0])  # nothing ends: the ETA grows
    work = sum(n * cost[k] for k, n in plan.items())
    assert later[0] == pytest.approx(10.0 / (3 * cost["evaluate"]) * (work - 3 * cost["evaluate"]))
    # in round 1's training: 2 fits ended in 40 s; a stage seen goes at its own pace
    t0 = track.t0
    track.phase, track._phase_t0, track.spent["evaluate"], track.done_by["train"] = "train", t0 + 30, 10.0, 2
    pace = {"evaluate": 10.0 / (3 * cost["evaluate"]), "train": 40.0 / (2 * cost["train"])}
    mean = 70.0 / (3 * cost["evaluate"] + 2 * cost["train"])
    assert track.eta(t0 + 70) == pytest.approx(6 * cost["evaluate"] * pace["evaluate"]
                                               + 2 * cost["train"] * pace["train"]
                                               + cost["cold start"] * mean)
