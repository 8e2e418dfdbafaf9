"""FedPGP (Cui et al., "Harmonizing Generalization and Personalization in Federated Prompt
Learning", ICML 2024, https://arxiv.org/abs/2405.09771; official code TianyuCuiOvO/FedPGP).

- Parameters: the CoOp context p_G (peft.type = "prompt") is GLOBAL and averaged; a low-rank
  correction U·V (peft.prompt_lowrank = r) is PRIVATE. The client's prompt is p_G + U·V, used
  for its loss and its predictions (PM); GM is p_G with the fresh U·V, ~N(0, 0.02²) factors.
- Loss: CE on the personalized prompt's logits + μ·L_con, the prompt-wise contrastive loss
  (`fedsplice.core.losses.prompt_contrastive`): p_G's class features are pulled toward the
  frozen hand-crafted ones and pushed from p_G + U·V's. p_G, U and V train jointly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from fedsplice.algorithms.recipe import Algorithm, Recipe, refuse_grab
from fedsplice.core import split as S
from fedsplice.core.losses import prompt_contrastive
from fedsplice.errors import ConfigError


@dataclass
class FedPGPParams:
    mu: float = 0.5  # weight of L_con (every official script; its argparse default is 1)
    tau: float = 0.5  # temperature of L_con (official code)

    def check(self) -> None:
        if self.mu < 0:
            raise ConfigError(f"method.mu must be >= 0 (the contrastive loss's weight), got {self.mu}")
        if self.tau <= 0:
            raise ConfigError(f"method.tau must be > 0 (the contrastive loss's temperature), got {self.tau}")


def objective(mu: float, tau: float):
    def fedpgp_objective(model, texts, y, ids, ctx) -> dict:
        v = model.prompt_views()
        logits = model(texts, v["personal"]) + ctx.get("logit_offset", 0.0)
        out = {"task": F.cross_entropy(logits, y)}
        if mu > 0:
            out["contrastive"] = mu * prompt_contrastive(v["template"], v["global"], v["personal"], tau)
        return out

    return fedpgp_objective


def check_config(p: FedPGPParams, cfg) -> None:
    if cfg.peft.type != "prompt" or not cfg.peft.prompt_lowrank:
        raise ConfigError("algorithm 'fedpgp' adds a private low-rank correction to a prompt: set "
                          "peft.type = 'prompt' and peft.prompt_lowrank = r (e.g. 8)")
    refuse_grab(cfg, "cross-entropy plus its prompt-wise contrastive loss")


def build(p: FedPGPParams, infos, *_) -> Recipe:
    split = {n: S.PRIVATE if i.kind == "prompt_lowrank" else S.GLOBAL for n, i in infos.items()}
    return Recipe(split, objective=objective(p.mu, p.tau))


FEDPGP = Algorithm(FedPGPParams, build, "global prompt shared, low-rank prompt correction U·V private, "
                   "prompt-wise contrastive loss (FedPGP)", "https://arxiv.org/abs/2405.09771", check_config)
