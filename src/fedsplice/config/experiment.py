"""The whole experiment config, the embedded default, and the leaf loader.

`load_config` parses a TOML file (or the embedded default), applies `--set` overrides and runs
`ExperimentConfig.check()`: every check that needs nothing outside this package. The checks
against the registries one layer up — zoo model names, built-in data set names, the algorithm's
`[method]` table, the server optimizer's hyperparameters — are `fedsplice.federation.validate`'s;
its `load_config` is the one the CLI and the runtimes call.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fedsplice.config.generate import check_generate
from fedsplice.config.parsing import apply_overrides, from_dict, read_toml
from fedsplice.config.privacy import PrivacyConfig
from fedsplice.config.rounds import ClientConfig, EvalConfig, FaultsConfig, RuntimeConfig, ServerConfig
from fedsplice.config.task import DataConfig, ModelConfig, PeftConfig, ScenarioConfig
from fedsplice.config.tracking import TrackingConfig
from fedsplice.errors import ConfigError


@dataclass
class ExperimentConfig:
    algorithm: str = "pfadapter"
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    method: dict = field(default_factory=dict)  # the algorithm's own hyperparameters, validated by it
    data: DataConfig = field(default_factory=DataConfig)
    scenario: ScenarioConfig = field(default_factory=ScenarioConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    # the switches composed onto the method, [switch.NAME] each (fedsplice.algorithms.switches):
    # a table turns its switch on, with its own settings inside, validated by the switch
    switch: dict = field(default_factory=dict)
    server: ServerConfig = field(default_factory=ServerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    faults: FaultsConfig = field(default_factory=FaultsConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def check(self) -> None:
        """Every section's own checks, then the checks across sections. The checks against the
        registries (zoo, data sets, algorithms, server optimizers): fedsplice.federation.validate."""
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, got {self.seed}")
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if dataclasses.is_dataclass(sub):
                sub.check()  # type: ignore[union-attr]  # every section has its own checks
        trainable = self.data.num_clients - self.data.holdout_clients
        if self.data.class_prompts and self.peft.type == "prompt":
            raise ConfigError("data.class_prompts (an ensemble of fixed templates) cannot be used with "
                              "peft.type = 'prompt', which learns one context from data.class_prompt; "
                              "remove class_prompts")
        if self.data.dataset == "sites" and self.scenario.active():
            raise ConfigError("[scenario] is for one data set partitioned by seed; with data.dataset = 'sites' "
                              "each site's file is used as it is: remove the [scenario] table")
        if self.data.dataset == "sites" and self.eval.on == "validation":
            raise ConfigError("eval.on = 'validation' carves a validation set from one data set; with "
                              "data.dataset = 'sites' each site keeps its own: use eval.on = 'test'")
        if self.scenario.image_dominant + self.scenario.text_dominant > self.data.num_clients:
            raise ConfigError(f"scenario.image_dominant + scenario.text_dominant "
                              f"({self.scenario.image_dominant} + {self.scenario.text_dominant}) exceeds "
                              f"data.num_clients ({self.data.num_clients})")
        if self.server.clients_per_round > trainable:
            raise ConfigError(
                f"server.clients_per_round ({self.server.clients_per_round}) exceeds the "
                f"{trainable} training clients (data.num_clients - data.holdout_clients)")
        if self.faults.straggler > 0 and not 0 < self.server.round_deadline_s < self.faults.straggler_delay_s:
            raise ConfigError(
                f"faults.straggler = {self.faults.straggler} needs 0 < server.round_deadline_s < "
                f"faults.straggler_delay_s ({self.faults.straggler_delay_s}); without a deadline a "
                f"slow client is simply waited for")
        if self.client.upload != "fp32" and self.runtime.kind == "flower":
            raise ConfigError(f"client.upload = {self.client.upload!r} is implemented by the simulation "
                              f"runtime only; use client.upload = 'fp32' with runtime.kind = 'flower'")
        if self.privacy.enabled and self.server.aggregation != "mean":
            raise ConfigError(f"privacy.mode = {self.privacy.mode!r} bounds the sum of clipped updates; "
                              f"server.aggregation = {self.server.aggregation!r} is not a sum: set "
                              f"server.aggregation = 'mean'")
        if self.privacy.secure_aggregation:
            self.check_secagg()
        if self.client.max_grad_norm > 0 and self.privacy.local == "dpsgd":
            raise ConfigError(f"client.max_grad_norm = {self.client.max_grad_norm} does nothing while privacy.local "
                              f"= 'dpsgd' (DP-SGD clips each example's gradient at privacy.local_clip): remove it")
        if self.runtime.save_adapter_every and self.peft.type != "lora":
            raise ConfigError(f"runtime.save_adapter_every = {self.runtime.save_adapter_every} writes the global "
                              f"LoRA as a PEFT folder; peft.type = {self.peft.type!r} has none: set it to 0 "
                              f"(`fedsplice export` writes every trained part)")
        self.check_hardware()
        check_generate(self)

    def check_secagg(self) -> None:
        """What Flower's SecAgg+ cannot do: the server sees only the sum of the sampled updates."""
        where = "privacy.secure_aggregation = true"
        if self.server.clients_per_round < 2:
            raise ConfigError(f"{where} sums the updates of server.clients_per_round clients, which must be >= 2 "
                              f"(Flower's SecAgg+), got {self.server.clients_per_round}")
        if self.server.aggregation != "mean":
            raise ConfigError(f"{where} gives the server only the sum of the updates; server.aggregation = "
                              f"{self.server.aggregation!r} needs each update: set server.aggregation = 'mean'")
        if self.server.update_norm_bound > 0:
            raise ConfigError(f"{where} hides each update from the server, so server.update_norm_bound cannot be "
                              f"checked: set server.update_norm_bound = 0 (privacy.mode = 'distributed' bounds it)")

    def check_hardware(self) -> None:
        """model.dtype / quantization against what trains (whether the device exists: at build)."""
        if self.model.quantization != "none" and self.peft.type != "lora":
            raise ConfigError(f"model.quantization = {self.model.quantization!r} freezes a quantized base under "
                              f"LoRA (QLoRA): set peft.type = 'lora', or model.quantization = 'none'")
        if self.model.dtype != "fp32" and self.peft.type == "full":
            raise ConfigError(f"model.dtype = {self.model.dtype!r} would train the base weights without fp32 "
                              f"masters (peft.type = 'full'): set model.dtype = 'fp32' (runtime.precision still "
                              f"runs autocast)")


