"""fedsplice: personalized federated fine-tuning with split (global / private) adapters.

The Python API (docs/api.md) for notebooks and scripts:

    import fedsplice
    cfg = fedsplice.load_config(None, ["server.rounds=2"])   # None: the embedded default
    res = fedsplice.run(cfg, "runs/pf")                       # a typed RunResult
    res.gm["accuracy"], res.pm["accuracy"], res.communication["up_bytes"]

Importing this package is cheap: it loads only the version. The API names below live in
`fedsplice.app.api` and are loaded on first use (PEP 562), so `import fedsplice` pulls in neither
torch nor transformers, and no module inside the package ever needs to import the package itself
(read the version from `fedsplice.version`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedsplice.version import __version__

# every public API name; each is an attribute of fedsplice.app.api
_LAZY = ("load_config", "run", "resume", "load_result", "compare", "register_algorithm", "list_algorithms",
         "load_export", "RunResult", "CompareRow", "FedspliceError", "ConfigError", "AssetError")

__all__ = ["__version__", *_LAZY]

if TYPE_CHECKING:  # static checkers and IDEs see the real signatures (__getattr__ re-exports them)
    from fedsplice.app.api import (  # noqa: F401  re-exported lazily (__getattr__)
        AssetError,
        CompareRow,
        ConfigError,
        FedspliceError,
        RunResult,
        compare,
        list_algorithms,
        load_config,
        load_export,
        load_result,
        register_algorithm,
        resume,
        run,
    )


def __getattr__(name: str):
    if name in _LAZY:
        from fedsplice.app import api  # the first use loads the API (and torch, transformers)

        value = getattr(api, name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'fedsplice' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted((set(globals()) | set(_LAZY)) - {"TYPE_CHECKING", "annotations"})
