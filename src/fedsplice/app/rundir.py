"""A run directory: resolved config, metrics.jsonl, results.json/.csv and a plot. Writes are atomic."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import time
from pathlib import Path

import tomli_w

from fedsplice.algorithms.registry import display_name
from fedsplice.config import ExperimentConfig, to_dict
from fedsplice.data.assets import atomic_write_bytes, atomic_write_json, atomic_write_text, dumps
from fedsplice.errors import ConfigError


def check_out(out: Path, overwrite: bool) -> Path:
    """Refuse a run directory that holds results (unless asked to) or is not a directory."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory; choose another --out")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out}: the run directory exists and is not empty; "
                          f"pass --overwrite or choose another --out")
    return out


def prepare(out: Path, overwrite: bool) -> Path:
    """Create the run directory (checked with check_out); a rerun starts from a clean slate."""
    out = check_out(out, overwrite)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write there ({e.strerror}); choose another --out") from None
    for stale in ("metrics.jsonl", "results.json", "results.csv", "accuracy.png"):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(out / "client_state", ignore_errors=True)  # PRIVATE state of the old run
    shutil.rmtree(out / "ledger", ignore_errors=True)  # what the old run's clients sent
    return out


def default_out(cfg: ExperimentConfig) -> Path:
    return Path("runs") / f"{display_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_config(out: Path, cfg: ExperimentConfig) -> None:
    atomic_write_text(out / "config.toml", tomli_w.dumps(to_dict(cfg)))


class MetricsLog:
    """metrics.jsonl, one line per round; rewritten atomically so a crash never leaves half a line.
    Lines are strict JSON: an undefined metric (NaN) is null, and records() gives it back as None."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []

    def append(self, record: dict) -> None:
        self.lines.append(dumps(record))
        atomic_write_text(self.path, "\n".join(self.lines) + "\n")

    def records(self) -> list[dict]:
        return [json.loads(s) for s in self.lines]


def flat(results: dict) -> dict:
    row = {"algorithm": results["algorithm"], "rounds": results["rounds"]}
    for group in ("gm", "pm", "communication"):
        for k, v in results.get(group, {}).items():
            if not isinstance(v, list):  # per-class lists stay in results.json
                row[f"{group}.{k}"] = v
    row["random_weights"] = "; ".join(results.get("random_weights", []))  # non-empty: not a result
    return row


def write_results(out: Path, results: dict) -> None:
    atomic_write_json(out / "results.json", results)
    row = flat(results)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(row))
    w.writeheader()
    w.writerow(row)
    atomic_write_text(out / "results.csv", buf.getvalue())


def plot_accuracy(out: Path, records: list[dict], title: str) -> None:
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ev = [r for r in records if "gm" in r and "phase" not in r]  # rounds only

    key = "response_loss" if ev and "response_loss" in ev[0]["gm"] else "accuracy"  # model.task = "generate"

    def acc(r: dict, part: str) -> float:  # an undefined metric (null) is a gap in the line
        v = r[part][key]
        return float("nan") if v is None else v

    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=120)
    ax.plot([r["round"] for r in ev], [acc(r, "gm") for r in ev], "o-", label="GM (global test)")
    ax.plot([r["round"] for r in ev], [acc(r, "pm") for r in ev], "s-", label="PM (mean over clients)")
    ax.set_xlabel("round")
    ax.set_ylabel(key.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    atomic_write_bytes(out / "accuracy.png", buf.getvalue())
