"""Algorithms are recipes composed from parts: a split policy, loss terms, gradient transforms.

No algorithm subclasses a client or a server; each is a small `build` function over the typed
hyperparameters in the config's `[method]` table. The server optimizer ([server] optimizer) is
orthogonal to the method: `lora` + fedyogi is FedYogi-LoRA.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Literal

import torch

from fedsplice.core import split as S
from fedsplice.errors import ConfigError
from fedsplice.core.losses import Orthogonality, Proximal


@dataclass
class NoParams:
    pass


@dataclass
class PFAdapterParams:
    global_roles: list[str] = field(default_factory=lambda: ["q", "k"])
    ortho_lambda: float = 0.1  # λo
    selective_aggregation: bool = True  # off: every LoRA tensor is GLOBAL (ablation), λo kept

    def check(self) -> None:
        from fedsplice.config import _roles

        _roles("method.global_roles", self.global_roles)
        if not self.global_roles:
            raise ConfigError("method.global_roles is empty; PFAdapter shares at least one role (default q, k)")
        if self.ortho_lambda < 0:
            raise ConfigError(f"method.ortho_lambda must be >= 0, got {self.ortho_lambda}")


@dataclass
class FedProxParams:
    mu: float = 0.01

    def check(self) -> None:
        if self.mu < 0:
            raise ConfigError(f"method.mu must be >= 0, got {self.mu}")


@dataclass
class FedPuReLParams:
    lam: float = 0.9  # λ of phase 2: (1−λ)·CE(l_G + l_P) + λ·CE(l_P)
    granularity: Literal["tensor", "flat"] = "tensor"  # purify per tensor (official code) or flat (paper)
    align: Literal["tkl", "kl"] = "tkl"  # temperature-aligned KL, or plain KL (Table 6 ablation)
    purify: bool = True  # False: phase 1 is plain FedAvg of the same PEFT (ablation)
    personal_steps: int = 30  # phase-2 local steps per client

    def check(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"method.lam must be in [0, 1], got {self.lam}")
        if self.personal_steps < 0:
            raise ConfigError(f"method.personal_steps must be >= 0, got {self.personal_steps}")


@dataclass
class Recipe:
    split: dict[str, str]
    loss_terms: list[Callable] = field(default_factory=list)  # (params, ctx) -> scalar, added to the task loss
    objective: Callable | None = None  # (model, texts, y, ids, ctx) -> {loss name: scalar}; None: cross-entropy
    grad_transform: Callable | None = None  # combines per-loss gradients (FedPuReL purification)
    trains: bool = True  # False: evaluation only (zero-shot)
    personalize: Callable | None = None  # a local stage after the rounds (FedPuReL phase 2)
    needs_zero_shot: bool = False  # cache zero-shot logits of the training set


@dataclass(frozen=True)
class Algorithm:
    params: type
    build: Callable  # (params, infos, shapes, scalings) -> Recipe
    description: str
    paper: str = ""


def _pfadapter(p: PFAdapterParams, infos, shapes, scalings) -> Recipe:
    split = S.by_roles(infos, p.global_roles) if p.selective_aggregation else S.all_global(infos)
    terms = []
    if p.ortho_lambda > 0:
        terms.append(Orthogonality(infos, shapes, scalings, p.global_roles, p.ortho_lambda))
    return Recipe(split, terms)


def _fedprox(p: FedProxParams, infos, shapes, scalings) -> Recipe:
    split = S.all_global(infos)
    return Recipe(split, [Proximal(S.names_in(split, S.GLOBAL), p.mu)] if p.mu > 0 else [])


def _fedpurel(p: FedPuReLParams, infos, shapes, scalings) -> Recipe:
    from fedsplice.algorithms import fedpurel as fp

    return Recipe(S.all_global(infos),
                  objective=fp.align_objective(p.align == "tkl") if p.purify else None,
                  grad_transform=fp.purification(p.granularity) if p.purify else None,
                  needs_zero_shot=p.purify,
                  personalize=partial(fp.personalize, lam=p.lam, steps=p.personal_steps))


def _needs(kind: str, algo: str, peft: str):
    """All-global FedAvg over one PEFT type (PromptFL: prompts; FedCLIP: the adapter)."""

    def build(p, infos, *_):
        if not any(i.kind == kind for i in infos.values()):
            raise ConfigError(f"algorithm {algo!r} trains a {kind}: set peft.type = {peft!r}")
        return Recipe(S.all_global(infos))

    return build


def _promptfolio(p, infos, *_) -> Recipe:
    if not any(i.kind == "prompt_local" for i in infos.values()):
        raise ConfigError("algorithm 'promptfolio' mixes a global and a local prompt: set "
                          "peft.type = 'prompt' and peft.portfolio = θ (e.g. 0.2)")
    return Recipe({n: S.PRIVATE if i.kind == "prompt_local" else S.GLOBAL for n, i in infos.items()})


ALGORITHMS: dict[str, Algorithm] = {
    "fedpurel": Algorithm(
        FedPuReLParams, _fedpurel,
        "gradient purification toward zero-shot (TKL) + residual personalization (FedPuReL)",
        "../shared/papers/fedpurel.md"),
    "zeroshot": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.none_global(i), trains=False),
        "the frozen model's zero-shot predictions; no training, no traffic"),
    "promptfl": Algorithm(
        NoParams, _needs("prompt", "promptfl", "prompt"),
        "CoOp prompt context shared and averaged (PromptFL)", "https://arxiv.org/abs/2208.11625"),
    "promptfolio": Algorithm(
        NoParams, _promptfolio,
        "global prompt shared, local prompt private, class features mixed by peft.portfolio (PromptFolio)",
        "https://arxiv.org/abs/2409.19600"),
    "fedclip": Algorithm(
        NoParams, _needs("adapter", "fedclip", "adapter"),
        "attention feature adapter shared and averaged (FedCLIP)", "https://arxiv.org/abs/2302.13485"),
    "pfadapter": Algorithm(
        PFAdapterParams, _pfadapter,
        "LoRA q,k global / v,o private + orthogonality loss (PFAdapter)",
        "../shared/papers/pfadapter.txt"),
    "lora": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.all_global(i)),
        "federated LoRA, every adapter tensor shared; the server optimizer names the variant "
        "(fedavg-lora, fedavgm-lora, fedadam-lora, fedyogi-lora, fedadagrad-lora)",
        "https://arxiv.org/abs/2003.00295"),
    "fedsa-lora": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.by_lora_factor(i)),
        "LoRA A global, B private (FedSA-LoRA)", "https://arxiv.org/abs/2410.01463"),
    "fedper": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.head_private(i)),
        "adapters global, classification head private (FedPer)", "https://arxiv.org/abs/1912.00818"),
    "fedprox": Algorithm(
        FedProxParams, _fedprox,
        "federated LoRA with a proximal term mu/2*||theta_g - theta_g0||^2 (FedProx)",
        "https://arxiv.org/abs/1812.06127"),
    "local": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.none_global(i)),
        "local-only training, nothing shared (lower bound on communication)"),
}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm: unknown {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def method_params(cfg):
    """The typed `[method]` table of cfg's algorithm (unknown keys are errors)."""
    from fedsplice.config import from_dict

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


def clone(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in params.items()}
