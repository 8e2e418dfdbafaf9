"""The baselines both papers compare against, each a split over the same PEFT (docs/design.md §3.3).

The server optimizer (`[server] optimizer`) is orthogonal to the method: `lora` + fedyogi is
FedYogi-LoRA. `full-ft` has no PEFT at all (peft.type = "full"): the cost reference of LoRA.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsplice.algorithms.recipe import Algorithm, NoParams, Recipe
from fedsplice.core import split as S
from fedsplice.core.losses import Proximal
from fedsplice.errors import ConfigError


@dataclass
class FedProxParams:
    mu: float = 0.01

    def check(self) -> None:
        if self.mu < 0:
            raise ConfigError(f"method.mu must be >= 0, got {self.mu}")


def fedprox(p: FedProxParams, infos, shapes, scalings) -> Recipe:
    split = S.all_global(infos)
    return Recipe(split, [Proximal(S.names_in(split, S.GLOBAL), p.mu)] if p.mu > 0 else [])


def one_peft(kind: str, algo: str, peft: str):
    """All-global FedAvg over one PEFT type (PromptFL: prompts; FedCLIP: the adapter)."""

    def build(p, infos, *_):
        if not any(i.kind == kind for i in infos.values()):
            raise ConfigError(f"algorithm {algo!r} trains a {kind}: set peft.type = {peft!r}")
        return Recipe(S.all_global(infos))

    return build


def promptfolio(p, infos, *_) -> Recipe:
    if not any(i.kind == "prompt_local" for i in infos.values()):
        raise ConfigError("algorithm 'promptfolio' mixes a global and a local prompt: set "
                          "peft.type = 'prompt' and peft.portfolio = θ (e.g. 0.2)")
    return Recipe({n: S.PRIVATE if i.kind == "prompt_local" else S.GLOBAL for n, i in infos.items()})


def full_ft(p, infos, *_) -> Recipe:
    """Every backbone weight (and a head or projector, if any) is GLOBAL: plain FedAvg of the model."""
    if not any(i.kind == "backbone" for i in infos.values()):
        raise ConfigError("algorithm 'full-ft' trains every backbone weight: set peft.type = 'full'")
    return Recipe(S.all_global(infos))


BASELINES: dict[str, Algorithm] = {
    "zeroshot": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.none_global(i), trains=False),
        "the frozen model's zero-shot predictions; no training, no traffic"),
    "promptfl": Algorithm(
        NoParams, one_peft("prompt", "promptfl", "prompt"),
        "CoOp prompt context shared and averaged (PromptFL)", "https://arxiv.org/abs/2208.11625"),
    "promptfolio": Algorithm(
        NoParams, promptfolio,
        "global prompt shared, local prompt private, class features mixed by peft.portfolio (PromptFolio)",
        "https://arxiv.org/abs/2409.19600"),
    "fedclip": Algorithm(
        NoParams, one_peft("adapter", "fedclip", "adapter"),
        "attention feature adapter shared and averaged (FedCLIP)", "https://arxiv.org/abs/2302.13485"),
}
# after PFAdapter in `fedsplice list algorithms` (the registry keeps this order)
LORA_BASELINES: dict[str, Algorithm] = {
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
        FedProxParams, fedprox,
        "federated LoRA with a proximal term mu/2*||theta_g - theta_g0||^2 (FedProx)",
        "https://arxiv.org/abs/1812.06127"),
    "local": Algorithm(
        NoParams, lambda p, i, *_: Recipe(S.none_global(i)),
        "local-only training, nothing shared (lower bound on communication)"),
    "full-ft": Algorithm(
        NoParams, full_ft,
        "federated full fine-tuning: every backbone weight shared and averaged, no PEFT "
        "(peft.type = 'full'; PFAdapter's Table IV prices it against LoRA)",
        "Liu et al., PFAdapter: Hierarchical LoRA Decomposition for Personalized Federated MLLMs, arXiv:2607.12111"),
}
