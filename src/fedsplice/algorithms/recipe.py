"""What an algorithm is: a `Recipe` composed from parts, built from typed hyperparameters. The
hooks' signatures are Protocols in `fedsplice.algorithms.hooks` (ClientOps among them).

No algorithm subclasses a client or a server. A method is a `build(params, spec) -> Recipe`
function over the dataclass of its `[method]` table and the model's `ModelSpec`; the federation layer
runs every recipe with the same client tasks and the same round loop (docs/design.md §2, §9).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol

import torch

from fedsplice.algorithms.hooks import (
    After,
    Around,
    BesideAdd,
    BesideInit,
    CheckConfig,
    ClassEmbeddings,
    ClientOps,
    Fit,
    GradTransform,
    Label,
    LossTerm,
    Objective,
    Predict,
    PromptModules,
    Receive,
    S,
    Scorer,
    Send,
    Tensors,
)
from fedsplice.core.context import TaskLoss
from fedsplice.core.split import ParamInfo

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig

# what a build reads of the trainable tensors: name -> what it is, its shape, its LoRA scale
Infos = Mapping[str, ParamInfo]
Shapes = Mapping[str, tuple[int, ...]]
Scalings = Mapping[str, float]


@dataclass(frozen=True)
class ModelSpec:
    """What a method's `build(params, spec)` sees of the model: every trainable tensor by name,
    with what it is (`infos`: kind, role, layer), its shape and its LoRA scaling (alpha/r, or
    alpha/sqrt(r) with rsLoRA). Known before any weight loads: federation.plan builds it from the
    model's skeleton on the meta device."""

    infos: Infos
    shapes: Shapes
    scalings: Scalings


@dataclass
class NoParams:
    """The `[method]` table of an algorithm without hyperparameters (it must be empty)."""


@dataclass(frozen=True)
class Personal(Generic[S]):
    """A method's own local stage (FedPuReL phase 2), as hooks the client tasks call with a
    `ClientOps` and the method's slot: its state (Recipe.state: a dataclass, or a tensor dict),
    kept by the client between its tasks (fresh before the first write). Nothing of it is
    communicated but metrics.

    fit(ops, rnd, received, slot) -> slot: in every round the client is sampled, before its
      local training on the GLOBAL tensors `received`.
    predict(ops, params, slot) -> test logits [n_test, C]: the personalized model (PM) at every
      evaluation, `params` the GLOBAL + the client's PRIVATE tensors (None: the model on them).
    after(ops, global_params, slot) -> test logits: the `personalize` client task after the
      rounds, the PM reported last (None: no such task).
    after_rounds: how many rounds of the local budget `after` trains (the progress estimate)."""

    fit: Fit[S] | None = None
    predict: Predict[S] | None = None
    after: After[S] | None = None
    after_rounds: int = 0


@dataclass(frozen=True)
class Exchange(Generic[S]):
    """A method's own rules for what travels (HetLoRA), around the generic round: every hook is
    optional and sees the method's client slot (the state `Personal` uses too).

    receive(ops, rnd, received, slot) -> (tensors, slot): on the client, the tensors it trains
      from: the GLOBAL ones (e.g. truncated to its rank) instead of those received, and any
      PRIVATE ones to reset (e.g. a fresh LoRA); TrainContext.state is the returned slot during
      the round's training.
    send(ops, rnd, trained, slot) -> (upload, slot, stats): on the client, from every trainable
      tensor as trained, the GLOBAL tensors it uploads (same names and shapes as received), and
      scalar statistics for the round record. A statistic "weight/<GLOBAL tensor>"
      (core.server.OWN_WEIGHT) is the client's own aggregation weight of that tensor instead of
      its sample count, as a Flower client reports num_examples (HetLoRA's sparsity weights): the
      server normalizes each tensor's weights over the round (server.aggregation = "mean" only;
      the method's check_config refuses DP-FedAvg and SecAgg+: config.privacy.refuse_own_weights)."""

    receive: Receive[S] | None = None
    send: Send[S] | None = None


