"""Field checks shared by the config sections: one-line ConfigErrors that name the dotted field."""

from __future__ import annotations

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
