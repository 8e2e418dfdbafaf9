"""Field checks shared by the config sections: one-line ConfigErrors that name the dotted field."""

from __future__ import annotations

import re

from fedsplice.errors import ConfigError

ROLES = ("q", "k", "v", "o")


def check_positive(name: str, value) -> None:
    if not value > 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def check_roles(name: str, roles) -> None:
    """Every entry of `roles` is an attention role (q, k, v, o); `name` is the dotted field."""
    bad = [r for r in roles if r not in ROLES]
    if bad:
        raise ConfigError(f"{name}: unknown role(s) {bad}; roles are q, k, v, o")


DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_device_name(name: str, value: str) -> None:
    """The spelling of a device (whether this machine has it is checked when a model is built)."""
    if not DEVICE.match(value):
        raise ConfigError(f"{name} = {value!r}: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'")


def refuse_inert(section: str, obj, fields: tuple[str, ...], while_: str, fix: str) -> None:
    """A setting the rest of the config makes ineffective is an error, not silence (a noise
    multiplier under privacy.mode = "off" leaves the run without privacy and says nothing). A
    field counts as set where it differs from its default, so a saved run's full config.toml,
    which writes every default, reads as before."""
    default = type(obj)()
    changed = [f for f in fields if getattr(obj, f) != getattr(default, f)]
    if changed:
        shown = ", ".join(f"{section}.{f} = {getattr(obj, f)!r}" for f in changed)
        one = len(changed) == 1
        raise ConfigError(f"{shown} {'does' if one else 'do'} nothing while {while_}: {fix}, or remove "
                          f"{'it' if one else 'them'}")