DEFAULT_CONFIG = Path(__file__).parent.parent / "defaults" / "default.toml"


def apply_scoped(table: dict, overrides: list[str]) -> dict:
    """Settings that belong to one data set: `[datasets.NAME]` holds `[data]` keys that apply only
    while `data.dataset = NAME` (the shipped configs keep fortunes' cap, long tail and prompt
    there, so they do not follow a config onto a user's file). A key of the active scope that
    `[data]` sets too is ambiguous, an error; a `--set data.KEY` wins over both. Every scope is
    type-checked, active or not. The resolved config keeps no `datasets` table."""
    scopes = table.pop("datasets", {})
    if not isinstance(scopes, dict) or not all(isinstance(v, dict) for v in scopes.values()):
        raise ConfigError("datasets: expected tables [datasets.NAME] of data.* settings for data set NAME, "
                          "e.g. [datasets.fortunes] max_per_class = 60")
    for name, scope in scopes.items():
        if "dataset" in scope:
            raise ConfigError(f"datasets.{name}.dataset: a scope cannot choose the data set; set data.dataset")
        from_dict(DataConfig, scope, f"datasets.{name}")  # unknown keys and wrong types, now
    data = table.setdefault("data", {})
    if not isinstance(data, dict):
        return table  # from_dict names the wrong [data]
    given = {o.split("=", 1)[0].strip()[5:] for o in overrides if o.strip().startswith("data.")}
    name = data.get("dataset", DataConfig.dataset)
    for key, value in scopes.get(name, {}).items() if isinstance(name, str) else ():
        if key in given:
            continue
        if key in data and data[key] != value:
            raise ConfigError(f"data.{key} is set both in [data] ({data[key]!r}) and in [datasets.{name}] "
                              f"({value!r}); keep one")
        data[key] = value
    return table


