"""FedPGP (Cui et al., "Harmonizing Generalization and Personalization in Federated Prompt
Learning", ICML 2024, https://arxiv.org/abs/2405.09771; official code TianyuCuiOvO/FedPGP).

- Parameters: the CoOp context p_G (peft.type = "prompt") is GLOBAL and averaged; a low-rank
  correction U·V of rank method.rank, `prompt_lowrank` (this method adds it to the model: its
  `PromptParts`), is PRIVATE. The client's prompt is p_G + U·V, used for its loss and its
  predictions (PM); GM is p_G with the fresh U·V, ~N(0, 0.02²) factors.
- Loss: CE on the personalized prompt's logits + μ·L_con, the prompt-wise contrastive loss
  (`fedsplice.core.losses.prompt_contrastive`): p_G's class features are pulled toward the
  frozen hand-crafted ones and pushed from p_G + U·V's. p_G, U and V train jointly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from fedsplice.algorithms.hooks import MakePrompt, Objective
from fedsplice.algorithms.recipe import Algorithm, ModelSpec, PromptParts, Recipe
from fedsplice.core import split as S
from fedsplice.core.context import TrainContext
from fedsplice.core.losses import prompt_contrastive
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from fedsplice.config import ExperimentConfig


@dataclass
class FedPGPParams:
    rank: int = 8  # r of U·V (every official script; the argparse default is 4)
    mu: float = 0.5  # weight of L_con (every official script; its argparse default is 1)
    tau: float = 0.5  # temperature of L_con (official code)

    def check(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"method.rank must be >= 1 (the rank of the private correction U·V), got {self.rank}")
        if self.mu < 0:
            raise ConfigError(f"method.mu must be >= 0 (the contrastive loss's weight), got {self.mu}")
        if self.tau <= 0:
            raise ConfigError(f"method.tau must be > 0 (the contrastive loss's temperature), got {self.tau}")


class LowRankDelta(nn.Module):
    """U [n_ctx, r] and V [r, d], both ~ N(0, 0.02²) from the seeded generator (official code);
    the client's context is ctx + U·V."""

    def __init__(self, n_ctx: int, dim: int, rank: int, generator: torch.Generator):
        super().__init__()
        self.U = nn.Parameter(torch.randn(n_ctx, rank, generator=generator) * 0.02)
        self.V = nn.Parameter(torch.randn(rank, dim, generator=generator) * 0.02)

    def forward(self) -> torch.Tensor:
        return self.U @ self.V


class PGPModel(Protocol):
    """What FedPGP reads of the model besides nn.Module's own: a TaskModel with its PromptParts
    (algorithms import no model)."""

    prompt: nn.Module
    prompt_lowrank: nn.Module

    def encode_prompt(self, learner: nn.Module, ctx: torch.Tensor | None = None, /) -> torch.Tensor: ...

    def template_class_embeddings(self) -> torch.Tensor: ...


def prompt_parts(p: FedPGPParams) -> PromptParts:
    def modules(make_prompt: MakePrompt, prompt: nn.Module, gen: torch.Generator) -> dict[str, nn.Module]:
        # prompt: a CoOp learner (n_ctx: int, ctx: [n_ctx, width])
        n_ctx, ctx = cast(int, prompt.n_ctx), cast(torch.Tensor, prompt.ctx)
        return {"prompt_lowrank": LowRankDelta(n_ctx, ctx.shape[-1], p.rank, gen)}

    return PromptParts(modules=modules, class_embeddings=lambda encode, m: encode(m["prompt"], personal_context(m)))


def personal_context(m: Mapping[str, nn.Module]) -> torch.Tensor:
    """The client's context p_G + U·V (`m`: the model's prompt modules)."""
    return cast(torch.Tensor, m["prompt"].ctx + m["prompt_lowrank"]())


def views(model: PGPModel) -> dict[str, torch.Tensor]:
    """The three class-feature views [C, D]: "personal" (ctx + U·V), "global" (ctx) and
    "template" (the frozen model on the class prompt's words)."""
    personal = personal_context({"prompt": model.prompt, "prompt_lowrank": model.prompt_lowrank})
    return {"personal": model.encode_prompt(model.prompt, personal),
            "global": model.encode_prompt(model.prompt), "template": model.template_class_embeddings()}


def objective(mu: float, tau: float) -> Objective:
    def fedpgp_objective(model: nn.Module, texts: list[str], y: torch.Tensor, ids: np.ndarray,
                         ctx: TrainContext) -> dict[str, torch.Tensor]:
        v = views(cast(PGPModel, model))
        out = {"task": ctx.task_loss(model(texts, v["personal"]), y)}
        if mu > 0:
            out["contrastive"] = mu * prompt_contrastive(v["template"], v["global"], v["personal"], tau)
        return out

    return fedpgp_objective


def check_config(p: FedPGPParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "prompt":
        raise ConfigError("algorithm 'fedpgp' adds a private low-rank correction to a prompt: set "
                          "peft.type = 'prompt'")


def build(p: FedPGPParams, spec: ModelSpec) -> Recipe:
    split = {n: S.PRIVATE if i.kind == "prompt_lowrank" else S.GLOBAL for n, i in spec.infos.items()}
    return Recipe(split, objective=objective(p.mu, p.tau))


FEDPGP = Algorithm(FedPGPParams, build, "global prompt shared, low-rank prompt correction U·V private, "
                   "prompt-wise contrastive loss (FedPGP)", "https://arxiv.org/abs/2405.09771", check_config,
                   prompt_parts=prompt_parts)
