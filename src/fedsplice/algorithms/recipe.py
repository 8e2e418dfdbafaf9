"""What an algorithm is: a `Recipe` composed from parts, built from typed hyperparameters.

No algorithm subclasses a client or a server. A method is a `build(params, infos, shapes,
scalings) -> Recipe` function over the dataclass of its `[method]` table; the federation layer
runs every recipe with the same client tasks and the same round loop (docs/design.md §2, §9).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from fedsplice.errors import ConfigError


@dataclass
class NoParams:
    """The `[method]` table of an algorithm without hyperparameters (it must be empty)."""


@dataclass(frozen=True)
class PersonalStage:
    """A private residual branch (FedPuReL phase 2): a second PEFT of the same type, trained on
    `objective` with the frozen global model's logits on the client's data in ctx.global_logits
    (a TrainContext); the client predicts with global + branch logits. Nothing of it is
    communicated but metrics.

    persistent = False (the paper's Algorithm 1): after the rounds, every training client trains
    a fresh branch for `rounds` rounds of its local budget, as the `personalize` client task.
    persistent = True (the official code): a sampled client trains its stored branch for one
    round's budget in every round (in `fit`, against the global tensors it received); PM is
    global + branch at every evaluation, and `personalize` only scores."""

    objective: Callable  # (model, texts, y, ids, ctx) -> {"task": loss}
    rounds: int
    persistent: bool = False


@dataclass(frozen=True)
class PromptParts:
    """What a method adds to a CoOp prompt model (peft.type = "prompt"); the model builds it from
    these callables (nothing here imports fedsplice.model). Its tensors' kind (ParamInfo.kind,
    what a split is written in) is the name of the module holding them.

    modules(make_prompt, prompt, gen) -> {name: module}: more trainable modules, registered on
      the model under these names after its own `prompt` (a CoOp learner: `prompt.ctx` is
      [n_ctx, width], or [C, n_ctx, width] class-specific); `make_prompt()` draws another context
      like it, `gen` is the model's seeded generator.
    class_embeddings(from_prompt, modules) -> the class side: [C, D] for the model's cosine
      scorer, or [K, C, D] for a `token_scorer`; `from_prompt(prompt, delta=None)` encodes a
      context (plus a [n_ctx, width] delta) into normalized class embeddings, and `modules`
      holds "prompt" and the method's own.
    token_scorer(tokens [B, M, D], mask [B, M], class_emb) -> scores [B, C] (before the logit
      scale): scoring from the frozen input tower's token features instead of its pooled one (the
      zero-shot model still scores by cosine)."""

    modules: Callable
    class_embeddings: Callable
    token_scorer: Callable | None = None


@dataclass(frozen=True)
class LoraParts:
    """More LoRA adapters a method puts on the modules the shared one adapts (peft.type = "lora"):
    {adapter name: rank}, each with peft.alpha / dropout / rsLoRA, all active in every forward.
    Their tensors' kind is "lora_<name>" (the shared adapter's is "lora")."""

    adapters: dict[str, int]


@dataclass
class Recipe:
    split: dict[str, str]  # trainable name -> GLOBAL or PRIVATE (fedsplice.core.split)
    # (params, ctx: TrainContext) -> scalar, added to the task loss
    loss_terms: list[Callable] = field(default_factory=list)
    # (model, texts, y, ids, ctx: TrainContext) -> {loss name: scalar}; None: cross-entropy
    objective: Callable | None = None
    grad_transform: Callable | None = None  # combines per-loss gradients (FedPuReL purification)
    trains: bool = True  # False: evaluation only (zero-shot)
    personalize: PersonalStage | None = None  # a local stage after the rounds (FedPuReL phase 2)
    # Alternating local training (pFedLoRA): ((split group, local epochs), ...), in order; each
    # phase trains only that group's tensors, with its own optimizer. Empty: one phase, all tensors.
    phases: tuple[tuple[str, int], ...] = ()
    # phases_share_budget: the phases split one local budget (client.local_epochs or max_steps)
    # in proportion to their epochs, instead of each running its own epochs
    phases_share_budget: bool = False
    needs_zero_shot: bool = False  # cache zero-shot logits of the training set
    # References (fedsplice.algorithms.references). pooled: one model trains alone on the union of
    # every training client's data each round (centralized); nothing is federated, no traffic.
    pooled: bool = False
    # prior: predict the constant logits log p(class) of training labels instead of running the
    # model (trains=False): "global" pools the training clients' labels for GM and PM; "local"
    # uses each client's own labels for its PM (GM: the pooled prior).
    prior: str | None = None


@dataclass(frozen=True)
class Algorithm:
    params: type  # the dataclass of the `[method]` table; an optional `check()` validates it
    build: Callable  # (params, infos, shapes, scalings) -> Recipe
    description: str
    paper: str = ""
    # (params, cfg) -> None: what the method needs of, or refuses in, the rest of the config (a
    # PEFT part it splits, a switch it cannot compose with). Run by `fedsplice validate` and
    # before every build, so a combination error never waits for the first fit.
    check_config: Callable | None = None
    # What the method makes of two PEFT settings other methods would misread. False: refused in
    # one line; None (register_algorithm, a `module:build` reference): not checked.
    full_ok: bool | None = False  # peft.type = "full": every backbone weight trains, no PEFT parts
    # (cfg) -> the method's name in results; None: `algorithm`, "+<optimizer>" when the server
    # optimizer is not FedAvg (registry.display_name adds the +la / +grab switches)
    label: Callable | None = None
    # (params) -> PromptParts: the modules, class side and scorer a prompt method adds to the model
    prompt_parts: Callable | None = None
    # (params) -> LoraParts: the LoRA adapters a method adds beside the shared one
    lora_parts: Callable | None = None


def default_label(cfg) -> str:
    """`algorithm`, with "+<optimizer>" when the server optimizer is not FedAvg."""
    opt = cfg.server.optimizer
    return cfg.algorithm if opt == "fedavg" else f"{cfg.algorithm}+{opt}"


def no_server_step(cfg) -> str:
    """The label of a method without a server step (local, zero-shot, the references): its name,
    whatever server.optimizer says."""
    return cfg.algorithm


def refuse_grab(cfg, objective: str) -> None:
    """Fed-GraB (grab.enabled) re-weights the plain cross-entropy; a method that trains on an
    `objective` of its own cannot take it. The one place this rule is worded."""
    if cfg.grab.enabled:
        raise ConfigError(f"grab.enabled re-weights the plain task loss, and algorithm {cfg.algorithm!r} trains "
                          f"on {objective}; set grab.enabled = false")


def clone(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies: the currency of the store and the wire, wherever the model runs."""
    return {k: v.detach().to("cpu", copy=True) for k, v in params.items()}
