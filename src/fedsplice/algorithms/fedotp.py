"""FedOTP (Li et al., "Global and Local Prompts Cooperation via Optimal Transport for Federated
Learning", CVPR 2024, https://arxiv.org/abs/2403.00041; official code HongxiaLee/FedOTP).

- Parameters: a global CoOp prompt (GLOBAL, averaged; peft.type = "prompt") and a local one,
  `prompt_ot` (PRIVATE), which this method adds to the model (its `PromptParts`).
- Scoring: each class's two prompt features are matched to the input's token features (image
  patches in the paper; the frozen text encoder's token states here) by entropic partial OT
  moving mass γ = method.gamma (`fedsplice.core.ot`); the logit is the plan-weighted cosine.
  Loss: cross-entropy only. The zero-shot model scores by cosine, as the dual encoder does.
- PM: the client's global + local prompts. GM (not in the paper): the global prompt with the
  fresh local one, through the same head.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedsplice.algorithms.hooks import EncodePrompt, InputViews
from fedsplice.algorithms.recipe import Algorithm, ModelSpec, PromptParts, Recipe
from fedsplice.core import split as S
from fedsplice.core.ot import ot_scores
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig


@dataclass
class FedOTPParams:
    gamma: float = 0.8  # the mass the plan moves, the official scripts' top_percent
    eps: float = 0.1  # entropic regularization (the official CIFAR-100 script)
    iters: int = 100  # at most this many Sinkhorn iterations (official code)

    def check(self) -> None:
        if not 0.0 < self.gamma <= 1.0:
            raise ConfigError(f"method.gamma = {self.gamma}: the mass in (0, 1] that optimal transport moves "
                              f"(the official scripts' 0.8)")
        if self.eps <= 0 or self.iters < 1:
            raise ConfigError(f"method.eps must be > 0 and method.iters >= 1, got {self.eps} and {self.iters}")


def check_config(p: FedOTPParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "prompt":
        raise ConfigError("algorithm 'fedotp' matches a global and a local prompt by optimal transport: set "
                          "peft.type = 'prompt'")
    if cfg.model.task != "dual_encoder":
        raise ConfigError(f"algorithm 'fedotp' matches an input's token features to class prompts, which "
                          f"model.task = {cfg.model.task!r} has none of: set model.task = 'dual_encoder'")


def _class_side(encode: EncodePrompt, modules: Mapping[str, torch.nn.Module]) -> torch.Tensor:
    """[2, C, D]: the global prompt's class features, then the local one's."""
    return torch.stack([encode(modules["prompt"]), encode(modules["prompt_ot"])])


def prompt_parts(p: FedOTPParams) -> PromptParts:
    def transport(inputs: InputViews, class_emb: torch.Tensor) -> torch.Tensor:
        """The plan-weighted cosine of the input's token features and each class's prompt features."""
        tokens, mask = inputs.tokens()
        return ot_scores(tokens, mask, class_emb, gamma=p.gamma, eps=p.eps, iters=p.iters)

    return PromptParts(modules=lambda make_prompt, prompt, gen: {"prompt_ot": make_prompt()},
                       class_embeddings=_class_side, scorer=transport)


def build(p: FedOTPParams, spec: ModelSpec) -> Recipe:
    return Recipe({n: S.PRIVATE if i.kind == "prompt_ot" else S.GLOBAL for n, i in spec.infos.items()})


FEDOTP = Algorithm(FedOTPParams, build, "global prompt shared, local prompt private, both matched to the input's "
                   "tokens by partial optimal transport (FedOTP)", "https://arxiv.org/abs/2403.00041",
                   check_config, prompt_parts=prompt_parts)
