"""`fedsplice compare`: configs x seeds on the same clients, mean ± std tables, plots, resume."""

import csv
import json

import numpy as np
import pytest

from fedsplice.app import compare as C
from fedsplice.app import runner
from fedsplice.app.cli import main
from fedsplice.app.rundir import write_config


@pytest.fixture
def configs(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    paths = []
    for algo in ("pfadapter", "lora"):
        d = tmp_path / "cfg" / algo
        d.mkdir(parents=True)
        write_config(d, cfg_factory(tiny_bert_dir, toy_jsonl, algorithm=algo, server__rounds=2,
                                    data__holdout_clients=0))
        paths.append((d / "config.toml").rename(tmp_path / "cfg" / f"{algo}.toml"))
    return paths


def test_compare_tables_plots_and_resume(configs, tmp_path, monkeypatch):
    out = tmp_path / "cmp"
    rows = C.compare(configs, 2, [], out, quiet=True)
    runs = sorted((out / "runs").glob("*/seed-*"))
    assert [f"{r.parent.name}/{r.name}" for r in runs] == ["lora/seed-0", "lora/seed-1", "pfadapter/seed-0",
                                                         "pfadapter/seed-1"]
    # the same sampled clients per seed, whatever the method
    for s in (0, 1):
        clients = [[r.get("clients") for r in map(json.loads, (out / "runs" / m / f"seed-{s}" / "metrics.jsonl")
                                                  .read_text().splitlines())] for m in ("lora", "pfadapter")]
        assert clients[0] == clients[1]
    # mean ± std are those of the runs' own results.json
    res = {m: [json.loads((out / "runs" / m / f"seed-{s}" / "results.json").read_text()) for s in (0, 1)]
           for m in ("pfadapter", "lora")}
    by = {r["method"]: r for r in rows}
    for m in res:
        gm = [r["gm"]["accuracy"] for r in res[m]]
        assert by[m]["GM acc"] == pytest.approx((np.mean(gm), np.std(gm)))
        up = [r["communication"]["up_bytes_per_round"] for r in res[m]]
        assert by[m]["up B/round"] == pytest.approx((np.mean(up), np.std(up)))
    assert by["pfadapter"]["up B/round"][0] < by["lora"]["up B/round"][0]
    gm = res["lora"][0]["gm"]
    # per-class accuracy on the balanced global test set (6 texts a class): k/6 each, mean = accuracy
    assert np.mean(gm["class_accuracy"]) == pytest.approx(gm["accuracy"])
    assert all(abs(a * 6 - round(a * 6)) < 1e-9 for a in gm["class_accuracy"])
    md = (out / "table.md").read_text()
    assert "| pfadapter | 2 |" in md and "±" in md
    table = list(csv.DictReader((out / "table.csv").open()))
    assert [r["method"] for r in table] == ["pfadapter", "lora", "majority (reference)", "local-prior (reference)"]
    assert float(table[0]["GM acc mean"]) == pytest.approx(by["pfadapter"]["GM acc"][0])
    for png in ("accuracy_vs_round.png", "accuracy_vs_bytes.png", "balancedness_vs_round.png",
                "class_accuracy_head_to_tail.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"

    # interrupted: one run lost entirely, one killed after its checkpoints but before results
    import shutil

    shutil.rmtree(out / "runs" / "lora" / "seed-1")
    (out / "runs" / "pfadapter" / "seed-0" / "results.json").unlink()
    calls = {"run": 0, "resume": 0}
    real_run, real_resume = runner.run_experiment, runner.resume_experiment

    def run(*a, **k):
        calls["run"] += not k.get("resume")  # resume_experiment goes through run_experiment too
        return real_run(*a, **k)

    def resume(*a, **k):
        calls["resume"] += 1
        return real_resume(*a, **k)

    monkeypatch.setattr(runner, "run_experiment", run)
    monkeypatch.setattr(runner, "resume_experiment", resume)
    again = C.compare(configs, 2, [], out, quiet=True)
    assert calls == {"run": 1, "resume": 1}
    assert again == rows  # the same metrics: resumed and rerun runs are deterministic


def test_compare_bad_input(configs, tmp_path, capsys):
    dup = tmp_path / "other"
    dup.mkdir()
    (dup / configs[0].name).write_text(configs[0].read_text())
    assert main(["compare", str(configs[0]), str(dup / configs[0].name), "--out", str(tmp_path / "x")]) == 2
    assert "share a file name" in capsys.readouterr().err
    assert main(["compare", str(configs[0]), "--seeds", "0", "--out", str(tmp_path / "x")]) == 2
    assert "--seeds" in capsys.readouterr().err
    assert main(["compare", str(configs[0]), "--set", "server.roundz=1", "--out", str(tmp_path / "x")]) == 2
    assert "server.roundz" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # nothing written before the plan is valid



@pytest.mark.integration
def test_workers_end_when_the_suite_is_killed(tmp_path):
    """`kill` of a compare/results process (SIGTERM, no handler) leaves no worker running: each
    worker ends itself once its parent is gone (compare.exit_with_parent)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "suite.py"
    script.write_text(
        "import os, sys, time\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from multiprocessing import get_context\n"
        "from fedsplice.app.compare import exit_with_parent\n"
        "def work(_):\n"
        "    print(os.getpid(), flush=True); time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    with ProcessPoolExecutor(2, mp_context=get_context('spawn'), initializer=exit_with_parent,\n"
        "                             initargs=(os.getpid(),)) as pool:\n"
        "        list(pool.map(work, range(2)))\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers = [int(proc.stdout.readline()) for _ in range(2)]
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    deadline = time.monotonic() + 30
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(w) for w in workers)
