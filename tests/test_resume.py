"""Kill a run at any moment, resume it, and get the same outputs as a run that never stopped.

"Same" is bit for bit: every metrics.jsonl record and results.json equal after dropping the
wall-clock `time_s`, `cpu_s` and `setup` fields (the only fields excluded), results.csv
byte-equal, and the final GLOBAL tensors, server state, every client's PRIVATE state and torch's RNG byte-equal.

The SIGKILL tests run a real `fedsplice run` subprocess on the tiny BERT and the toy data set,
kill it at a randomly chosen round (set FEDSPLICE_KILL_SEED to replay a choice) or inside a
checkpoint write (held open by an audit hook in the child process, PAUSE_AT_STATE), and resume it.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tomli_w

from fedsplice.app.cli import main
from fedsplice.config import to_dict
from fedsplice.federation import checkpoint as ckpt

ROUNDS = 8
SEED = int(os.environ.get("FEDSPLICE_KILL_SEED", random.SystemRandom().randrange(10**6)))


def _config(cfg_factory, tiny_bert_dir, toy_jsonl, **kw):
    base = dict(server__rounds=str(ROUNDS), server__optimizer='"fedadam"', faults__dropout="0.2",
                runtime__keep_checkpoints=str(ROUNDS + 1))
    return cfg_factory(tiny_bert_dir, toy_jsonl, **{**base, **kw})


def _write_toml(cfg, path: Path) -> Path:
    path.write_text(tomli_w.dumps(to_dict(cfg)))
    return path


@pytest.fixture(scope="module")
def setups(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path_factory):
    """Two configs (memory and disk store) and an uninterrupted reference run of each."""
    root = tmp_path_factory.mktemp("resume")
    out = {}
    for store in ("memory", "disk"):
        cfg = _config(cfg_factory, tiny_bert_dir, toy_jsonl, runtime__store=f'"{store}"')
        toml = _write_toml(cfg, root / f"{store}.toml")
        ref = root / f"ref-{store}"
        assert main(["run", str(toml), "--out", str(ref), "--quiet"]) == 0
        out[store] = (toml, ref)
    return out


def _records(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(s).items() if k != "time_s"}
            for s in (run / "metrics.jsonl").read_text().splitlines()]


def _results(run: Path) -> dict:
    r = json.loads((run / "results.json").read_text())
    r.pop("time_s"), r.pop("cpu_s"), r.pop("setup", None)
    return r


def assert_same_outputs(run: Path, ref: Path, why: str = "") -> None:
    assert _records(run) == _records(ref), why
    assert _results(run) == _results(ref), why
    assert (run / "results.csv").read_bytes() == (ref / "results.csv").read_bytes(), why
    last = f"{ckpt.DIRNAME}/round-{ROUNDS:06d}"
    files = sorted(p.relative_to(ref / last) for p in (ref / last).rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(run / last) for p in (run / last).rglob("*.safetensors")), why
    # GLOBAL tensors, server state, every client's PRIVATE state, torch's RNG: byte-equal
    for f in files:
        assert (run / last / f).read_bytes() == (ref / last / f).read_bytes(), (why, f)


# ----------------------------------------------------------------------------- subprocess helpers


# The child's CLI, with an audit hook that sleeps when round K's checkpoint opens its state.json
# for writing: the client files are written by then, state.json (which marks it whole) is not.
PAUSE_AT_STATE = '''import sys, time
K = sys.argv.pop(1)
def hook(event, args):
    if event == "open" and str(args[0]).endswith("/state.json") and f"/.round-{int(K):06d}.tmp" in str(args[0]) \\
            and "w" in str(args[1]):
        time.sleep(120)
sys.addaudithook(hook)
from fedsplice.app.cli import main
sys.exit(main(sys.argv[1:]))
'''


def _spawn(args: list[str], log: Path, pause_round: int | None = None) -> subprocess.Popen:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    cmd = ["-m", "fedsplice.app.cli"] if pause_round is None else ["-c", PAUSE_AT_STATE, str(pause_round)]
    return subprocess.Popen([sys.executable, *cmd, *args], env=full,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def _logged_rounds(run: Path) -> int:
    try:  # metrics.jsonl is replaced atomically, so a read never sees half a line
        return len((run / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _wait(proc: subprocess.Popen, log: Path, ready, timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before the kill point:\n{log.read_text()}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            pytest.fail(f"timed out waiting for the kill point:\n{log.read_text()}")
        time.sleep(0.005)


def _kill(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGKILL)
    rc = proc.wait(timeout=30)
    assert rc == -signal.SIGKILL, f"the run ended by itself (rc {rc}) before the kill:\n{log.read_text()}"


def _kill_after_round(args, run: Path, k: int, log: Path) -> None:
    """Start `fedsplice ARGS` and SIGKILL it as soon as round k is in metrics.jsonl (somewhere in
    round k+1, or while checkpoint k is being written)."""
    proc = _spawn(args, log)
    _wait(proc, log, lambda: _logged_rounds(run) >= k + 1)
    _kill(proc, log)


# ----------------------------------------------------------------------------- SIGKILL tests


@pytest.mark.integration
def test_sigkill_at_a_random_round_then_resume(setups, tmp_path):
    toml, ref = setups["memory"]
    rnd = random.Random(SEED)
    for i in range(1):  # more random kills: test_sigkill_twice_with_a_disk_store
        k = rnd.randrange(1, ROUNDS)
        why = f"kill after round {k} (FEDSPLICE_KILL_SEED={SEED})"
        run = tmp_path / f"run{i}"
        _kill_after_round(["run", str(toml), "--out", str(run), "--quiet"], run, k, tmp_path / f"log{i}")
        assert not (run / "results.json").exists(), why
        assert main(["resume", str(run), "--quiet"]) == 0, why
        assert_same_outputs(run, ref, why)


@pytest.mark.integration
def test_sigkill_inside_a_checkpoint_write(setups, tmp_path):
    toml, ref = setups["memory"]
    k = random.Random(SEED + 1).randrange(2, ROUNDS)
    why = f"kill inside the write of checkpoint {k} (FEDSPLICE_KILL_SEED={SEED})"
    run, log = tmp_path / "run", tmp_path / "log"
    proc = _spawn(["run", str(toml), "--out", str(run), "--quiet"], log, pause_round=k)
    root = run / ckpt.DIRNAME

    def writing() -> bool:
        return root.is_dir() and any(p.name.startswith(f".round-{k:06d}.tmp") and (p / "clients").is_dir()
                                     for p in root.iterdir())

    _wait(proc, log, writing)
    time.sleep(0.2)  # well inside the 120 s pause: client files written, state.json not yet
    _kill(proc, log)
    assert [r for r, _ in ckpt.checkpoints(root)][-1] == k - 1, why  # round k was never completed
    assert any(p.name.startswith(".round-") for p in root.iterdir()), why  # the partial write is there
    # resume as a real process too
    res = subprocess.run([sys.executable, "-m", "fedsplice.app.cli", "resume", str(run), "--quiet"],
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert not any(p.name.startswith(".round-") for p in root.iterdir()), why  # cleaned up
    assert_same_outputs(run, ref, why)


@pytest.mark.integration
def test_sigkill_twice_with_a_disk_store(setups, tmp_path):
    """Kill the run, resume it in a new process, kill that one too, resume again."""
    toml, ref = setups["disk"]
    rnd = random.Random(SEED + 2)
    k1 = rnd.randrange(1, ROUNDS - 2)
    k2 = rnd.randrange(k1 + 1, ROUNDS)
    why = f"kills after rounds {k1} and {k2} (FEDSPLICE_KILL_SEED={SEED})"
    run = tmp_path / "run"
    _kill_after_round(["run", str(toml), "--out", str(run), "--quiet"], run, k1, tmp_path / "log1")
    _kill_after_round(["resume", str(run), "--quiet"], run, k2, tmp_path / "log2")
    assert main(["resume", str(run), "--quiet"]) == 0, why
    assert_same_outputs(run, ref, why)


# ----------------------------------------------------------------------------- in-process resume


def _truncate_to(src: Path, dst: Path, k: int) -> Path:
    """A copy of a finished run as it would be on disk had it died right after checkpoint k."""
    import shutil

    shutil.copytree(src, dst)
    for r, p in ckpt.checkpoints(dst / ckpt.DIRNAME):
        if r > k:
            shutil.rmtree(p)
    for f in ("results.json", "results.csv", "accuracy.png"):
        (dst / f).unlink()
    return dst


@pytest.mark.parametrize("k", [1, ROUNDS // 2, ROUNDS])
def test_resume_from_checkpoint_k(setups, tmp_path, k):
    _, ref = setups["memory"]
    run = _truncate_to(ref, tmp_path / "run", k)
    assert main(["resume", str(run), "--quiet"]) == 0
    assert_same_outputs(run, ref, f"resume after round {k}")


def test_setup_time_is_reported_and_a_resume_has_no_round_0(setups, tmp_path):
    """results.json `setup`: the wall seconds from the start to the round loop, and the round-0
    evaluation's; a resumed run does not evaluate round 0 again, so it has none."""
    _, ref = setups["memory"]
    fresh = json.loads((ref / "results.json").read_text())["setup"]
    # round 0 (GM and every client's PM) of the tiny model takes milliseconds: measured to 1 ms
    assert fresh["build_s"] > 0 and fresh["round0_s"] > 0, fresh
    assert fresh["build_s"] + fresh["round0_s"] <= json.loads((ref / "results.json").read_text())["time_s"] + 0.1
    run = _truncate_to(ref, tmp_path / "run", 1)
    assert main(["resume", str(run), "--quiet"]) == 0
    resumed = json.loads((run / "results.json").read_text())["setup"]
    assert resumed["build_s"] > 0 and resumed["round0_s"] is None, resumed


