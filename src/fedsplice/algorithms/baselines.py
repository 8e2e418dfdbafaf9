"""The baselines both papers compare against, each a split over the same PEFT (docs/design.md §3.3).

The server optimizer (`[server] optimizer`) is orthogonal to the method: `lora` + fedyogi is
FedYogi-LoRA. `full-ft` has no PEFT at all (peft.type = "full"): the cost reference of LoRA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fedsplice.algorithms.hooks import CheckConfig, ClientOps, Tensors
from fedsplice.algorithms.promptfolio import PROMPTFOLIO
from fedsplice.algorithms.recipe import Algorithm, Exchange, ModelSpec, NoParams, Recipe, no_server_step
from fedsplice.core import split as S
from fedsplice.core.losses import proximal
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig
    from fedsplice.core.context import TrainContext


@dataclass
class FedProxParams:
    mu: float = 0.01

    def check(self) -> None:
        if self.mu < 0:
            raise ConfigError(f"method.mu must be >= 0, got {self.mu}")


@dataclass
class FedProxState:
    """What FedProx keeps during a local update (Recipe.state): the GLOBAL tensors it received."""

    ref: dict[str, torch.Tensor] = field(default_factory=dict)


class Proximal:
    """FedProx: μ/2·‖θ_g − θ_g⁰‖² over GLOBAL tensors, θ_g⁰ the weights received this round
    (ctx.state.ref, kept by the method's Exchange.receive)."""

    def __init__(self, global_names: list[str], mu: float):
        self.names = list(global_names)
        self.mu = mu

    def __call__(self, params: Mapping[str, torch.Tensor], ctx: TrainContext) -> torch.Tensor:
        state = ctx.state
        assert isinstance(state, FedProxState), "FedProx's loss term runs with its own state"
        return proximal(params, state.ref, self.names, self.mu)


def keep_received(ops: ClientOps, rnd: int, received: Tensors, st: FedProxState) -> tuple[Tensors, FedProxState]:
    return received, FedProxState(dict(received))


def drop_received(ops: ClientOps, rnd: int, trained: Tensors,
                  st: FedProxState) -> tuple[Tensors, FedProxState, dict[str, float]]:
    return trained, FedProxState(), {}  # the reference is the next round's download: not stored


def fedprox(p: FedProxParams, spec: ModelSpec) -> Recipe[FedProxState]:
    split = S.all_global(spec.infos)
    if p.mu == 0:  # FedAvg
        return Recipe(split)
    return Recipe(split, [Proximal(S.names_in(split, S.GLOBAL), p.mu)], exchange=Exchange(keep_received, drop_received),
                  state=FedProxState)


def all_global(p: NoParams, spec: ModelSpec) -> Recipe:
    """All-global FedAvg over the config's PEFT parts (PromptFL: prompts; FedCLIP: the adapter)."""
    return Recipe(S.all_global(spec.infos))


def needs_peft(peft: str) -> CheckConfig:
    """check_config of a method that trains one PEFT type: PromptFL a prompt, FedCLIP an adapter."""

    def check_config(p: NoParams, cfg: ExperimentConfig) -> None:
        if cfg.peft.type != peft:
            raise ConfigError(f"algorithm {cfg.algorithm!r} federates one {peft} (peft.type = {peft!r}); "
                              f"set peft.type = {peft!r}")

    return check_config


def fedper_check(p: NoParams, cfg: ExperimentConfig) -> None:
    if cfg.model.task != "encoder_head":
        raise ConfigError("algorithm 'fedper' keeps a classification head private: set model.task = 'encoder_head'")


def full_ft_check(p: NoParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "full":
        raise ConfigError("algorithm 'full-ft' trains every backbone weight: set peft.type = 'full'")


BASELINES: dict[str, Algorithm] = {
    "zeroshot": Algorithm(
        NoParams, lambda p, spec: Recipe(S.none_global(spec.infos), trains=False),
        "the frozen model's zero-shot predictions; no training, no traffic", full_ok=True, label=no_server_step),
    "promptfl": Algorithm(
        NoParams, all_global,
        "CoOp prompt context shared and averaged (PromptFL)", "https://arxiv.org/abs/2208.11625", needs_peft("prompt")),
    "promptfolio": PROMPTFOLIO,
    "fedclip": Algorithm(
        NoParams, all_global,
        "attention feature adapter shared and averaged (FedCLIP)", "https://arxiv.org/abs/2302.13485",
        needs_peft("adapter")),
}
# after PFAdapter in `fedsplice list algorithms` (the registry keeps this order)
LORA_BASELINES: dict[str, Algorithm] = {
    "lora": Algorithm(
        NoParams, lambda p, spec: Recipe(S.all_global(spec.infos)),
        "federated LoRA, every adapter tensor shared; the server optimizer names the variant "
        "(fedavg-lora, fedavgm-lora, fedadam-lora, fedyogi-lora, fedadagrad-lora)",
        "https://arxiv.org/abs/2003.00295", label=lambda cfg: f"{cfg.server.optimizer}-lora"),
    "fedsa-lora": Algorithm(
        NoParams, lambda p, spec: Recipe(S.by_lora_factor(spec.infos)),
        "LoRA A global, B private (FedSA-LoRA)", "https://arxiv.org/abs/2410.01463"),
    "fedper": Algorithm(
        NoParams, lambda p, spec: Recipe(S.head_private(spec.infos)),
        "adapters global, classification head private (FedPer)", "https://arxiv.org/abs/1912.00818", fedper_check,
        full_ok=True),
    "fedprox": Algorithm(
        FedProxParams, fedprox,
        "federated LoRA with a proximal term mu/2*||theta_g - theta_g0||^2 (FedProx)",
        "https://arxiv.org/abs/1812.06127", full_ok=True),
    "local": Algorithm(
        NoParams, lambda p, spec: Recipe(S.none_global(spec.infos)),
        "local-only training, nothing shared (lower bound on communication)", full_ok=True, label=no_server_step),
    "full-ft": Algorithm(
        NoParams, all_global,
        "federated full fine-tuning: every backbone weight shared and averaged, no PEFT "
        "(peft.type = 'full'; PFAdapter's Table IV prices it against LoRA)",
        "Liu et al., PFAdapter: Hierarchical LoRA Decomposition for Personalized Federated MLLMs, arXiv:2607.12111",
        full_ft_check, full_ok=True),
}
