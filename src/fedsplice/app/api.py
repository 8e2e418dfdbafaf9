"""The Python API: what `fedsplice run | resume | compare | list algorithms` do, for notebooks and
scripts, with typed results (docs/api.md).

    import fedsplice
    cfg = fedsplice.load_config(None, ["server.rounds=2"])   # None: the embedded default
    res = fedsplice.run(cfg, "runs/pf")                       # RunResult, read back from results.json
    rows = fedsplice.compare(["a.toml", "b.toml"], "runs/cmp", seeds=2)   # [CompareRow]

Every function here goes through the same code as the CLI command of the same name: the same
validating config loader, the same runner (or Flower launcher), the same run directory. A result
is read back from the run directory, so `RunResult.raw` is exactly the results.json on disk, and a
run loaded later with `load_result(out)` equals the one `run` returned. User errors raise
`ConfigError` (a `FedspliceError`) with the one-line message the CLI prints.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsplice.algorithms.recipe import Algorithm
from fedsplice.algorithms.registry import available, register_algorithm
from fedsplice.app.export import load_export
from fedsplice.config import ExperimentConfig
from fedsplice.errors import AssetError, ConfigError, FedspliceError
from fedsplice.federation.validate import load_config as _load_validated
from fedsplice.federation.validate import load_run_config, validate

__all__ = ["AssetError", "CompareRow", "ConfigError", "FedspliceError", "RunResult", "compare", "list_algorithms",
           "load_config", "load_export", "load_result", "register_algorithm", "resume", "run"]

PathLike = str | Path
# `--set` items ("server.rounds=2"), or {dotted key: Python value}
Overrides = Sequence[str] | Mapping[str, Any] | None


# ----------------------------------------------------------------------------- configs


def _toml(value: Any, key: str) -> str:
    """A Python value as the TOML text of a `--set` value (strings are always quoted)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))  # inf / nan spell the same in TOML
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v, key) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml(v, f'{key}.{k}')}" for k, v in value.items()) + "}"
    raise ConfigError(f"{key}: cannot write a {type(value).__name__} value ({value!r}) into a config; "
                      f"use str, int, float, bool, list or dict")


def _set_items(overrides: Overrides) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, str):
        return [overrides]
    if isinstance(overrides, Mapping):
        return [f"{k}={_toml(v, str(k))}" for k, v in overrides.items()]
    return [str(o) for o in overrides]


def load_config(path: PathLike | None = None, overrides: Overrides = None) -> ExperimentConfig:
    """The config at `path` (None: the embedded default, PFAdapter on MiniLM) with `overrides`
    applied, validated in full exactly as `fedsplice run CONFIG --set ...` does.

    `overrides` is a list of `--set` items (`["server.rounds=2", 'algorithm="lora"']`: TOML
    values, bare words are strings) or a mapping of dotted keys to Python values
    (`{"server.rounds": 2, "algorithm": "lora", "method": {}}`). A bad field raises ConfigError
    naming it, e.g. `server.roundz: unknown config field; known fields here: ...`."""
    return _load_validated(Path(path) if path is not None else None, _set_items(overrides))


# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class RunResult:
    """One finished run, read from its run directory (the results.json contract, docs/getting-started.md).

    The dict fields are the sections of results.json (treat them as read-only):
    `gm` / `pm` hold `accuracy`, `f1_macro`, `f1_weighted` (PM also `accuracy_std/min/max`; long
    tail runs `many`, `medium`, `few`, `balancedness`, ...); `communication` holds `up_bytes`,
    `down_bytes`, `up_bytes_per_round`, `down_bytes_per_round`, `up_bytes_per_client_round`
    (measured on the serialized payloads); `params` is `{"global": n, "private": n}` (parameter
    counts of the split). `cold_start` is None unless the run held clients out. An undefined
    metric (a binary `auc` over a test set of one class) is None: results.json is strict JSON."""

    algorithm: str  # the label in tables: pfadapter, fedyogi-lora, local, fedper+fedadam, ...
    method: str  # the config's `algorithm` (a registered name or "package.module:build")
    rounds: int
    seed: int
    gm: dict[str, Any]
    pm: dict[str, Any]
    communication: dict[str, float]
    params: dict[str, int]
    cold_start: dict[str, Any] | None
    random_weights: tuple[str, ...]  # non-empty: random-weight models; the numbers test the code path
    time_s: float | None
    out: Path  # the run directory, absolute
    raw: dict[str, Any] = field(repr=False)  # results.json as written
    # majority / local_prior, each {"gm", "pm"}, on the run's split (None: per-site data, or older runs)
    references: dict[str, Any] | None = None
    warnings: tuple[str, ...] = ()  # the references the run did not beat, one line each

    @classmethod
    def from_dir(cls, out: PathLike) -> RunResult:
        out = Path(out).absolute()  # a notebook may change its working directory later
        path = out / "results.json"
        if not path.is_file():
            raise ConfigError(f"{out}: no results.json, so not a finished run; run it with fedsplice.run "
                              f"or continue it with fedsplice.resume({str(out)!r})")
        raw = json.loads(path.read_text())
        return cls(algorithm=raw["algorithm"], method=raw.get("method", raw["algorithm"]), rounds=int(raw["rounds"]),
                   seed=int(raw["seed"]), gm=raw["gm"], pm=raw["pm"], communication=raw["communication"],
                   params=raw["params"], cold_start=raw.get("cold_start"),
                   random_weights=tuple(raw.get("random_weights", ())), time_s=raw.get("time_s"), out=out, raw=raw,
                   references=raw.get("references"), warnings=tuple(raw.get("warnings", ())))

    def __repr__(self) -> str:  # the headline numbers; the dicts are one attribute away
        up = self.communication.get("up_bytes_per_round") or 0.0
        rnd = f", RANDOM WEIGHTS {list(self.random_weights)}" if self.random_weights else ""
        return (f"RunResult({self.algorithm}, {self.rounds} rounds, seed {self.seed}, "
                f"GM {_head(self.gm)}, PM {_head(self.pm)}, "
                f"up {up:,.0f} B/round, out={str(self.out)!r}{rnd})")

    def records(self) -> list[dict[str, Any]]:
        """metrics.jsonl: one dict per line. Round 0 is the model before training; a line with
        "phase" is a stage after the rounds (FedPuReL's personalization)."""
        path = self.out / "metrics.jsonl"
        return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]

    def config(self) -> ExperimentConfig:
        """The run's resolved config (its config.toml), validated."""
        return load_run_config(self.out / "config.toml")


def _num(v) -> str:
    """A metric for display; an undefined one (null in results.json) is "n/a"."""
    return "n/a" if v is None or v != v else f"{v:.4f}"


def _head(m: dict) -> str:
    """A model's headline numbers: accuracy, or (model.task = "generate") response loss and ROUGE-L."""
    if "response_loss" in m:
        return f"loss {_num(m['response_loss'])} ROUGE-L {_num(m['rouge_l'])}"
    return f"acc {_num(m.get('accuracy'))}"


def load_result(out: PathLike) -> RunResult:
    """The RunResult of a finished run directory (from `run`, `fedsplice run` or `compare`)."""
    return RunResult.from_dir(out)


# ----------------------------------------------------------------------------- running


def run(cfg: ExperimentConfig | PathLike, out: PathLike | None = None, *, overwrite: bool = False,
        quiet: bool = True, progress=None) -> RunResult:
    """Run one experiment into the run directory `out` (None: runs/<algorithm>-<time>) and return
    its RunResult. `cfg` is a config from `load_config` (validated again here, so edits made to
    it are checked) or a path to a TOML file. With `runtime.kind = "flower"` the run goes to
    Flower's deployment engine on this machine, as `fedsplice run` does (docs/flower.md).

    An existing non-empty `out` is refused unless `overwrite=True`. `quiet=False` prints the
    progress bar and the round lines to stderr, as the CLI does. `progress(event)` receives each
    stage's progress as a dict (stage, round, done/total client tasks, eta_s; simulation only)."""
    from fedsplice.app.rundir import default_out
    from fedsplice.app.runner import run_experiment

    cfg = validate(cfg) if isinstance(cfg, ExperimentConfig) else load_config(cfg)
    out = Path(out) if out is not None else default_out(cfg)
    if cfg.runtime.kind == "flower":
        from fedsplice.app.flower.cli import run_flower

        run_flower(cfg, out, overwrite=overwrite, quiet=quiet)
    else:
        run_experiment(cfg, out, overwrite=overwrite, quiet=quiet, progress=progress)
    return RunResult.from_dir(out)


