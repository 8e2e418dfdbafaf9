"""pFedLoRA (Yi et al., "pFedLoRA: Model-Heterogeneous Personalized Federated Learning with LoRA
Tuning", 2023, https://arxiv.org/abs/2310.13283; the PFAdapter paper's baseline [37]). No
official code is public; this is the homogeneous-backbone reading of the paper (docs/fidelity.md).

- Parameters: the paper gives each client a private local model and a small homogeneous
  LoRA-style adapter that is shared. On one frozen backbone the private model becomes a second
  LoRA adapter on the same modules, of rank method.private_r (this method adds it: its
  `LoraParts`): the "default" adapter is GLOBAL
  (averaged, as FedAvg-LoRA's: the 617 MB a round of PFAdapter's Table I), the "private" one is
  PRIVATE. Both act in every forward; PM uses both, GM the shared one with a fresh private one.
- Training (the paper's iterative optimisation): each round, first the private adapter with the
  shared one frozen, for method.private_epochs local epochs, then the shared one with the private
  one frozen, for method.global_epochs; each phase has its own optimizer. Task loss only.
  method.budget = "shared" (ours, for a comparison at equal local steps): the two phases split
  one local budget, in proportion to their epochs, instead of each running its own epochs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fedsplice.algorithms.recipe import Algorithm, LoraParts, ModelSpec, Recipe
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig


@dataclass
class PFedLoRAParams:
    private_r: int = 8  # rank of the private adapter (no value in the paper: the shared one's, peft.r = 8)
    private_epochs: int = 1  # E_1: the private adapter, the shared one frozen
    global_epochs: int = 1  # E_2: the shared adapter, the private one frozen
    # per_phase: each phase runs its own epochs (the paper: twice the local steps of a one-phase
    # method at E_1 = E_2 = 1); shared: the phases split the client's one local budget
    budget: Literal["per_phase", "shared"] = "per_phase"

    def check(self) -> None:
        if self.budget not in ("per_phase", "shared"):
            raise ConfigError(f"method.budget must be 'per_phase' (the paper) or 'shared' (the phases split one "
                              f"local budget), got {self.budget!r}")
        if self.private_r < 1:
            raise ConfigError(f"method.private_r must be >= 1 (the private adapter's rank), got {self.private_r}")
        if self.private_epochs < 1 or self.global_epochs < 1:
            raise ConfigError(f"method.private_epochs and method.global_epochs must be >= 1, got "
                              f"{self.private_epochs} and {self.global_epochs}")


def check_config(p: PFedLoRAParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "lora":
        raise ConfigError("algorithm 'pfedlora' trains a shared and a private LoRA adapter: set peft.type = 'lora'")


def build(p: PFedLoRAParams, spec: ModelSpec) -> Recipe:
    split = {n: S.PRIVATE if i.kind == "lora_private" else S.GLOBAL for n, i in spec.infos.items()}
    return Recipe(split, phases=((S.PRIVATE, p.private_epochs), (S.GLOBAL, p.global_epochs)),
                  phases_share_budget=p.budget == "shared")


PFEDLORA = Algorithm(PFedLoRAParams, build, "shared LoRA adapter averaged, private LoRA adapter kept; trained "
                     "alternately, private then shared (pFedLoRA)", "https://arxiv.org/abs/2310.13283",
                     check_config, lora_parts=lambda p: LoraParts({"private": p.private_r}))