def test_a_run_resumes_across_a_version_that_added_a_setting(setups, tmp_path):
    """A run written before `runtime.unpad` existed (its config.toml and checkpoint digests
    without it) resumes: the missing setting takes its default, and the outputs are the same."""
    import hashlib
    import tomllib

    _, ref = setups["memory"]
    run = _truncate_to(ref, tmp_path / "run", ROUNDS // 2)
    text = (run / "config.toml").read_text()
    old = re.sub(r'(?m)^unpad = "auto"\n', "", text)
    assert old != text
    (run / "config.toml").write_text(old)
    digest = hashlib.sha256(json.dumps(tomllib.loads(old), sort_keys=True).encode()).hexdigest()
    for _, p in ckpt.checkpoints(run / ckpt.DIRNAME):
        meta = json.loads((p / "state.json").read_text())
        (p / "state.json").write_text(json.dumps({**meta, "config_sha256": digest}))
    assert main(["resume", str(run), "--quiet"]) == 0
    assert_same_outputs(run, ref, "resume across a new setting")


def test_a_run_saved_before_a_default_changed_resumes_as_it_started(setups, tmp_path):
    """runtime.batch_eval / batch_train arrived "off" and default to "auto" since issue 50: a run
    whose config.toml lacks them resumes (its checkpoints' digests still match) with "off", as it
    started, while a user's config without them gets "auto"."""
    import hashlib
    import tomllib

    from fedsplice.federation.validate import load_config, load_run_config

    _, ref = setups["memory"]
    run = _truncate_to(ref, tmp_path / "run", ROUNDS // 2)
    text = (run / "config.toml").read_text()
    old = re.sub(r'(?m)^batch_(eval|train) = "(auto|off|on)"\n', "", text)
    assert old.count("batch_") == text.count("batch_") - 2
    (run / "config.toml").write_text(old)
    digest = hashlib.sha256(json.dumps(tomllib.loads(old), sort_keys=True).encode()).hexdigest()
    for _, p in ckpt.checkpoints(run / ckpt.DIRNAME):
        meta = json.loads((p / "state.json").read_text())
        (p / "state.json").write_text(json.dumps({**meta, "config_sha256": digest}))
    saved = load_run_config(run / "config.toml").runtime
    assert (saved.batch_eval, saved.batch_train) == ("off", "off")
    assert load_config(run / "config.toml").runtime.batch_eval == "auto"
    assert main(["resume", str(run), "--quiet"]) == 0
    assert len(_records(run)) == len(_records(ref))


def test_resume_without_any_checkpoint_starts_over(setups, tmp_path):
    _, ref = setups["disk"]
    run = _truncate_to(ref, tmp_path / "run", 0)
    (run / "metrics.jsonl").write_text('{"round": 0, "half a line')  # whatever a crash left
    assert main(["resume", str(run), "--quiet"]) == 0
    assert_same_outputs(run, ref)


def test_checkpoints_are_pruned_and_share_unchanged_clients(cfg_factory, tiny_bert_dir, toy_jsonl, tmp_path):
    from fedsplice.app.runner import run_experiment
    from fedsplice.federation.experiment import sampling_stream

    cfg = _config(cfg_factory, tiny_bert_dir, toy_jsonl, runtime__keep_checkpoints="2", server__rounds="4")
    run_experiment(cfg, tmp_path / "run", quiet=True)
    cps = ckpt.checkpoints(tmp_path / "run" / ckpt.DIRNAME)
    assert [r for r, _ in cps] == [3, 4]
    (_, a), (_, b) = cps
    sampled = set(sampling_stream(cfg, [0, 1, 2])[3])  # round 4's clients
    meta = json.loads((b / "state.json").read_text())
    assert meta["round"] == 4 and set(meta["files"]) >= {"global.safetensors", "server.safetensors"}
    for cid in meta["clients"]:
        f = f"clients/client-{cid:05d}.safetensors"
        same_inode = (a / f).exists() and os.stat(a / f).st_ino == os.stat(b / f).st_ino
        assert same_inode == (cid not in sampled), cid  # unchanged clients are hard links
    cfg0 = _config(cfg_factory, tiny_bert_dir, toy_jsonl, runtime__checkpoint_every="0", server__rounds="2")
    run_experiment(cfg0, tmp_path / "none", quiet=True)
    assert not (tmp_path / "none" / ckpt.DIRNAME).exists()


def test_disk_full_while_checkpointing_is_one_line_and_resumable(setups, tmp_path, capsys, monkeypatch):
    toml, ref = setups["memory"]
    real = ckpt._write

    def full(path, data):
        if path.name == "global.safetensors" and "round-000003" in path.parent.name:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(ckpt, "_write", full)
    run = tmp_path / "run"
    assert main(["run", str(toml), "--out", str(run), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left" in err[0] and "fedsplice resume" in err[0]
    assert [r for r, _ in ckpt.checkpoints(run / ckpt.DIRNAME)][-1] == 2
    monkeypatch.setattr(ckpt, "_write", real)
    assert main(["resume", str(run), "--quiet"]) == 0
    assert_same_outputs(run, ref)


# ----------------------------------------------------------------------------- refusals


def _one_error_line(capsys, argv) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = [s for s in err.splitlines() if s.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("fedsplice: error:"), (rc, err)
    assert "Traceback" not in err + out
    return lines[0]


def test_resume_refusals(setups, tmp_path, capsys):
    _, ref = setups["memory"]
    assert "no such run directory" in _one_error_line(capsys, ["resume", str(tmp_path / "nope")])
    (tmp_path / "empty").mkdir()
    assert "config.toml" in _one_error_line(capsys, ["resume", str(tmp_path / "empty")])
    changed = _truncate_to(ref, tmp_path / "changed", 3)
    toml = (changed / "config.toml").read_text().replace("lr = 0.01", "lr = 0.02")
    assert toml != (changed / "config.toml").read_text()
    (changed / "config.toml").write_text(toml)
    assert "different config" in _one_error_line(capsys, ["resume", str(changed)])
    damaged = _truncate_to(ref, tmp_path / "damaged", 3)
    g = damaged / ckpt.DIRNAME / "round-000003" / "global.safetensors"
    g.write_bytes(g.read_bytes()[:-7])
    assert "damaged" in _one_error_line(capsys, ["resume", str(damaged)])
