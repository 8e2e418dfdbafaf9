"""FedPuReL (github.com/shihaohou/FedPuReL; docs/design.md §3.2): gradient purification and residual learning.

- Phase 1 (§3.2, Eq. 3-5): every PEFT tensor is GLOBAL; each local step takes, from ONE
  forward, the task cross-entropy and the temperature-aligned KL toward the frozen zero-shot
  predictions (`fedsplice.core.tkl`), and steps with the task gradient purified against the
  alignment gradient (`fedsplice.core.purify`).
- Phase 2 (§3.3, Eq. 12): the global PEFT is frozen; every training client trains a private
  PEFT of the same type on (1−λ)·CE(y, l_G + l_P) + λ·CE(y, l_P) and predicts with l_G + l_P:
  by default (method.phase2 = "persistent", the official code) a stored branch trained in every
  round the client is sampled; or (phase2 = "after", Algorithm 1) for T_p rounds after the T
  global ones, as the `personalize` client task.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from fedsplice.algorithms.hooks import ClientOps, Objective, Tensors
from fedsplice.algorithms.recipe import (
    Algorithm,
    Exchange,
    ModelSpec,
    Personal,
    Recipe,
    default_label,
)
from fedsplice.config.privacy import OWN_RULE, OWN_STAGE, refuse_under_dpsgd
from fedsplice.core import split as S
from fedsplice.core.context import TrainContext
from fedsplice.core.purify import TIE_TOL, purification
from fedsplice.core.tkl import tkl
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from fedsplice.config import ExperimentConfig



@dataclass
class FedPuReLParams:
    lam: float = 0.9  # λ of phase 2: (1−λ)·CE(l_G + l_P) + λ·CE(l_P)
    granularity: Literal["tensor", "flat"] = "flat"  # purify flat (the paper's Eq. 5) or per tensor (official code)
    align: Literal["tkl", "kl"] = "tkl"  # temperature-aligned KL, or plain KL (Table 6 ablation)
    purify: bool = True  # False: phase 1 is plain FedAvg of the same PEFT (ablation)
    # a product ⟨g_task, g_align⟩ below working precision is no conflict (core/purify.py: g_align
    # ~ 0 at zero-shot, or orthogonal); 0 = the exact sign rule of the paper and official code
    tie_tol: float = TIE_TOL
    # phase 2: "persistent", a branch kept on the client and trained one round's budget in every
    # round it is sampled (the official code, which produced the paper's numbers; the default, as
    # the paper gives no T_p); "after": after the T rounds, T_p = personal_rounds rounds of the
    # client's local budget (the paper's Algorithm 1)
    phase2: Literal["after", "persistent"] = "persistent"
    personal_rounds: int = 10  # T_p of phase2 = "after" (the paper gives no value)

    def check(self) -> None:
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"method.lam must be in [0, 1], got {self.lam}")
        if self.personal_rounds < 0:
            raise ConfigError(f"method.personal_rounds (T_p) must be >= 0, got {self.personal_rounds}")
        if not 0.0 <= self.tie_tol < 1.0:
            raise ConfigError(f"method.tie_tol must be in [0, 1) (0: the exact sign rule), got {self.tie_tol}")
        if self.phase2 not in ("after", "persistent"):
            raise ConfigError(f"method.phase2 must be 'after' (the paper) or 'persistent' (the official code), "
                              f"got {self.phase2!r}")


class ZeroShot(Protocol):
    """The model's zero-shot switch and its batched logits (TaskModel's; algorithms import no
    model)."""

    def zero_shot(self) -> AbstractContextManager[None]: ...

    def predict(self, texts: list[str], batch_size: int, /) -> torch.Tensor: ...


@torch.no_grad()
def zero_shot_logits(model: nn.Module, texts: list[str]) -> torch.Tensor:
    was = model.training
    model.eval()  # as the cached logits are computed (predict): no dropout
    with cast(ZeroShot, model).zero_shot():
        z: torch.Tensor = model(texts)
    model.train(was)
    return z


def zero_shot_table(model: nn.Module, texts: list[str], batch_size: int) -> torch.Tensor:
    """ClientOps.cached's fn: the zero-shot logits [N, C] of `texts` (frozen: no PEFT tensor)."""
    m = cast(ZeroShot, model)
    with m.zero_shot():
        return m.predict(texts, batch_size)


@dataclass
class FedPuReLState:
    """What a client keeps (Recipe.state)."""

    # phase 2's residual branch: a PEFT of the model's type, by tensor name ({} until first trained)
    branch: dict[str, torch.Tensor] = field(default_factory=dict)
    # this round only (never stored: drop_zero_shot): the frozen zero-shot logits [n, C] of the
    # client's training samples and the sample ids of their rows
    zero_shot: torch.Tensor | None = None
    zero_shot_ids: torch.Tensor | None = None


def keep_zero_shot(ops: ClientOps, rnd: int, received: Tensors,
                   st: FedPuReLState) -> tuple[Tensors, FedPuReLState]:
    """Exchange.receive: the client's zero-shot logits (frozen work, computed once per process:
    ClientOps.cached) in its state for the round's training; none with runtime.cache = false (the objective
    computes them every step)."""
    z = ops.cached("zero_shot", zero_shot_table)
    if z is not None:
        st = FedPuReLState(st.branch, z, torch.as_tensor(ops.sample_ids(), dtype=torch.int64))
    return received, st


def drop_zero_shot(ops: ClientOps, rnd: int, trained: Tensors,
                   st: FedPuReLState) -> tuple[Tensors, FedPuReLState, dict[str, float]]:
    """Exchange.send: the upload as trained; the zero-shot rows are not kept in the client's
    state (nor in a checkpoint or an export), only the branch."""
    return trained, FedPuReLState(st.branch), {}


