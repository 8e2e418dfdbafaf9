"""The CLI: user errors are one line on stderr and exit code 2, never a traceback."""

import json
import os
import subprocess
import sys

import pytest

from fedsplice.app.cli import main


def _one_error_line(capsys, argv) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    lines = [s for s in err.splitlines() if s.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("fedsplice: error:"), err
    assert "Traceback" not in err and "Traceback" not in out
    return lines[0]


def _tiny_args(tiny_bert_dir, toy_jsonl):
    return ["--set", f"model.name='{tiny_bert_dir}'", "--set", f"data.dataset='jsonl:{toy_jsonl}'",
            "--set", "data.num_clients=3", "--set", "data.holdout_clients=0",
            "--set", "data.test_per_class=4", "--set", "data.local_test_size=4",
            "--set", "server.rounds=1", "--set", "server.clients_per_round=1",
            "--set", "client.max_steps=1", "--set", "client.batch_size=4",
            "--set", "peft.r=2", "--set", "runtime.threads=1"]


@pytest.mark.parametrize("argv,needle", [
    (["validate", "--set", "server.roundz=3"], "server.roundz: unknown config field"),
    (["run", "--set", "server.roundz=3"], "server.roundz: unknown config field"),
    (["validate", "does/not/exist.toml"], "config file not found"),
    (["run", "does/not/exist.toml"], "config file not found"),
    (["validate", "--set", "algorithm=fedmagic"], "algorithm: unknown 'fedmagic'"),
    (["validate", "--set", "server.rounds"], "expected KEY=VALUE"),
    (["validate", "--set", 'server.rounds="x"'], "server.rounds: expected an integer"),
    (["validate", "--set", "server.optimizer=sgd"], "server.optimizer: unknown value 'sgd'"),
])
def test_config_errors_are_one_line_exit_2(capsys, argv, needle):
    assert needle in _one_error_line(capsys, argv)


def test_existing_out_is_not_clobbered(capsys, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    keep = out / "results.json"
    keep.write_text('{"precious": true}')
    line = _one_error_line(capsys, ["run", "--out", str(out), "--quiet"])
    assert "--overwrite" in line and str(out) in line
    assert json.loads(keep.read_text()) == {"precious": True}
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]


def test_unknown_zoo_model(capsys, tmp_path, toy_jsonl):
    line = _one_error_line(capsys, ["run", "--out", str(tmp_path / "o"), "--quiet",
                                    "--set", "model.name=zoo:nope",
                                    "--set", f"data.dataset='jsonl:{toy_jsonl}'"])
    assert "zoo:nope" in line or "'nope'" in line
    assert "zoo:minilm" in line


def test_unloadable_model_path(capsys, tmp_path, toy_jsonl):
    empty = tmp_path / "empty-model"
    empty.mkdir()
    line = _one_error_line(capsys, ["run", "--out", str(tmp_path / "o"), "--quiet",
                                    "--set", f"model.name='{empty}'",
                                    "--set", f"data.dataset='jsonl:{toy_jsonl}'"])
    assert "model.name" in line


def test_missing_dataset_file(capsys, tmp_path, tiny_bert_dir):
    line = _one_error_line(capsys, ["run", "--out", str(tmp_path / "o"), "--quiet",
                                    "--set", f"model.name='{tiny_bert_dir}'",
                                    "--set", f"data.dataset='jsonl:{tmp_path / 'none.jsonl'}'"])
    assert "data.dataset" in line and "none.jsonl" in line


@pytest.mark.integration
def test_validate_ok(capsys, tmp_path):
    assert main(["validate"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1].startswith("ok: embedded default (pfadapter, zoo:minilm, fortunes)")
    assert "split: carved (no split given): 20 per class" in out  # it read the data
    p = tmp_path / "c.toml"
    p.write_text('algorithm = "lora"\n[server]\nrounds = 2\noptimizer = "fedyogi"\n')
    assert main(["validate", "--no-data", str(p)]) == 0
    out, _ = capsys.readouterr()  # --no-data: the config and its plan (fedavg-lora: every LoRA tensor GLOBAL)
    assert out.splitlines() == ["plan: 48 GLOBAL and 0 PRIVATE tensors", f"ok: {p} (lora, zoo:minilm, fortunes)"]


def test_list_algorithms(capsys):
    assert main(["list", "algorithms"]) == 0
    out, _ = capsys.readouterr()
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    for a in ("pfadapter", "lora", "fedsa-lora", "fedper", "fedprox", "local"):
        assert a in names
    assert "fedyogi" in out
    # each method's [method] settings with their defaults, under its line
    lines = out.splitlines()
    otp = lines[names.index("fedotp") + 1].split()
    assert " ".join(otp) == "[method] gamma = 0.8, eps = 0.1, iters = 100"
    assert "[method] theta = 0.2" in out and 'phase2 = "persistent"' in out and "private_r = 8" in out
    # the switches, each with its table's settings and defaults
    assert "switch grab: Fed-GraB" in out and "[switch.logit_adjustment] tau = 1.0" in out
    assert ('[switch.grab] kp = 10.0, ki = 0.0, kd = 0.0, pos_scale = 0.0, neg_scale = 0.0, out_limit = 100.0, '
            'prior = "all"') in out


def test_run_tiny_end_to_end(capsys, tmp_path, tiny_bert_dir, toy_jsonl):
    out = tmp_path / "run"
    rc = main(["run", "--out", str(out), "--quiet", *_tiny_args(tiny_bert_dir, toy_jsonl)])
    assert rc == 0, capsys.readouterr().err
    r = json.loads((out / "results.json").read_text())
    assert r["algorithm"] == "pfadapter" and r["rounds"] == 1
    # a second run into the same folder needs --overwrite; with it, results are replaced
    assert main(["run", "--out", str(out), "--quiet", *_tiny_args(tiny_bert_dir, toy_jsonl)]) == 2
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--quiet", "--overwrite",
                 *_tiny_args(tiny_bert_dir, toy_jsonl), "--set", "algorithm=lora", "--set", "method={}"]) == 0
    assert json.loads((out / "results.json").read_text())["algorithm"] == "fedavg-lora"


