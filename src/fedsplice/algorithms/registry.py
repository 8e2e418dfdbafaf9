"""The algorithms by name: the built-in ones, those users register, and `module:object` references.

A config names its algorithm in one of three ways:
- a registered name: the built-ins below, or one added with `register_algorithm` (from Python)
  or through the `fedsplice.algorithms` entry-point group (from an installed package);
- `"package.module:object"`: imported on use, where `object` is an `Algorithm` or a
  `build(params, infos, shapes, scalings) -> Recipe` function whose first parameter is annotated
  with its `[method]` dataclass (no annotation: the method takes no parameters).
docs/extending.md walks through adding a method.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import typing
from importlib.metadata import entry_points
from typing import Callable

from fedsplice.algorithms.baselines import BASELINES, LORA_BASELINES
from fedsplice.algorithms.fedpurel import FEDPUREL
from fedsplice.algorithms.pfadapter import PFADAPTER
from fedsplice.algorithms.recipe import Algorithm, NoParams, Recipe
from fedsplice.config import from_dict
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

ENTRY_POINT_GROUP = "fedsplice.algorithms"
ALGORITHMS: dict[str, Algorithm] = {"fedpurel": FEDPUREL, **BASELINES, "pfadapter": PFADAPTER, **LORA_BASELINES}


def register_algorithm(name: str, params_type: type = NoParams, build: Callable | None = None, *,
                       description: str = "", paper: str = "", replace: bool = False) -> Algorithm:
    """Make `algorithm = name` usable in configs. `params_type` is the dataclass of its `[method]`
    table (an optional `check()` validates it); `build(params, infos, shapes, scalings)` returns
    the `Recipe`. Refuses to shadow an existing name unless `replace=True`."""
    if not name or ":" in name:
        raise ConfigError(f"register_algorithm: name {name!r} must be non-empty and contain no ':'")
    if name in ALGORITHMS and not replace:
        raise ConfigError(f"register_algorithm: {name!r} is already registered; pass replace=True to override it")
    if not dataclasses.is_dataclass(params_type) or not callable(build):
        raise ConfigError(f"register_algorithm({name!r}): params_type must be a dataclass and build a function")
    ALGORITHMS[name] = Algorithm(params_type, build, description or (build.__doc__ or "").strip().split("\n")[0],
                                 paper)
    return ALGORITHMS[name]


def _as_algorithm(obj, where: str) -> Algorithm:
    if isinstance(obj, Algorithm):
        return obj
    if not callable(obj):
        raise ConfigError(f"algorithm: {where} is neither an Algorithm nor a build function")
    first = next(iter(inspect.signature(obj).parameters), None)
    params = typing.get_type_hints(obj).get(first, NoParams) if first else NoParams
    if not dataclasses.is_dataclass(params):
        raise ConfigError(f"algorithm: {where}'s first parameter must be annotated with a dataclass, got {params!r}")
    return Algorithm(params, obj, (obj.__doc__ or "").strip().split("\n")[0])


def _load_reference(ref: str) -> Algorithm:
    module, _, attr = ref.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"algorithm: cannot load {ref!r} ({type(e).__name__}: {e}); give "
                          f"'package.module:object' importable from this Python") from None
    return _as_algorithm(obj, repr(ref))


def _from_entry_points(name: str) -> Algorithm | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return _as_algorithm(ep.load(), f"entry point {ep.value!r}")
    return None


def available() -> dict[str, Algorithm]:
    """Every algorithm a config can name: the registry plus installed entry points."""
    out = dict(ALGORITHMS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        out.setdefault(ep.name, _as_algorithm(ep.load(), f"entry point {ep.value!r}"))
    return out


def get_algorithm(name: str) -> Algorithm:
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in name:
        return _load_reference(name)
    found = _from_entry_points(name)
    if found is None:
        raise ConfigError(f"algorithm: unknown {name!r}; choose one of {', '.join(ALGORITHMS)}, "
                          f"or 'package.module:build' for your own (docs/extending.md)")
    return found


def method_params(cfg):
    """The typed `[method]` table of cfg's algorithm (unknown keys are errors)."""
    algo = get_algorithm(cfg.algorithm)
    try:
        params = from_dict(algo.params, cfg.method, "method")
    except ConfigError as e:
        if not dataclasses.fields(algo.params):
            raise ConfigError(f"{e}: algorithm {cfg.algorithm!r} has no [method] fields "
                              f"(switching algorithms with --set? add --set method={{}})") from None
        raise
    if hasattr(params, "check"):
        params.check()
    return params


def build_recipe(cfg, infos, shapes, scalings) -> Recipe:
    algo = get_algorithm(cfg.algorithm)
    recipe = algo.build(method_params(cfg), infos, shapes, scalings)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"algorithm {cfg.algorithm!r}: build returned {type(recipe).__name__}, not a Recipe")
    S.validate(recipe.split, list(infos))
    return recipe


def display_name(cfg) -> str:
    """The label in results: fedyogi-lora, pfadapter, pfadapter+fedadam, local…"""
    opt = cfg.server.optimizer
    if cfg.algorithm == "lora":
        name = f"{opt}-lora"
    elif opt == "fedavg" or cfg.algorithm in ("local", "zeroshot"):
        name = cfg.algorithm
    else:
        name = f"{cfg.algorithm}+{opt}"
    if cfg.algorithm == "fedpurel":
        name += f"-{cfg.peft.type}"
    return name + ("+la" if cfg.client.logit_adjustment > 0 else "")
