"""Typed experiment configs from one source: nested dataclasses, read from TOML, validated per field.

Every section is a dataclass; `load_config` walks the TOML table against the dataclass fields,
so an unknown key, a wrong type or an out-of-range value fails with a one-line ConfigError that
names the dotted field (`server.rounds`) and the fix. `--set a.b=value` overrides are applied to
the raw table before validation, so they go through exactly the same checks.

This package is a leaf: it imports nothing from fedsplice but `fedsplice.errors`. The checks that
need a registry (zoo models, data sets, algorithms' `[method]` tables, server optimizers) are in
`fedsplice.federation.validate`, whose `load_config` / `validate` run them after these.

    checks      ROLES and the shared field checks (check_positive, check_roles)
    task        model, peft, data, scenario: what is learned on which data
    rounds      client, server, eval, runtime, faults: how the rounds run
    privacy     [privacy]: differential privacy on the GLOBAL updates
    experiment  ExperimentConfig, the embedded default, the leaf `load_config`, `to_dict`
    parsing     TOML tables -> dataclasses (`from_dict`), `--set` overrides, reading files
"""

from fedsplice.config.checks import ROLES, check_positive, check_roles
from fedsplice.config.experiment import (
    DEFAULT_CONFIG,
    ExperimentConfig,
    first_default_sets,
    load_config,
    saved_as_current,
    to_dict,
)
from fedsplice.config.parsing import apply_overrides, from_dict, parse_value, read_toml
from fedsplice.config.privacy import PrivacyConfig
from fedsplice.config.rounds import ClientConfig, EvalConfig, FaultsConfig, RuntimeConfig, ServerConfig
from fedsplice.config.task import (
    HF,
    SITES,
    USER_DATA_KINDS,
    DataConfig,
    ModelConfig,
    PeftConfig,
    ScenarioConfig,
    check_user_path,
    user_data,
)
from fedsplice.config.tracking import TrackingConfig

__all__ = ["DEFAULT_CONFIG", "HF", "ROLES", "SITES", "USER_DATA_KINDS", "ClientConfig", "DataConfig", "EvalConfig",
           "ExperimentConfig", "FaultsConfig", "ModelConfig", "PeftConfig", "PrivacyConfig",
           "RuntimeConfig", "ScenarioConfig", "ServerConfig", "TrackingConfig", "apply_overrides", "check_positive",
           "check_roles", "check_user_path", "first_default_sets", "from_dict", "load_config", "parse_value",
           "read_toml", "saved_as_current", "to_dict", "user_data"]
