"""FedOTP (Li et al., "Global and Local Prompts Cooperation via Optimal Transport for Federated
Learning", CVPR 2024, https://arxiv.org/abs/2403.00041; official code HongxiaLee/FedOTP).

- Parameters: a global CoOp prompt (GLOBAL, averaged) and a local one (PRIVATE), both from
  peft.type = "prompt" with peft.ot_gamma > 0 (the model's `prompt` and `prompt_ot`).
- Scoring (the model's OT head, `fedsplice.model.scorers.OTScorer`): each class's two prompt
  features are matched to the input's token features (image patches in the paper; the frozen
  text encoder's token states here) by entropic partial OT with mass γ = peft.ot_gamma
  (`fedsplice.core.ot`); the logit is the plan-weighted cosine. Loss: cross-entropy only.
- PM: the client's global + local prompts. GM (not in the paper): the global prompt with the
  fresh local one, through the same head.
"""

from __future__ import annotations

from fedsplice.algorithms.recipe import Algorithm, NoParams, Recipe
from fedsplice.core import split as S
from fedsplice.errors import ConfigError


def check_config(p, cfg) -> None:
    if cfg.peft.type != "prompt" or not cfg.peft.ot_gamma > 0:
        raise ConfigError("algorithm 'fedotp' matches a global and a local prompt by optimal transport: set "
                          "peft.type = 'prompt' and peft.ot_gamma = γ (the official scripts' 0.8)")


def build(p, infos, *_) -> Recipe:
    return Recipe({n: S.PRIVATE if i.kind == "prompt_ot" else S.GLOBAL for n, i in infos.items()})


FEDOTP = Algorithm(NoParams, build, "global prompt shared, local prompt private, both matched to the input's "
                   "tokens by partial optimal transport (FedOTP)", "https://arxiv.org/abs/2403.00041",
                   check_config)
