"""Where a round's clients may go through one base model together (issue 50): the plan's
decision for runtime.batch_eval (federation.batched) and runtime.batch_train
(federation.batched_train). "auto" applies either where nothing below is in the way and (for
training) it measured faster; "on" requires it, and a config it cannot apply to is refused with
the reason (no setting silently does nothing); "off" never applies it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedsplice.algorithms import prompt_parts
from fedsplice.errors import ConfigError

PROMPT_CTX = "prompt.ctx"  # a CoOp learner's context (TaskModel.prompt)

if TYPE_CHECKING:
    from fedsplice.algorithms import Recipe
    from fedsplice.config import ExperimentConfig
    from fedsplice.core.split import ParamInfo
    from fedsplice.model.taskmodel import TaskModel


def applies(field: str, setting: str, why: str | None, slower: str | None = None) -> bool:
    """Whether runtime.<field> = `setting` batches: `why` is what is in the way (None: nothing),
    `slower` why batching measured no faster for this run ("auto" then leaves it off; "on"
    batches anyway)."""
    if setting == "on" and why:
        raise ConfigError(f"runtime.{field} = 'on' cannot apply: {why}; set runtime.{field} = 'auto' or 'off'")
    return setting == "on" or setting == "auto" and why is None and slower is None


def note(field: str, setting: str, why: str | None, slower: str | None = None) -> str | None:
    """The run's line on runtime.<field> (None where it is "off"): what it does where it batches;
    where it does not under "auto", why: what is in the way, or that it measured no faster."""
    what = {"batch_eval": "the clients' PM scored together", "batch_train": "a round's clients trained together"}
    if setting == "off":
        return None
    if why is not None:  # "auto" ("on" was refused)
        return f"runtime.{field} = 'auto': one client at a time, as {why}"
    if setting == "auto" and slower is not None:
        return f"runtime.{field} = 'auto': one client at a time, as {slower}; 'on' batches anyway"
    return f"runtime.{field} = {setting!r}: {what[field]}"


def _clients(cfg: ExperimentConfig, recipe: Recipe) -> str | None:
    if cfg.runtime.kind != "simulation" or cfg.runtime.workers != 1:
        return "it needs every client in one process (runtime.kind = 'simulation', runtime.workers = 1)"
    if recipe.prior or recipe.pooled:
        return f"algorithm {cfg.algorithm!r} is a reference, not clients of one model"
    return None


def _common(cfg: ExperimentConfig, recipe: Recipe, infos: dict[str, ParamInfo], model: TaskModel) -> str | None:
    if why := _clients(cfg, recipe):
        return why
    if (cfg.peft.type != "lora" or cfg.model.task not in ("encoder_head", "dual_encoder", "causal_lm")
            or model.is_clip or model.class_side_trains):
        return ("it groups the LoRA factors of a text model's input side (peft.type = 'lora', model.task = "
                "'encoder_head', 'causal_lm' or a text 'dual_encoder' whose class side is frozen)")
    if cfg.model.quantization != "none":
        return "its grouped LoRA matmul has not been checked over a quantized base (model.quantization)"
    if any(i.kind.startswith("lora_") for i in infos.values()):  # LoraParts: adapters or tensors beside
        return f"algorithm {cfg.algorithm!r} adds LoRA parts of its own"
    return None


def eval_refusal(cfg: ExperimentConfig, recipe: Recipe, infos: dict[str, ParamInfo], private: list[str],
                 model: TaskModel) -> str | None:
    """Why the clients' PM cannot be scored together (None: it can)."""
    if why := _common(cfg, recipe, infos, model):
        return why
    if recipe.personalize is not None and recipe.personalize.predict is not None:
        return f"algorithm {cfg.algorithm!r} scores its PM with a rule of its own"
    other = [n for n in private if infos[n].kind != "lora" or infos[n].factor not in ("A", "B")]
    if other:
        return f"PRIVATE tensors other than LoRA factors differ between clients (e.g. {other[0]})"
    return None


def plain_prompt(cfg: ExperimentConfig, infos: dict[str, ParamInfo]) -> bool:
    """A dual encoder whose only trainable tensor is its CoOp context (no PromptParts: the class
    side is the learner's own), which batched_train encodes for all clients in one forward."""
    return (cfg.peft.type == "prompt" and cfg.model.task == "dual_encoder" and prompt_parts(cfg) is None
            and set(infos) == {PROMPT_CTX})


def train_slower(cfg: ExperimentConfig, infos: dict[str, ParamInfo], model: TaskModel) -> str | None:
    """Why batched training is measured no faster for this run (None: it was measured faster):
    LoRA on a text encoder gained 0.96-1.05x in fp32, 1.07-1.15x under bf16; on a causal LM's
    verbalizer 0.84x either way; a CoOp context alone 1.16-1.31x (benchmarks/batched_round.py on a
    2-core CPU; docs/performance.md)."""
    if cfg.model.task == "causal_lm":
        return "batched LoRA training of a causal LM measured slower than one client after another"
    if plain_prompt(cfg, infos) or model.amp_dtype != torch.float32:
        return None
    return "batched LoRA training measured no faster than one client after another in fp32"


def train_refusal(cfg: ExperimentConfig, recipe: Recipe, infos: dict[str, ParamInfo],
                  model: TaskModel) -> str | None:
    """Why a round's clients cannot train together (None: they can)."""
    if cfg.peft.type == "prompt":
        if why := _clients(cfg, recipe):
            return why
        if not plain_prompt(cfg, infos):
            return ("it trains a dual encoder's CoOp context alone (no prompt modules or scorer of the method's "
                    "own, model.task = 'dual_encoder')")
    elif why := _common(cfg, recipe, infos, model):
        return why
    other = [n for n, i in infos.items() if n != PROMPT_CTX and (i.kind != "lora" or i.factor not in ("A", "B"))]
    if other:
        return f"it trains LoRA factors or a CoOp context only, and this run also trains {other[0]}"
    if recipe.objective is not None or recipe.grad_transform is not None or recipe.phases:
        return f"algorithm {cfg.algorithm!r} trains with an objective, gradient rule or phases of its own"
    if cfg.privacy.local == "dpsgd":
        return "DP-SGD clips and noises each client's own examples (privacy.local = 'dpsgd')"
    if cfg.peft.dropout > 0:
        return "LoRA dropout draws its masks from each client's own stream (peft.dropout > 0)"
    if cfg.model.gradient_checkpointing and cfg.peft.type == "lora":
        return ("activation checkpointing recomputes the forward in backward, after the clients' grouped pass "
                "(model.gradient_checkpointing)")
    if cfg.runtime.precision == "fp16":
        return "fp16's gradient scaler skips steps client by client (runtime.precision = 'fp16')"
    return None
