"""Plan, then load: the recipe of a config and every check across its sections, without weights.

`plan(cfg)` builds the model's skeleton (the backbone from its config on the meta device, the
trainable modules on the host: `TaskModel(skeleton=True)`), derives the parameter infos, shapes
and LoRA scalings from it, builds the method's recipe and runs the checks that combine the
recipe with the rest of the config:

- PEFT × task (`peft.type = "prompt"` needs a dual encoder);
- references × federation (centralized trains alone: no server optimizer, no codec; a prior
  reference needs the labels on the server);
- privacy × exchange (DP-FedAvg and SecAgg+ need something sent; a method weighing its own uploads
  refuses them in its check_config);
- DP-SGD × recipe (a loss or gradient rule of the method's own, a personal stage, a class side);
- generate × recipe (class logits a free-text task does not have).

`fedsplice validate` runs it before reading any data; `federation.experiment.build` runs it with
the data's class names before the weights load, and the model it loads must have the planned
tensors (`check_loaded`). A skeleton built without the data's class names has placeholder
classes: class-sized shapes (a head, class-specific prompts) are then not the run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fedsplice.algorithms import ModelSpec, Recipe, build_recipe
from fedsplice.config import ExperimentConfig
from fedsplice.core.split import GLOBAL, PRIVATE, ParamInfo, names_in
from fedsplice.errors import ConfigError
from fedsplice.federation.dpsgd import check as dpsgd_check
from fedsplice.federation.generative import check_recipe as check_generate_recipe
from fedsplice.federation.pooled import check_reference
from fedsplice.federation.privacy import check_recipe as check_privacy
from fedsplice.model.loading import check_peft_fits_task
from fedsplice.model.taskmodel import TaskModel

PLACEHOLDER_CLASSES = ["class a", "class b"]  # a plan without the data: names and roles, not class counts


@dataclass(frozen=True)
class Plan:
    """What a run of `cfg` trains and shares, known before any weight loads."""

    recipe: Recipe
    infos: dict[str, ParamInfo]
    shapes: dict[str, tuple[int, ...]]
    scalings: dict[str, float]
    global_names: list[str]
    private_names: list[str]
    batch_eval: bool = False  # runtime.batch_eval applies (federation.batched)


def plan(cfg: ExperimentConfig, class_names: list[str] | None = None, class_prompt: str = "") -> Plan:
    """The recipe of `cfg` and every combination check, from the model's skeleton (no weights).
    `cfg` has passed its own checks (`federation.validate.load_config`)."""
    check_peft_fits_task(cfg.peft.type, cfg.model.task)
    skeleton = TaskModel(cfg, class_names or PLACEHOLDER_CLASSES, class_prompt, skeleton=True)
    params = skeleton.trainable()
    infos, scalings = skeleton.param_infos(), skeleton.scalings()
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    recipe = build_recipe(cfg, ModelSpec(infos, shapes, scalings))
    global_names, private_names = names_in(recipe.split, GLOBAL), names_in(recipe.split, PRIVATE)
    check_recipe(cfg, recipe, global_names, skeleton)
    why = batch_refusal(cfg, recipe, infos, private_names, skeleton)
    if cfg.runtime.batch_eval == "on" and why:
        raise ConfigError(f"runtime.batch_eval = 'on' cannot apply: {why}; set runtime.batch_eval = 'auto' or 'off'")
    return Plan(recipe, infos, shapes, scalings, global_names, private_names,
                batch_eval=cfg.runtime.batch_eval != "off" and why is None)


def batch_refusal(cfg: ExperimentConfig, recipe: Recipe, infos: dict[str, ParamInfo], private: list[str],
                  model: TaskModel) -> str | None:
    """Why the PM evaluation cannot run batched for this config (None: it can): runtime.batch_eval,
    federation.batched."""
    if cfg.runtime.kind != "simulation" or cfg.runtime.workers != 1:
        return "it needs every client in one process (runtime.kind = 'simulation', runtime.workers = 1)"
    if recipe.prior or recipe.pooled:
        return f"algorithm {cfg.algorithm!r} is a reference whose PM is no client model"
    if (cfg.peft.type != "lora" or cfg.model.task not in ("encoder_head", "dual_encoder") or model.is_clip
            or model.class_side_trains):
        return ("it groups the LoRA factors of a text encoder's input side (peft.type = 'lora', model.task = "
                "'encoder_head' or a text 'dual_encoder' whose class side is frozen)")
    if recipe.personalize is not None and recipe.personalize.predict is not None:
        return f"algorithm {cfg.algorithm!r} scores its PM with a rule of its own"
    if any(i.kind.startswith("lora_") for i in infos.values()):  # LoraParts: adapters or tensors beside
        return f"algorithm {cfg.algorithm!r} adds LoRA parts of its own"
    other = [n for n in private if infos[n].kind != "lora" or infos[n].factor not in ("A", "B")]
    if other:
        return f"PRIVATE tensors other than LoRA factors differ between clients (e.g. {other[0]})"
    return None


def check_recipe(cfg: ExperimentConfig, recipe: Recipe, global_names: list[str], model: TaskModel) -> None:
    """The checks that need the recipe (and the model's module types: DP-SGD), in a fixed order."""
    if cfg.model.task == "generate":
        check_generate_recipe(cfg, recipe)
    check_reference(cfg, recipe)
    check_privacy(cfg, recipe, global_names)
    dpsgd_check(cfg, recipe, model)


def check_loaded(planned: Plan, model: TaskModel) -> None:
    """The loaded model has exactly the planned trainable tensors (names, shapes, roles, LoRA
    scalings): a run starts from its plan."""
    params = model.trainable()
    pairs: list[tuple[str, Mapping[str, object], Mapping[str, object]]] = [
        ("shapes", planned.shapes, {n: tuple(p.shape) for n, p in params.items()}),
        ("roles", planned.infos, model.param_infos()), ("LoRA scalings", planned.scalings, model.scalings())]
    for what, want, have in pairs:
        if want != have:
            diff = sorted(set(want.items()) ^ set(have.items()), key=str)[:3]
            raise RuntimeError(f"the loaded model's trainable {what} differ from the plan's (first: {diff}); "
                               f"the meta-device skeleton and the loaded model must build the same modules")