@dataclass(frozen=True)
class PromptParts:
    """What a method adds to a CoOp prompt model (peft.type = "prompt"); the model builds it from
    these callables (nothing here imports fedsplice.model). Its tensors' kind (ParamInfo.kind,
    what a split is written in) is the name of the module holding them.

    modules(make_prompt, prompt, gen) -> {name: module}: more trainable modules, registered on
      the model under these names after its own `prompt` (a CoOp learner: `prompt.ctx` is
      [n_ctx, width], or [C, n_ctx, width] class-specific); `make_prompt()` draws another context
      like it, `gen` is the model's seeded generator.
    class_embeddings(encode, modules) -> the class side: [C, D] for the model's cosine scorer,
      or what a `scorer` reads; `encode(learner, ctx=None)` encodes a CoOp learner's
      class sequences around `ctx` (a context of its shape; None: its own) into normalized class
      embeddings, and `modules` holds "prompt" and the method's own.
    scorer(inputs, class_emb) -> scores [B, C] (before the logit scale): the method's own scoring
      of a batch in place of the cosine of its pooled features, from the views `inputs` offers
      (hooks.InputViews: the pooled features, the frozen tower's token features); None: cosine.
      The zero-shot model still scores by cosine."""

    modules: PromptModules
    class_embeddings: ClassEmbeddings
    scorer: Scorer | None = None


@dataclass(frozen=True)
class Beside:
    """A tensor a method puts beside the LoRA of every adapted Linear, and what it adds to that
    Linear's output in the forward (nothing with the adapters off, as in zero-shot): e.g. FLoRA's
    dense merged base ΔW (zeros, + x ΔWᵀ). `init(out_features, in_features)` -> its start value;
    `add(x, tensor)` -> the term added to the Linear's output for input x."""

    init: BesideInit
    add: BesideAdd


@dataclass(frozen=True)
class LoraParts:
    """More LoRA adapters a method puts on the modules the shared one adapts (peft.type = "lora"):
    {adapter name: rank}, each with peft.alpha / dropout / rsLoRA, all active in every forward.
    Their tensors' kind is "lora_<name>" (the shared adapter's is "lora"). `beside` ({name:
    Beside}): a tensor of the method's own per adapted module, "<module>.lora_<name>" (kind
    "lora_<name>"), and its term in the module's output."""

    adapters: Mapping[str, int] = field(default_factory=dict)
    beside: Mapping[str, Beside] = field(default_factory=dict)


class Phase(NamedTuple):
    """One phase of alternating local training (Recipe.phases): only the split `group`'s tensors
    train (the others frozen), for `epochs` local epochs, with an optimizer of its own; with
    `around`, the phase's forwards run under that change to the model (FedDPA: its adapter mix,
    feddpa.Mix)."""

    group: str
    epochs: int
    around: Around | None = None


@dataclass
class Recipe(Generic[S]):
    """A method's parts (docs/extending.md's table). Generic in the method's client state `S`
    (`state`): a build annotated `-> Recipe[MyState]` has its Personal and Exchange hooks checked
    against MyState by mypy; a bare `Recipe` takes any."""

    split: dict[str, str]  # trainable name -> GLOBAL or PRIVATE (fedsplice.core.split)
    # (params, ctx: TrainContext) -> scalar, added to the task loss
    loss_terms: list[LossTerm] = field(default_factory=list)
    # (model, texts, y, ids, ctx: TrainContext) -> {loss name: scalar}; None: cross-entropy
    objective: Objective | None = None
    grad_transform: GradTransform | None = None  # combines per-loss gradients (FedPuReL purification)
    trains: bool = True  # False: evaluation only (zero-shot)
    personalize: Personal[S] | None = None  # the method's own local stage (FedPuReL phase 2)
    exchange: Exchange[S] | None = None  # the method's own download and upload (HetLoRA, FLoRA, FedPuReL)
    # Alternating local training (pFedLoRA, FedDPA): Phase(group, epochs[, around]) tuples, in
    # order; each phase trains only that group's tensors, with its own optimizer. Or a function
    # round -> those phases (FedDPA: round 0 has no local phase). Empty: one phase, all tensors.
    phases: tuple[Phase | tuple[str, int], ...] | PhasesOf = ()
    # phases_share_budget: the phases split one local budget (client.local_epochs or max_steps)
    # in proportion to their epochs, instead of each running its own epochs
    phases_share_budget: bool = False
    # the method's own client state, the `slot` its Personal and Exchange hooks get and return:
    # a dataclass (HetLoRA's rank, an int; FedPuReL's branch, a dict of tensors), or dict (a tensor dict);
    # fedsplice.algorithms.state says which fields it can hold and how it is stored
    state: type[S] = dict  # type: ignore[assignment]  # S's default: a tensor dict
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
    build: Build  # (params, spec) -> Recipe
    description: str
    paper: str = ""
    # (params, cfg) -> None: what the method needs of, or refuses in, the rest of the config (a
    # PEFT part it splits, a switch it cannot compose with). Run by `fedsplice validate` and
    # before every build, so a combination error never waits for the first fit.
    check_config: CheckConfig | None = None
    # What the method makes of two PEFT settings other methods would misread. False: refused in
    # one line; None (register_algorithm, a `module:build` reference): not checked.
    full_ok: bool | None = False  # peft.type = "full": every backbone weight trains, no PEFT parts
    # (cfg) -> the method's name in results; None: `algorithm`, "+<optimizer>" when the server
    # optimizer is not FedAvg (registry.display_name adds the switches' labels: +la, +grab)
    label: Label | None = None
    # (params) -> PromptParts: the modules, class side and scorer a prompt method adds to the model
    prompt_parts: PromptPartsOf | None = None
    # (params) -> LoraParts: the LoRA adapters a method adds beside the shared one
    lora_parts: LoraPartsOf | None = None


