"""[tracking]: a tiny run logged to TensorBoard, MLflow and W&B (offline), each read back through
the library's own reader (W&B: its own protobuf records) and checked against metrics.jsonl and
results.json; compare groups its runs; bad settings exit 2 with one line."""

import glob
import json
import struct

import pytest

from fedsplice.app import tracking
from fedsplice.app.cli import main
from fedsplice.app.rundir import write_config


def test_scalars_flatten_numbers_and_leave_out_the_rest():
    got = tracking.scalars({"round": 1, "gm": {"accuracy": 0.5, "per_class": [1, 2], "auc": None}, "ok": True,
                            "clients": [0, 1], "up_bytes": 10, "name": "x"}, "final/")
    assert got == {"final/round": 1.0, "final/gm/accuracy": 0.5, "final/up_bytes": 10.0}


def wandb_history(run_dir) -> tuple[list[dict], dict]:
    """The history rows and summary of an offline W&B run: its transaction log (LevelDB log
    framing: 7-byte header, 32 KiB blocks of checksum, length, type) holds wandb's own protobuf
    `Record`s; wandb 0.31 has no Python reader of its own."""
    from wandb.proto import wandb_internal_pb2

    with open(glob.glob(str(run_dir / "offline-run-*" / "run-*.wandb"))[0], "rb") as f:
        data = f.read()
    pos, recs, part = 7, [], b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if n == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):
            recs.append(part)
    hist, summary = [], {}
    for raw in recs:
        r = wandb_internal_pb2.Record()
        r.ParseFromString(raw)
        item = r.WhichOneof("record_type")
        if item == "history":
            hist.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
        elif item == "summary":
            summary.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in r.summary.update})
    return hist, summary


@pytest.mark.integration  # W&B runs its own service process
def test_a_run_logged_to_all_three_reads_back_as_metrics_jsonl(tiny_cfg, tmp_path):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_config(tmp_path, tiny_cfg(tracking__backends='["tensorboard", "mlflow", "wandb"]', tracking__name='"t1"',
                                    tracking__group='"g"'))
    assert main(["run", str(tmp_path / "config.toml"), "--out", str(tmp_path / "run"), "--quiet"]) == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    want = [(r["round"], r["gm"]["accuracy"]) for r in recs if "gm" in r]
    loss = [(r["round"], r["train_loss"]) for r in recs if "train_loss" in r]
    assert len(want) >= 2 and loss
    root = tmp_path / "run" / "tracking"

    ea = EventAccumulator(str(root / "tensorboard" / "t1"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("gm/accuracy")] == [(s, pytest.approx(v)) for s, v in want]
    assert [(e.step, e.value) for e in ea.Scalars("train_loss")] == [(s, pytest.approx(v, rel=1e-6)) for s, v in loss]
    assert ea.Scalars("final/gm/accuracy")[0].value == pytest.approx(res["gm"]["accuracy"])

    c = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    run = c.search_runs([c.get_experiment_by_name("fedsplice").experiment_id])[0]
    assert run.info.run_name == "t1" and run.data.tags["group"] == "g" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in c.get_metric_history(run.info.run_id, "gm/accuracy")] == want
    assert run.data.params["server.rounds"] == "2" and run.data.params["algorithm"] == "pfadapter"
    assert run.data.metrics["final/gm/accuracy"] == res["gm"]["accuracy"]
    assert run.data.metrics["final/communication/up_bytes"] == res["communication"]["up_bytes"]

    hist, summary = wandb_history(root / "wandb")
    got = [(h["_step"], h["gm/accuracy"]) for h in hist if "gm/accuracy" in h]
    assert got == want and summary["final/gm/accuracy"] == res["gm"]["accuracy"]


def test_compare_groups_its_runs_under_its_folder(tiny_cfg, tmp_path):
    from fedsplice.app.compare import plan

    write_config(tmp_path, tiny_cfg(tracking__backends='["tensorboard"]'))
    runs = plan([tmp_path / "config.toml"], 2, [], tmp_path / "cmp")
    assert [(c.tracking.group, c.tracking.name) for _, _, c, _ in runs] == [("cmp", "config-seed-0"),
                                                                          ("cmp", "config-seed-1")]


@pytest.mark.parametrize("sets,match", [
    (['tracking.backends=["neptune"]'], "tracking.backends: unknown 'neptune'; choose from tensorboard, mlflow, wandb"),
    (['tracking.backends=["mlflow", "mlflow"]'], "names one backend twice"),
])
def test_bad_tracking_settings_exit_2_with_one_line(sets, match, tiny_cfg, cli_refuses):
    cli_refuses(tiny_cfg(), sets, match)


def test_a_missing_library_is_named_before_the_run(tiny_cfg, cli_refuses, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    cli_refuses(tiny_cfg(), ['tracking.backends=["wandb"]'], "'wandb' needs the wandb package: pip install")
