"""Errors a user can fix. The CLI prints them as one line and exits 2 (no traceback)."""


class FedspliceError(Exception):
    """Base for every user-facing error: the message names the field or file and the fix."""


class ConfigError(FedspliceError):
    """A config field is unknown, mistyped or out of range."""


class ModelUnavailable(ConfigError):
    """`model.name` is a hub id that this process may not download (offline) and has not cached."""


class AssetError(FedspliceError):
    """An offline asset (model or data set) is missing, unreachable or fails its checksum."""


def need(module: str, extra: str, feature: str) -> None:
    """A one-line error when `feature` needs optional package `module`, installed by the extra
    `fedsplice[extra]` (pyproject's optional-dependencies), and this Python lacks it."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise FedspliceError(f"{feature} needs the optional package {module!r}: pip install 'fedsplice[{extra}]'")
