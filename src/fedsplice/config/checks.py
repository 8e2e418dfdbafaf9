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