def resume(out: PathLike, *, quiet: bool = True) -> RunResult:
    """Continue the run in `out` from its last complete checkpoint, with its own config.toml
    (`fedsplice resume`); the result equals an uninterrupted run's, apart from `time_s`. A Flower
    run restarts on Flower (its local deployment; a remote one gets a ConfigError saying how)."""
    from fedsplice.app.flower.cli import resume_flower
    from fedsplice.app.flower.resume import is_flower_run
    from fedsplice.app.runner import resume_experiment

    if is_flower_run(Path(out)):
        resume_flower(Path(out), quiet=quiet)
    else:
        resume_experiment(Path(out), quiet=quiet)
    return RunResult.from_dir(out)


# ----------------------------------------------------------------------------- comparing


@dataclass(frozen=True)
class CompareRow:
    """One config of a comparison: mean and std over its seeds, and the runs themselves.

    `metrics` maps each column of table.md (`GM acc`, `GM F1`, `PM acc`, `PM F1`, `up B/round`,
    `up B total`, and the long-tail columns `GM many` ... `PM β`) to (mean, population std) over
    the seeds, or None where the runs have no such value."""

    method: str  # the row label: the config file's stem
    algorithm: str  # the runs' label (as RunResult.algorithm)
    n_seeds: int
    metrics: dict[str, tuple[float, float] | None]
    random_weights: tuple[str, ...]
    runs: tuple[RunResult, ...]  # one per seed, in seed order; () for a reference row

    def __repr__(self) -> str:
        cells = ", ".join(f"{c} {v[0]:.4f}±{v[1]:.4f}" for c in ("GM acc", "PM acc")
                          if (v := self.metrics.get(c)) is not None)
        return f"CompareRow({self.method}: {self.algorithm}, {self.n_seeds} seeds, {cells})"

    def mean(self, column: str) -> float | None:
        return self._cell(column)[0]

    def std(self, column: str) -> float | None:
        return self._cell(column)[1]

    def _cell(self, column: str) -> tuple[float | None, float | None]:
        if column not in self.metrics:
            raise KeyError(f"{column!r}: not a compare column; one of {', '.join(self.metrics)}")
        v = self.metrics[column]
        return (None, None) if v is None else v


def compare(configs: Sequence[PathLike], out: PathLike, *, seeds: int = 1, overrides: Overrides = None,
            jobs: int = 1, quiet: bool = True) -> list[CompareRow]:
    """`fedsplice compare`: every config x seed (seed, seed+1, ...) with the same partition and
    client sampling per seed, into out/runs/<config stem>/seed-<s>; writes table.md, table.csv and
    the plots into `out`, and returns one CompareRow per config, in the order given, then the
    reference rows every run computed (`majority (reference)`, `local-prior (reference)`, with
    no runs of their own) unless a config is that reference. `overrides`
    apply to every config. Runs already finished are read back, not run again; an interrupted
    comparison, called again with the same arguments, finishes only what was missing.

    `jobs > 1` runs configs in separate processes: an algorithm added with `register_algorithm`
    in this process is unknown there; name it as "package.module:build" instead."""
    from fedsplice.app import compare as C

    paths, out, sets = [Path(c) for c in configs], Path(out), _set_items(overrides)
    planned = C.plan(paths, seeds, sets, out)  # validates every config before anything runs
    rows = C.compare(paths, seeds, sets, out, quiet=quiet, jobs=jobs)
    runs: dict[str, list[RunResult]] = {}
    for label, _, _, d in planned:
        runs.setdefault(label, []).append(RunResult.from_dir(d))
    metric_cols = [c for c, _ in C.METRICS]
    return [CompareRow(method=r["method"], algorithm=r["algorithm"], n_seeds=r["n_seeds"],
                       metrics={c: (tuple(r[c]) if r[c] is not None else None) for c in metric_cols},
                       random_weights=tuple(r.get("random_weights", ())), runs=tuple(runs.get(r["method"], ())))
            for r in rows]


# ----------------------------------------------------------------------------- algorithms


def list_algorithms() -> dict[str, Algorithm]:
    """Every algorithm a config can name, in `fedsplice list algorithms` order: the built-ins,
    those added with `register_algorithm`, and installed `fedsplice.algorithms` entry points.
    Each value has `params` (the `[method]` dataclass), `build`, `description` and `paper`."""
    return available()