@pytest.mark.integration
def test_console_script_exits_2_without_traceback(tmp_path):
    env = {**os.environ, "FEDSPLICE_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, "-m", "fedsplice.app.cli", "validate", "--set", "server.roundz=1"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        p.stderr.strip()] and p.stderr.startswith("fedsplice: error: server.roundz")
    ok = subprocess.run([sys.executable, "-m", "fedsplice.app.cli", "validate", "--no-data"],
                        capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0 and ok.stdout.splitlines()[-1].startswith("ok:"), ok.stderr


def test_out_is_a_file(capsys, tmp_path):
    f = tmp_path / "afile"
    f.write_text("keep")
    line = _one_error_line(capsys, ["run", "--out", str(f), "--quiet"])
    assert "--out" in line
    assert f.read_text() == "keep"


def test_negative_seed_is_a_config_error(capsys):
    assert "seed" in _one_error_line(capsys, ["validate", "--set", "seed=-1"])


@pytest.mark.parametrize("argv, says", [
    (["report", "."], "fedsplice report needs the optional package 'markdown_it': pip install 'fedsplice[report]'"),
    (["flower", "certs", "--out", "x"],
     "fedsplice flower certs needs the optional package 'flwr': pip install 'fedsplice[flower]'"),
    (["run", "--set", "runtime.kind=flower", "--out", "x"],
     "runtime.kind = 'flower' needs the optional package 'flwr': pip install 'fedsplice[flower]'"),
])
def test_a_missing_extra_is_one_line_naming_it(argv, says, monkeypatch, capsys, tmp_path):
    """Reporting and the Flower supervisor are extras (pyproject): without them, one line, exit 2."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("markdown_it", "flwr") else real(name, *a))
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"fedsplice: error: {says}"
    assert not (tmp_path / "x").exists()  # nothing was written


@pytest.mark.integration
def test_a_config_error_is_one_line_whatever_the_value_holds(capsys):
    """A value with a control character (\\x1e, which str.splitlines breaks at, or a newline) is
    shown escaped: the error stays one line (the fuzz test's contract, tests/test_config_fuzz.py)."""
    assert main(["validate", "--no-data", "--set", 'peft.tower="a\\u001eb"']) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fedsplice: error: ") and "a\\x1eb" in err, err
