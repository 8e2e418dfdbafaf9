"""Config checks across layers: the names and hyperparameters a config takes from the registries.

`fedsplice.config` is a leaf, so `ExperimentConfig.check()` validates every field on its own and
across sections, but cannot see the registries that live above it. This module runs that check
and then the cross-checks, with the same one-line ConfigErrors the CLI prints (exit 2):

- `model.name = "zoo:NAME"`: NAME is in the model zoo (`fedsplice.data.zoo.ZOO`);
- `data.dataset`: a built-in data set (`fedsplice.data.datasets.DATASETS`) unless it is a user's
  `csv:PATH` / `jsonl:PATH` / `images:DIR` (whose files the leaf checks);
- `algorithm` + `[method]`: the algorithm exists and its typed `[method]` table validates;
- `[switch.NAME]`: each switch exists, its typed table validates, and it fits the rest;
- `server.*`: the server optimizer accepts its hyperparameters (it is built once, then dropped).

`check_data` then reads the data as a run would (no model): `fedsplice validate` runs it.

`load_config` is the loader for everything that runs or validates a config (CLI, runtimes);
`fedsplice.config.load_config` only parses and runs the leaf checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedsplice import config
from fedsplice.algorithms import method_params
from fedsplice.algorithms.switches import moves, switch_params
from fedsplice.config import ExperimentConfig
from fedsplice.core.server import make_server_optimizer
from fedsplice.data.datasets import DATASETS
from fedsplice.data.report import data_report
from fedsplice.data.wordnet import NAME as WORDNET
from fedsplice.data.zoo import ZOO
from fedsplice.errors import ConfigError
from fedsplice.federation.experiment import build_data

INSTRUCTION_SETS = (WORDNET,)  # built-in instruction data (model.task = "generate")


def check_zoo_model(cfg: ExperimentConfig) -> None:
    name = cfg.model.name
    if name.startswith("zoo:") and name[4:] not in ZOO:
        raise ConfigError(f"model.name: unknown zoo model {name!r}; choose one of "
                          f"{', '.join('zoo:' + k for k in ZOO)}, a local folder or a hub id")


def check_dataset(cfg: ExperimentConfig) -> None:
    dataset = cfg.data.dataset
    generate = cfg.model.task == "generate"
    if (generate and config.user_data(dataset) is None and dataset not in INSTRUCTION_SETS
            and not dataset.startswith(config.HF)):
        raise ConfigError(f"data.dataset = {dataset!r}: model.task = 'generate' reads instruction records: "
                          f"jsonl:PATH, csv:PATH, hf:NAME or one of {', '.join(INSTRUCTION_SETS)}")
    if dataset in INSTRUCTION_SETS and not generate:
        raise ConfigError(f"data.dataset = {dataset!r} holds instruction records (prompt -> response), not classes: "
                          f"set model.task = 'generate'")
    if generate:
        return
    if (config.user_data(dataset) is None and dataset not in DATASETS and dataset != config.SITES
            and not dataset.startswith(config.HF)):
        raise ConfigError(f"data.dataset: unknown {dataset!r}; choose one of "
                          f"{', '.join(DATASETS)}, or csv:PATH / jsonl:PATH / images:DIR / hf:NAME, or 'sites'")


def check_server_optimizer(cfg: ExperimentConfig) -> None:
    make_server_optimizer(cfg.server.optimizer, **cfg.server.optimizer_kwargs())


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg.check()` (the leaf's checks), then the checks against the registries; returns cfg."""
    cfg.check()
    check_zoo_model(cfg)
    check_dataset(cfg)
    method_params(cfg)  # validates `method` against the algorithm (and the algorithm's name)
    switch_params(cfg)  # each [switch.NAME] against its switch
    check_server_optimizer(cfg)
    return cfg


def check_data(cfg: ExperimentConfig) -> dict[str, Any]:  # JSON: the data report
    """Read the data as a run would — files, headers, labels, the split, the clients' shares, the
    scenario — without loading a model (a built-in set is fetched once, as a run would); returns
    the data report (`fedsplice.data.report`)."""
    data, clients, _ = build_data(cfg)
    n_train = cfg.data.num_clients - cfg.data.holdout_clients
    return data_report(data, clients, list(range(n_train, cfg.data.num_clients)))


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """The config at `path` (None: the embedded default) with `--set` overrides, fully validated."""
    return validate(config.load_config(path, overrides, moves()))


def load_run_config(path: Path) -> ExperimentConfig:
    """A run's saved config.toml, fully validated, as the run ran: a setting whose default changed
    since it was saved takes the default it started with (config.first_default_sets)."""
    return load_config(path, config.first_default_sets(config.read_toml(path)))


def saved_as_current(table: dict[str, Any]) -> dict[str, Any]:
    """fedsplice.config.saved_as_current with the switches' readers of their earlier settings."""
    return config.saved_as_current(table, moves())
