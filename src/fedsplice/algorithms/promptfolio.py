"""PromptFolio (Pan et al., "Federated Learning from Vision-Language Foundation Models: Theoretical
Analysis and Method", NeurIPS 2024, https://arxiv.org/abs/2409.19600; code PanBikang/PromptFolio).

- Parameters: a global CoOp prompt (GLOBAL, averaged; peft.type = "prompt") and a local one,
  `prompt_local` (PRIVATE), which this method adds to the model (its `PromptParts`).
- Class side: a portfolio of the two prompts' class features, (1 − θ)·global + θ·local,
  normalized, θ = method.theta. Loss: cross-entropy only.
- PM: the client's global + local prompts. GM: the global prompt with a fresh local one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fedsplice.algorithms.hooks import EncodePrompt
from fedsplice.algorithms.recipe import Algorithm, ModelSpec, PromptParts, Recipe
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig


@dataclass
class PromptFolioParams:
    theta: float = 0.2  # the local prompt's weight in the portfolio (the paper's experiments)

    def check(self) -> None:
        if not 0.0 < self.theta < 1.0:
            raise ConfigError(f"method.theta must be in (0, 1) (the local prompt's weight in the mix), "
                              f"got {self.theta}")


def check_config(p: PromptFolioParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "prompt":
        raise ConfigError("algorithm 'promptfolio' mixes a global and a local prompt: set peft.type = 'prompt'")


def prompt_parts(p: PromptFolioParams) -> PromptParts:
    def mix(encode: EncodePrompt, m: Mapping[str, torch.nn.Module]) -> torch.Tensor:
        return F.normalize((1 - p.theta) * encode(m["prompt"]) + p.theta * encode(m["prompt_local"]), dim=-1)

    return PromptParts(modules=lambda make_prompt, prompt, gen: {"prompt_local": make_prompt()}, class_embeddings=mix)


def build(p: PromptFolioParams, spec: ModelSpec) -> Recipe:
    return Recipe({n: S.PRIVATE if i.kind == "prompt_local" else S.GLOBAL for n, i in spec.infos.items()})


PROMPTFOLIO = Algorithm(PromptFolioParams, build, "global prompt shared, local prompt private, class features mixed "
                        "by method.theta (PromptFolio)", "https://arxiv.org/abs/2409.19600", check_config,
                        prompt_parts=prompt_parts)
