"""The switches by name: settings that compose onto any method through the task loss
(`fedsplice.algorithms.recipe.Switch`). A config turns one on with its table, `[switch.NAME]`
(its settings inside; an empty table takes the defaults). `register_switch` adds a user's own.

The active switches chain in registry order, the first outermost: logit adjustment shifts the
logits that Fed-GraB's re-weighted loss then sees, and cross-entropy is innermost.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fedsplice.algorithms.grab import GRAB
from fedsplice.algorithms.logit_adjustment import LOGIT_ADJUSTMENT
from fedsplice.algorithms.recipe import Link, Switch
from fedsplice.config import from_dict
from fedsplice.core.context import TaskLoss, cross_entropy
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.algorithms.recipe import MoveSettings, Recipe
    from fedsplice.config import ExperimentConfig

SWITCHES: dict[str, Switch] = {"logit_adjustment": LOGIT_ADJUSTMENT, "grab": GRAB}


def register_switch(name: str, switch: Switch, *, replace: bool = False) -> Switch:
    """Make `[switch.NAME]` usable in configs; it chains after (inside) the switches registered before."""
    if not name.isidentifier():
        raise ConfigError(f"register_switch: name {name!r} must be an identifier (it is a TOML key)")
    if name in SWITCHES and not replace:
        raise ConfigError(f"register_switch: {name!r} is already registered; pass replace=True to override it")
    if not isinstance(switch, Switch) or not dataclasses.is_dataclass(switch.params):
        raise ConfigError(f"register_switch({name!r}): expected a Switch whose params is a dataclass")
    SWITCHES[name] = switch
    return switch


def moves() -> list[MoveSettings]:
    """Each switch's reader of its settings' earlier places (fedsplice.config.load_config(moves=...))."""
    return [s.moved for s in SWITCHES.values() if s.moved is not None]


def switch_params(cfg: ExperimentConfig) -> dict[str, Any]:
    """{name: its typed [switch.NAME] table} of cfg's switches, in chain order, each checked
    against the rest of the config (`fedsplice validate` runs this)."""
    for name in cfg.switch:
        if name not in SWITCHES:
            raise ConfigError(f"switch.{name}: unknown switch; choose one of {', '.join(SWITCHES)}")
    out = {}
    for name, sw in SWITCHES.items():
        if name not in cfg.switch:
            continue
        table = cfg.switch[name]
        if not isinstance(table, dict):
            raise ConfigError(f"switch.{name} must be a table ([switch.{name}], its settings inside), got {table!r}")
        params = from_dict(sw.params, table, f"switch.{name}")
        if hasattr(params, "check"):
            params.check()
        if sw.check_config is not None:
            sw.check_config(params, cfg)
        out[name] = params
    return out


def check_recipe(cfg: ExperimentConfig, recipe: Recipe) -> None:
    """The switches' refusals of the method's recipe (its own objective, ...)."""
    for name, params in switch_params(cfg).items():
        check = SWITCHES[name].check_recipe
        if check is not None:
            check(params, cfg, recipe)


def labels(cfg: ExperimentConfig) -> str:
    """The switches' part of the run's name: "+la", "+grab", ..."""
    return "".join(SWITCHES[n].label for n in SWITCHES if n in cfg.switch)


def chain(links: list[Link]) -> TaskLoss:
    """The task loss of `links` (in chain order, the first outermost) around cross-entropy."""
    loss: TaskLoss = cross_entropy
    for link in reversed(links):
        loss = link.wrap(loss)
    return loss
