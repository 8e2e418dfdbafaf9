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
from fedsplice.federation.batching import applies, eval_refusal, note, train_refusal, train_slower
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
    batch_train: bool = False  # runtime.batch_train applies (federation.batched_train)
    batch_notes: tuple[str, ...] = ()  # a line per batching setting not "off": what it does, or why not


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
    rc = cfg.runtime
    why = {"batch_eval": eval_refusal(cfg, recipe, infos, private_names, skeleton),
           "batch_train": train_refusal(cfg, recipe, infos, skeleton)}
    slower = {"batch_eval": None, "batch_train": train_slower(cfg, infos, skeleton)}
    notes = tuple(n for f, w in why.items() if (n := note(f, getattr(rc, f), w, slower[f])))
    return Plan(recipe, infos, shapes, scalings, global_names, private_names,
                applies("batch_eval", rc.batch_eval, why["batch_eval"]),
                applies("batch_train", rc.batch_train, why["batch_train"], slower["batch_train"]), notes)


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