class Wrap(Protocol):
    """Link.wrap: the task loss a switch makes of the one it is given (the next switch's, or
    cross-entropy)."""

    def __call__(self, inner: TaskLoss, /) -> TaskLoss: ...


class StartSwitch(Protocol):
    """Switch.start, on the client, before its local training: (its [switch.NAME] dataclass, the
    client, what the client kept of the switch ({} at first), the GLOBAL tensors received) -> Link."""

    def __call__(self, params: Any, ops: ClientOps, kept: Tensors, received: Tensors, /) -> Link: ...


class CheckRecipe(Protocol):
    """Switch.check_recipe: raise a one-line ConfigError for a method the switch cannot compose with."""

    def __call__(self, params: Any, cfg: ExperimentConfig, recipe: Recipe, /) -> None: ...


class MoveSettings(Protocol):
    """Switch.moved: rewrite, in place, a raw config table that holds the switch's settings where
    an earlier version kept them (a user's old file, a saved run's config.toml)."""

    def __call__(self, table: dict[str, Any], /) -> None: ...


class Kept(Protocol):
    """Link.state: what the client keeps of a switch after its local training."""

    def __call__(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Link:
    """A switch's part in one client's local training: `wrap` makes the task loss objectives
    call (TrainContext.task_loss) from the one it is given; `state` is what the client keeps of
    the switch for its next round (PRIVATE, never sent; {} for a switch without state)."""

    wrap: Wrap
    state: Kept = dict


@dataclass(frozen=True)
class Switch:
    """A setting that composes onto any method through the task loss (logit adjustment,
    Fed-GraB): declared once, in its own file, and registered by name (`[switch.NAME]` in a
    config turns it on; fedsplice.algorithms.switches). The one training loop chains the active
    switches' links; no objective names them."""

    params: type  # the dataclass of its [switch.NAME] table; an optional `check()` validates it
    start: StartSwitch  # (params, ops, kept, received) -> Link, on the client before each local training
    description: str
    paper: str
    label: str  # added to the run's name in results ("+grab")
    check_config: CheckConfig | None = None  # (params, cfg): the rest of the config it refuses
    check_recipe: CheckRecipe | None = None  # (params, cfg, recipe): the methods it cannot compose with
    moved: MoveSettings | None = None  # reads an earlier version's layout of its settings


class PhasesOf(Protocol):
    """Recipe.phases as a function: round -> the round's local phases (FedDPA: none in round 0)."""

    def __call__(self, rnd: int, /) -> tuple[Phase, ...]: ...


class Build(Protocol):
    """Algorithm.build: the method's recipe from its `[method]` table and the model's trainable
    tensors (names, roles, shapes, LoRA scalings: known before any weight loads, federation.plan)."""

    def __call__(self, params: Any, spec: ModelSpec, /) -> Recipe: ...


class PromptPartsOf(Protocol):
    def __call__(self, params: Any, /) -> PromptParts | None: ...


class LoraPartsOf(Protocol):
    def __call__(self, params: Any, /) -> LoraParts | None: ...


def default_label(cfg: ExperimentConfig) -> str:
    """`algorithm`, with "+<optimizer>" when the server optimizer is not FedAvg."""
    opt = cfg.server.optimizer
    return cfg.algorithm if opt == "fedavg" else f"{cfg.algorithm}+{opt}"


def no_server_step(cfg: ExperimentConfig) -> str:
    """The label of a method without a server step (local, zero-shot, the references): its name,
    whatever server.optimizer says."""
    return cfg.algorithm


def clone(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies: the currency of the store and the wire, wherever the model runs."""
    return {k: v.detach().to("cpu", copy=True) for k, v in params.items()}
