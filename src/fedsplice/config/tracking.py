"""[tracking]: experiment trackers that log a run as it goes (fedsplice.app.tracking).

Each backend is the library itself, writing locally: TensorBoard event files
(`torch.utils.tensorboard`), MLflow (a SQLite store), W&B (offline mode; `wandb sync` uploads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedsplice.errors import ConfigError

BACKENDS = ("tensorboard", "mlflow", "wandb")


@dataclass
class TrackingConfig:
    backends: list[str] = field(default_factory=list)  # any of tensorboard, mlflow, wandb; empty: none
    dir: str = ""  # where they write; empty: RUN/tracking
    project: str = "fedsplice"  # MLflow's experiment, W&B's project
    group: str = ""  # runs that belong together (`fedsplice compare` sets its output folder's name)
    name: str = ""  # the run's name; empty: the run's label (algorithm, data set, seed)

    def check(self) -> None:
        bad = [b for b in self.backends if b not in BACKENDS]
        if bad:
            raise ConfigError(f"tracking.backends: unknown {bad[0]!r}; choose from {', '.join(BACKENDS)}")
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError(f"tracking.backends names one backend twice: {self.backends}")
        if self.backends and not self.project:
            raise ConfigError("tracking.project must name the MLflow experiment / W&B project, e.g. 'fedsplice'")
