"""The algorithms by name: the built-in ones, those users register, and `module:object` references.

A config names its algorithm in one of three ways:
- a registered name: the built-ins below, or one added with `register_algorithm` (from Python)
  or through the `fedsplice.algorithms` entry-point group (from an installed package);
- `"package.module:object"`: imported on use, where `object` is an `Algorithm` or a
  `build(params, spec: ModelSpec) -> Recipe` function whose first parameter is annotated
  with its `[method]` dataclass (no annotation: the method takes no parameters).
docs/extending.md walks through adding a method.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import warnings
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, cast

from fedsplice.algorithms.baselines import BASELINES, LORA_BASELINES
from fedsplice.algorithms.feddpa import FEDDPA
from fedsplice.algorithms.fedotp import FEDOTP
from fedsplice.algorithms.fedpgp import FEDPGP
from fedsplice.algorithms.fedpurel import FEDPUREL
from fedsplice.algorithms.flora import FLORA
from fedsplice.algorithms.hetlora import HETLORA
from fedsplice.algorithms.hooks import CheckConfig
from fedsplice.algorithms.pfadapter import PFADAPTER
from fedsplice.algorithms.pfedlora import PFEDLORA
from fedsplice.algorithms.recipe import (
    Algorithm,
    Build,
    LoraParts,
    LoraPartsOf,
    ModelSpec,
    NoParams,
    PromptParts,
    PromptPartsOf,
    Recipe,
    default_label,
)
from fedsplice.algorithms.references import REFERENCES
from fedsplice.algorithms.state import check as check_state
from fedsplice.algorithms.switches import check_recipe as check_switches
from fedsplice.algorithms.switches import labels as switch_labels
from fedsplice.config import from_dict
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from _typeshed import DataclassInstance

    from fedsplice.config import ExperimentConfig

ENTRY_POINT_GROUP = "fedsplice.algorithms"
ALGORITHMS: dict[str, Algorithm] = {"fedpurel": FEDPUREL, **BASELINES, "fedotp": FEDOTP, "fedpgp": FEDPGP,
                                    "pfadapter": PFADAPTER, "pfedlora": PFEDLORA, "feddpa": FEDDPA, "hetlora": HETLORA,
                                    "flora": FLORA, **LORA_BASELINES,
                                    **REFERENCES}  # references last: the sanity rows of a table


def register_algorithm(name: str, params_type: type = NoParams, build: Build | None = None, *,
                       description: str = "", paper: str = "", replace: bool = False,
                       check_config: CheckConfig | None = None, prompt_parts: PromptPartsOf | None = None,
                       lora_parts: LoraPartsOf | None = None) -> Algorithm:
    """Make `algorithm = name` usable in configs. `params_type` is the dataclass of its `[method]`
    table (an optional `check()` validates it); `build(params, spec)` returns the `Recipe` (spec:
    the trainable tensors' `ModelSpec`); `check_config(params, cfg)` refuses the rest of a config
    the method cannot run with (`fedsplice validate` runs it); `prompt_parts(params) -> PromptParts` adds modules to a
    prompt model, `lora_parts(params) -> LoraParts` LoRA adapters to a LoRA one. Refuses to
    shadow an existing name unless `replace=True`."""
    if not name or ":" in name:
        raise ConfigError(f"register_algorithm: name {name!r} must be non-empty and contain no ':'")
    if name in ALGORITHMS and not replace:
        raise ConfigError(f"register_algorithm: {name!r} is already registered; pass replace=True to override it")
    if not dataclasses.is_dataclass(params_type) or not callable(build):
        raise ConfigError(f"register_algorithm({name!r}): params_type must be a dataclass and build a function")
    build = spec_form(build, f"register_algorithm({name!r})")
    ALGORITHMS[name] = Algorithm(params_type, build, description or (build.__doc__ or "").strip().split("\n")[0],
                                 paper, check_config, full_ok=None, prompt_parts=prompt_parts,
                                 lora_parts=lora_parts)
    return ALGORITHMS[name]


def _as_algorithm(obj: object, where: str) -> Algorithm:
    if isinstance(obj, Algorithm):
        return dataclasses.replace(obj, build=spec_form(obj.build, where))
    if not callable(obj):
        raise ConfigError(f"algorithm: {where} is neither an Algorithm nor a build function")
    try:
        first = next(iter(inspect.signature(obj).parameters), None)
        # only the first parameter's annotation matters (others may name TYPE_CHECKING-only types)
        raw = inspect.signature(obj).parameters[first].annotation if first else inspect.Parameter.empty
        if isinstance(raw, str):
            raw = eval(raw, getattr(inspect.unwrap(obj), "__globals__", {}))  # noqa: S307 - the user's own module
    except Exception as e:  # noqa: BLE001 - any failure to read the signature is a config error
        raise ConfigError(f"algorithm: cannot read {where}'s first parameter ({type(e).__name__}: {e}); annotate "
                          f"it with the [method] dataclass, e.g. def build(p: MyParams, spec)") from None
    params = NoParams if raw is inspect.Parameter.empty else raw
    if not dataclasses.is_dataclass(params):
        raise ConfigError(f"algorithm: {where}'s first parameter must be annotated with a dataclass, got {params!r}")
    # a build function: build_recipe checks that what it returns is a Recipe
    doc = (getattr(obj, "__doc__", None) or "").strip().split("\n")[0]
    return Algorithm(params, spec_form(cast(Build, obj), where), doc, full_ok=None)


def _load_reference(ref: str) -> Algorithm:
    module, _, attr = ref.partition(":")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, ValueError (":x"), TypeError (".m:x"), …
        raise ConfigError(f"algorithm: cannot load {ref!r} ({type(e).__name__}: {e}); give "
                          f"'package.module:object' importable from this Python") from None
    return _as_algorithm(obj, repr(ref))


def _load_entry_point(ep: EntryPoint) -> Algorithm:
    try:
        obj = ep.load()
    except Exception as e:  # noqa: BLE001 - a broken plugin is a config error naming it
        raise ConfigError(f"algorithm: entry point {ep.name} = {ep.value!r} (group {ENTRY_POINT_GROUP}) "
                          f"fails to load ({type(e).__name__}: {e}); fix or uninstall that package") from None
    return _as_algorithm(obj, f"entry point {ep.value!r}")


def _from_entry_points(name: str) -> Algorithm | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            return _load_entry_point(ep)
    return None


def available() -> dict[str, Algorithm]:
    """Every algorithm a config can name: the registry plus installed entry points. A broken or
    shadowed entry point is listed with its problem as the description, never raised."""
    out = dict(ALGORITHMS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in out:
            warnings.warn(f"entry point {ep.name} = {ep.value!r} is shadowed by the registered algorithm "
                          f"of the same name", stacklevel=2)
            continue
        try:
            out[ep.name] = _load_entry_point(ep)
        except ConfigError as e:
            out[ep.name] = Algorithm(NoParams, _broken(str(e)), f"BROKEN: {e}")
    return out


def _broken(why: str) -> Build:
    """The build of an entry point that failed to load (listed, never built): its own error."""
    def build(*_: object) -> Recipe:
        raise ConfigError(why)
    return build


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


def method_params(cfg: ExperimentConfig) -> DataclassInstance:
    """The typed `[method]` table of cfg's algorithm (unknown keys are errors), after checking that
    the algorithm fits its PEFT parts (check_peft_fits) and the rest of the config (the method's
    own `check_config`). `fedsplice validate` runs this first, then the plan (federation.plan), which
    builds the recipe from the model's skeleton and runs the checks that need it (docs/design.md §11)."""
    algo = get_algorithm(cfg.algorithm)
    check_peft_fits(cfg, algo)
    try:
        params: DataclassInstance = from_dict(algo.params, cfg.method, "method")
    except ConfigError as e:
        if not dataclasses.fields(algo.params):
            raise ConfigError(f"{e}: algorithm {cfg.algorithm!r} has no [method] fields "
                              f"(switching algorithms with --set? add --set method={{}})") from None
        theirs = sorted(n for n, a in ALGORITHMS.items() if n != cfg.algorithm
                        and any(f"method.{f.name}:" in str(e) for f in dataclasses.fields(a.params)))
        if theirs:  # the table of the method the config was written for
            raise ConfigError(f"{e} (a setting of algorithm {theirs[0]!r}: switching algorithms with --set? "
                              f"add --set method={{}})") from None
        raise
    if hasattr(params, "check"):
        params.check()
    if algo.check_config is not None:
        algo.check_config(params, cfg)
    return params


def prompt_parts(cfg: ExperimentConfig) -> PromptParts | None:
    """The `PromptParts` cfg's algorithm adds to a CoOp prompt model; None: the plain prompt."""
    algo = get_algorithm(cfg.algorithm)
    if algo.prompt_parts is None or cfg.peft.type != "prompt":
        return None
    return algo.prompt_parts(method_params(cfg))


def lora_parts(cfg: ExperimentConfig) -> LoraParts | None:
    """The `LoraParts` cfg's algorithm adds beside the shared LoRA adapter; None: nothing."""
    algo = get_algorithm(cfg.algorithm)
    if algo.lora_parts is None or cfg.peft.type != "lora":
        return None
    return algo.lora_parts(method_params(cfg))


def check_peft_fits(cfg: ExperimentConfig, algo: Algorithm) -> None:
    """Refuse a PEFT type the algorithm says it would misread (Algorithm.full_ok)."""
    if cfg.peft.type == "full" and algo.full_ok is False:
        ok = [n for n, a in ALGORITHMS.items() if a.full_ok]
        raise ConfigError(f"peft.type = 'full' trains the whole backbone, without the LoRA/prompt/adapter parts "
                          f"algorithm {cfg.algorithm!r} splits or freezes; use algorithm = 'full-ft' "
                          f"(or one of {', '.join(n for n in ok if n != 'full-ft')}), or another peft.type")


def spec_form(build: Build, where: str) -> Build:
    """`build(params, spec)`; a build of the earlier form `build(params, infos, shapes, scalings)`
    (three or more positional parameters, or `*args`) is called that way, with a FutureWarning."""
    try:
        ps = list(inspect.signature(build).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C callable): taken as written
        return build
    positional = [q for q in ps if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 3 and not any(q.kind == q.VAR_POSITIONAL for q in ps):
        return build
    warnings.warn(f"{where}: build(params, infos, shapes, scalings) is the earlier form; write build(params, spec) "
                  f"and read spec.infos, spec.shapes, spec.scalings (fedsplice.algorithms.ModelSpec)",
                  FutureWarning, stacklevel=3)

    def adapted(params: object, spec: ModelSpec, /) -> Recipe:
        return cast(Recipe, cast(Callable[..., object], build)(params, spec.infos, spec.shapes, spec.scalings))
    return adapted


def build_recipe(cfg: ExperimentConfig, spec: ModelSpec) -> Recipe:
    algo = get_algorithm(cfg.algorithm)
    recipe = algo.build(method_params(cfg), spec)
    if not isinstance(recipe, Recipe):
        raise ConfigError(f"algorithm {cfg.algorithm!r}: build returned {type(recipe).__name__}, not a Recipe")
    S.validate(recipe.split, list(spec.infos))
    try:
        check_state(recipe.state)
    except TypeError as e:
        raise ConfigError(f"algorithm {cfg.algorithm!r}: {e}") from None
    check_switches(cfg, recipe)
    return recipe


def display_name(cfg: ExperimentConfig) -> str:
    """The label in results: fedyogi-lora, pfadapter, pfadapter+fedadam, local…"""
    algo = get_algorithm(cfg.algorithm)
    name = (algo.label or default_label)(cfg)
    return name + switch_labels(cfg)
