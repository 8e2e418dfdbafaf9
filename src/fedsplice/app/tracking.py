"""[tracking]: a run logged to experiment trackers as it goes, through the libraries themselves.

- tensorboard: event files by `torch.utils.tensorboard.SummaryWriter` in DIR/tensorboard/<run>
- mlflow: a local SQLite store, DIR/mlflow.db (`mlflow ui --backend-store-uri sqlite:///DIR/mlflow.db`)
- wandb: offline mode under DIR/wandb (`wandb sync DIR/wandb/offline-run-*` uploads it later)

Each logs the config (as parameters), every round's numbers at step = round (the scalars of
metrics.jsonl: GM and PM metrics, train loss, bytes, ε where there is one, nested keys joined by
"/"), and the final table (results.json's scalars, prefixed "final/"). A resumed run logs its
remaining rounds as a new tracking run.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fedsplice.errors import ConfigError

PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def scalars(d: dict, prefix: str = "") -> dict[str, float]:
    """{"a/b": number} of every int/float (not bool) in nested dicts; lists and strings are left out."""
    out: dict[str, float] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(scalars(v, key + "/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def flat_config(cfg) -> dict[str, str]:
    """{"section.field": value as text} of the whole config."""
    def walk(d: dict, prefix: str) -> dict[str, str]:
        out = {}
        for k, v in d.items():
            if isinstance(v, dict) and v:
                out.update(walk(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = json.dumps(v) if not isinstance(v, str) else v
        return out
    return walk(dataclasses.asdict(cfg), "")


def check_installed(cfg) -> None:
    """One line per missing library, before the run starts."""
    import importlib.util

    for b in cfg.tracking.backends:
        if importlib.util.find_spec(PACKAGES[b]) is None:
            raise ConfigError(f"tracking.backends: {b!r} needs the {PACKAGES[b]} package: pip install "
                              f"'fedsplice[tracking]' (or remove {b!r})")


class Backend(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, root: Path, run: str, cfg) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(root / "tensorboard" / run))
        self.w.add_text("config", "\n".join(f"    {k} = {v}" for k, v in flat_config(cfg).items()), 0)

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self.w.add_scalar(k, v, step)

    def close(self) -> None:
        self.w.close()


class _MLflow:
    def __init__(self, root: Path, run: str, cfg) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        root.mkdir(parents=True, exist_ok=True)
        self.c = MlflowClient(tracking_uri=f"sqlite:///{root.resolve() / 'mlflow.db'}")
        tc = cfg.tracking
        exp = self.c.get_experiment_by_name(tc.project)
        eid = exp.experiment_id if exp is not None else self.c.create_experiment(tc.project)
        self.run_id = self.c.create_run(eid, run_name=run, tags={"group": tc.group} if tc.group else {}).info.run_id
        params = [Param(k, v[:6000]) for k, v in flat_config(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.c.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ms = [Metric(k, v, 0, step) for k, v in values.items()]
        for i in range(0, len(ms), 1000):
            self.c.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def close(self) -> None:
        self.c.set_terminated(self.run_id)


class _WandB:
    def __init__(self, root: Path, run: str, cfg) -> None:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        root.mkdir(parents=True, exist_ok=True)
        tc = cfg.tracking
        self.run = wandb.init(mode="offline", dir=str(root), project=tc.project, group=tc.group or None,
                              name=run, config=dataclasses.asdict(cfg), reinit="create_new")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


OPEN: dict[str, Callable[[Path, str, Any], Backend]] = {"tensorboard": _TensorBoard, "mlflow": _MLflow,
                                                        "wandb": _WandB}


class Trackers:
    """The run's trackers (none when [tracking] is off): `round(record)`, `final(results)`, `close()`."""

    def __init__(self, cfg, out: Path, name: str) -> None:
        tc = cfg.tracking
        root = Path(tc.dir).expanduser() if tc.dir else Path(out) / "tracking"
        run = tc.name or name
        self.open = [OPEN[b](root, run, cfg) for b in tc.backends]
        self.last = 0

    def round(self, record: dict) -> None:
        step = int(record.get("round", self.last))
        self.last = step
        values = scalars({k: v for k, v in record.items() if k != "round"})
        for t in self.open:
            t.log(values, step)

    def final(self, results: dict) -> None:
        values = scalars(results, "final/")
        for t in self.open:
            t.log(values, self.last)

    def close(self) -> None:
        for t in self.open:
            t.close()
        self.open = []