def align_objective(aligned: bool = True) -> Objective:
    """Phase 1: from ONE forward, the task CE and the alignment loss toward zero-shot logits."""

    def objective(model: nn.Module, texts: list[str], y: torch.Tensor, ids: np.ndarray,
                  ctx: TrainContext) -> dict[str, torch.Tensor]:
        f = model(texts)
        st = ctx.state
        if isinstance(st, FedPuReLState) and st.zero_shot is not None and st.zero_shot_ids is not None:
            # frozen work, computed once (keep_zero_shot): the rows of this batch's ids; every id is
            # one of the client's own (the loop draws from them); no check: a host sync a step
            hit = st.zero_shot_ids.unsqueeze(0) == torch.as_tensor(ids, device=f.device).unsqueeze(1)
            z = st.zero_shot[hit.int().argmax(1)]
        else:  # runtime.cache = false: an extra frozen forward every step, as the caches' reference
            z = zero_shot_logits(model, texts)
        return {"task": ctx.task_loss(f, y),
                "align": tkl(f, z, aligned).mean()}

    return objective


def residual_objective(lam: float, global_logits: torch.Tensor) -> Objective:
    """Phase 2: (1−λ)·CE(y, l_G + l_P) + λ·CE(y, l_P), l_G the frozen global logits on the
    client's training data (`global_logits`, indexed by sample id)."""

    def objective(model: nn.Module, texts: list[str], y: torch.Tensor, ids: np.ndarray,
                  ctx: TrainContext) -> dict[str, torch.Tensor]:
        l_p = model(texts)
        l_g = global_logits[torch.as_tensor(ids)].to(l_p.device)
        return {"task": (1 - lam) * F.cross_entropy(l_g + l_p, y) + lam * F.cross_entropy(l_p, y)}

    return objective


# phase 2's optimizer (the official code's): the client's at its lr, without momentum, weight decay or schedule
PHASE2_OPTIMIZER = {"momentum": 0.0, "weight_decay": 0.0, "schedule": "constant"}


def train_branch(ops: ClientOps, lam: float, branch: Tensors, rounds: range,
                 l_g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The residual branch l_P: `branch` trained on `objective` for one local budget per round
    key in `rounds` (one optimizer across them), l_G the frozen global logits on the training data."""
    return ops.train(branch, residual_objective(lam, l_g), rounds, client=PHASE2_OPTIMIZER)


def phase2(p: FedPuReLParams) -> Personal:
    """Phase 2 as the client tasks' hooks (recipe.Personal) on the client's state: its branch, a
    PEFT of the same type ({} until first trained: a fresh one)."""
    # one round's budget, from where it stopped
    def fit(ops: ClientOps, rnd: int, received: Tensors, st: FedPuReLState) -> FedPuReLState:
        branch = train_branch(ops, p.lam, st.branch or ops.fresh(), range(rnd, rnd + 1), ops.train_logits(received))
        return dataclasses.replace(st, branch={**st.branch, **branch})

    # test_logits are class logits here: FedPuReL is refused with model.task = "generate" (its check_recipe)
    def predict(ops: ClientOps, params: Tensors, st: FedPuReLState) -> np.ndarray:  # PM = l_G + the stored branch
        pm: np.ndarray = (cast("np.ndarray", ops.test_logits(params))
                          + cast("np.ndarray", ops.test_logits(st.branch or ops.fresh())))
        return pm

    def after(ops: ClientOps, global_params: Tensors, st: FedPuReLState) -> np.ndarray:
        if p.phase2 == "persistent":  # the branch as the rounds left it
            return predict(ops, global_params, st)
        l_g = ops.train_logits(global_params)  # Algorithm 1: a fresh branch, T_p rounds (0: it stays at init)
        l_g_test = cast("np.ndarray", ops.test_logits(global_params))
        branch = train_branch(ops, p.lam, ops.fresh(), range(p.personal_rounds), l_g)
        pm: np.ndarray = l_g_test + cast("np.ndarray", ops.test_logits(branch))
        return pm

    if p.phase2 == "persistent":
        return Personal(fit=fit, predict=predict, after=after)
    return Personal(after=after, after_rounds=p.personal_rounds)


def build(p: FedPuReLParams, spec: ModelSpec) -> Recipe[FedPuReLState]:
    return Recipe(S.all_global(spec.infos),
                  objective=align_objective(p.align == "tkl") if p.purify else None,
                  grad_transform=purification(p.granularity, p.tie_tol) if p.purify else None,
                  exchange=Exchange(keep_zero_shot, drop_zero_shot) if p.purify else None,
                  personalize=phase2(p), state=FedPuReLState)


def check_config(p: FedPuReLParams, cfg: ExperimentConfig) -> None:
    """Per-example clipping bounds neither its purified gradient nor its phase 2 (always built)."""
    refuse_under_dpsgd(cfg.privacy, cfg.algorithm, OWN_RULE if p.purify else OWN_STAGE)


FEDPUREL = Algorithm(FedPuReLParams, build,
                     "gradient purification toward zero-shot (TKL) + residual personalization (FedPuReL)",
                     "Fine-Tuning Impairs the Balancedness of Foundation Models in Long-tailed Personalized "
                     "Federated Learning (FedPuReL; github.com/shihaohou/FedPuReL)", check_config,
                     label=lambda cfg: default_label(cfg) + f"-{cfg.peft.type}")  # fedpurel-lora, -prompt, -adapter