def load_config(path: Path | None = None, overrides: list[str] | None = None,
                moves: Sequence[Callable[[dict], None]] = ()) -> ExperimentConfig:
    """Parse + intra-config checks only; `fedsplice.federation.validate.load_config` adds the
    cross-checks against the zoo, the data sets, the algorithms, the switches and the server
    optimizers, and passes the switches' `moves` (their settings' earlier places)."""
    table = read_toml(path or DEFAULT_CONFIG)
    apply_overrides(table, overrides or [])
    moved_settings(table, moves)
    apply_scoped(table, overrides or [])
    cfg = from_dict(ExperimentConfig, table)
    cfg.check()
    return cfg


# Settings that moved: (section, key) -> (section, key, algorithm, the old "off" value). With an
# algorithm the new place is that method's own [method] table (a method owns its settings,
# docs/extending.md); None: the setting moved for every method.
MOVED = {("peft", "ot_gamma"): ("method", "gamma", "fedotp", 0.0),
         ("peft", "ot_eps"): ("method", "eps", "fedotp", 0.1),
         ("peft", "ot_iters"): ("method", "iters", "fedotp", 100),
         ("peft", "prompt_lowrank"): ("method", "rank", "fedpgp", 0),
         ("peft", "portfolio"): ("method", "theta", "promptfolio", 0.0),
         ("peft", "private_r"): ("method", "private_r", "pfedlora", 0)}


def moved_settings(table: dict, moves: Sequence[Callable[[dict], None]] = ()) -> dict:
    """A config written before a setting moved (a user's file, a saved run's config.toml) reads
    with it in its new place: into the method's [method] table when the config runs that method,
    dropped where it held its old "off" value; set for another method, it is refused in one line
    naming where it went. `moves`: the layers above's own readers (each switch's `moved`,
    fedsplice.algorithms.switches.moves), run after these."""
    for (section, key), (new_section, new, algo, off) in MOVED.items():
        sub = table.get(section)
        if not isinstance(sub, dict) or key not in sub:
            continue
        value = sub.pop(key)
        running = table.get("algorithm", ExperimentConfig.algorithm)
        if algo is None or running == algo:
            if isinstance(table.setdefault(new_section, {}), dict):
                table[new_section].setdefault(new, value)
        elif value != off:
            shown = str(value).lower() if isinstance(value, bool) else repr(value)  # as TOML writes it
            raise ConfigError(f"{section}.{key} = {shown} is now `{new}` in the [method] table of algorithm "
                              f"{algo!r}, and this config runs algorithm {running!r}: remove it, "
                              f"or set algorithm = {algo!r} and [method] {new} = {shown}")
    for move in moves:
        move(table)
    switches = table.get("switch")
    if isinstance(switches, dict):  # `--set switch.NAME=true` turns one on with its defaults, `=false` off
        table["switch"] = {k: {} if v is True else v for k, v in switches.items() if v is not False}
    return table


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


# Settings added with one default and later given another: a saved config without one ran as
# the first default did (runtime.batch_eval / batch_train arrived "off"; "auto" since issue 50).
FIRST_DEFAULTS = {("runtime", "batch_eval"): "off", ("runtime", "batch_train"): "off"}


def first_default_sets(table: dict) -> list[str]:
    """`--set` overrides that give a saved config (a run's config.toml) the first defaults of the
    FIRST_DEFAULTS settings it lacks: a resumed run goes on as it started."""
    return [f"{section}.{key}={first!r}" for (section, key), first in FIRST_DEFAULTS.items()
            if key not in (table.get(section) or {})]


def saved_as_current(table: dict, moves: Sequence[Callable[[dict], None]] = ()) -> dict:
    """A config an earlier version saved (a run's config.toml), as this version reads it: settings
    added since take their defaults (FIRST_DEFAULTS: the one they arrived with), settings that
    moved move (moved_settings, with `moves`); a setting no longer known is a ConfigError."""
    table = copy.deepcopy(table)
    for (section, key), first in FIRST_DEFAULTS.items():
        sub = table.setdefault(section, {})
        if isinstance(sub, dict):
            sub.setdefault(key, first)
    return to_dict(from_dict(ExperimentConfig, moved_settings(table, moves)))
