"""HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024, https://arxiv.org/abs/2401.06432; no official code public): clients with
LoRA ranks of their own, aggregated by zero-padding with sparsity weights, with rank self-pruning.
Everything of the method is in this file (its registration aside); docs/fidelity.md has its rows.

- Ranks: the server's LoRA has rank r_max = peft.r. Client k has rank r_k: method.ranks[k mod
  len] when given, else uniform in [method.r_min, r_max] from the client's own seeded stream.
  One fixed LoRA scale for every rank (peft.alpha / r_max): truncation keeps the leading
  components' meaning (the paper does not say; its reimplementations and FLoRA's code fix it).
- Download: the client trains from the global A[:r_k], B[:, :r_k] (the rest zero; a zero rank
  gets no gradient, so it stays zero through local training, under SGD and AdamW alike).
- Local loss: + λ Σ_modules ‖B[:, T]‖_F·‖A[T, :]‖_F over the tail T = [⌊γ r_k⌋, r_k) (the
  reimplementations' bound of ‖B_T A_T‖), λ = method.lam, γ = method.gamma.
- Self-pruning: if the trained tail norm is below the received one, r_k ← max(r_min, ⌊γ r_k⌋),
  the pruned ranks zeroed in the upload; ranks never grow.
- Aggregation: per module, w_k = ‖B_k A_k‖_F / Σ_j ‖B_j A_j‖_F (uniform when all are 0) for both
  A and B (the zero tails are the padding); other GLOBAL tensors (a head) by sample size.
- Evaluation: GM the full-rank global adapter; PM the client's own model, the global adapter
  truncated to its current rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fedsplice.algorithms.hooks import ClientOps, LossTerm, Scores, Tensors
from fedsplice.algorithms.recipe import Algorithm, Exchange, Infos, ModelSpec, Personal, Recipe
from fedsplice.config.privacy import refuse_own_weights
from fedsplice.core import split as S
from fedsplice.core.context import TrainContext
from fedsplice.core.server import OWN_WEIGHT
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from fedsplice.config import ExperimentConfig

RANK_DRAW = 1  # ClientOps.rng key of a client's rank


@dataclass
class HetLoRAParams:
    r_min: int = 2  # the smallest rank (the paper: 5 of r_max = 50 on PaLM 2)
    ranks: list[int] = field(default_factory=list)  # per client, cycled; empty: uniform in [r_min, peft.r]
    gamma: float = 0.99  # pruning decay (the reimplementations: 0.99; one rank per prune below r = 100)
    lam: float = 0.01  # weight of the tail-norm penalty (the reimplementations: 0.01)
    prune: bool = True  # rank self-pruning (False: ranks fixed, the penalty still trains)

    def check(self) -> None:
        if self.r_min < 1 or any(r < 1 for r in self.ranks):
            raise ConfigError(f"method.r_min and method.ranks must be >= 1, got {self.r_min} and {self.ranks}")
        if not 0.0 < self.gamma < 1.0:
            raise ConfigError(f"method.gamma must be in (0, 1) (the pruning decay; 0.99), got {self.gamma}")
        if self.lam < 0:
            raise ConfigError(f"method.lam must be >= 0, got {self.lam}")


def check_config(p: HetLoRAParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "lora":
        raise ConfigError("algorithm 'hetlora' gives each client a LoRA rank of its own: set peft.type = 'lora'")
    if max([p.r_min, *p.ranks]) > cfg.peft.r:
        raise ConfigError(f"method.r_min and method.ranks must be <= peft.r = {cfg.peft.r} (the server's rank "
                          f"r_max), got {p.r_min} and {p.ranks}; lower them or raise peft.r")
    if cfg.server.aggregation != "mean":
        raise ConfigError("algorithm 'hetlora' weighs clients by their update's norm: set server.aggregation = 'mean'")
    if cfg.client.upload != "fp32":
        raise ConfigError("algorithm 'hetlora' uploads zero-padded adapters: set client.upload = 'fp32'")
    refuse_own_weights(cfg.privacy, cfg.algorithm)  # its sparsity weights (sparsity_weights)


def pairs_of(infos: Infos) -> dict[str, str]:
    """Each GLOBAL LoRA A tensor's name -> its B's (the same module)."""
    return {n: n.replace("lora_A", "lora_B") for n, i in infos.items() if i.kind == "lora" and i.factor == "A"}


def truncate(tensors: Tensors, pairs: dict[str, str], r: int) -> dict[str, torch.Tensor]:
    """The tensors with each adapter's ranks >= r zeroed: A's rows, B's columns."""
    out = dict(tensors)
    for a, b in pairs.items():
        out[a], out[b] = tensors[a].clone(), tensors[b].clone()
        out[a][r:] = 0
        out[b][:, r:] = 0
    return out


def tail_norm(tensors: Tensors, pairs: dict[str, str], r: int, gamma: float) -> torch.Tensor:
    """Σ_modules ‖B[:, T]‖_F · ‖A[T, :]‖_F over the tail T = [⌊γ r⌋, r)."""
    lo = math.floor(gamma * r)
    return sum((torch.linalg.norm(tensors[b][:, lo:r]) * torch.linalg.norm(tensors[a][lo:r])
                for a, b in pairs.items()), torch.zeros(()))


def sparsity_weights(upload: Tensors, pairs: dict[str, str]) -> dict[str, float]:
    """A client's own aggregation weights (Exchange.send's "weight/<tensor>" statistics, which the
    server normalizes: w_k = ‖B_k A_k‖_F / Σ_j ‖B_j A_j‖_F, uniform if all are 0), per module,
    for its A and B."""
    out = {}
    for a, b in pairs.items():
        norm = float(torch.linalg.norm(upload[b].double() @ upload[a].double()))
        out[OWN_WEIGHT + a] = out[OWN_WEIGHT + b] = norm
    return out


@dataclass
class HetLoRAState:
    """What a client keeps (Recipe.state)."""

    rank: int = 0  # its LoRA rank r_k; 0: not drawn yet
    tail_before: float = 0.0  # this round: the tail norm of what it received, at its rank (self-pruning)


class SelfPruning:
    """λ · tail_norm of the trained adapters at the client's rank (TrainContext.state)."""

    def __init__(self, pairs: dict[str, str], gamma: float, lam: float) -> None:
        self.pairs, self.gamma, self.weight = pairs, gamma, lam

    def __call__(self, params: Tensors, ctx: TrainContext) -> torch.Tensor:
        state = ctx.state
        assert isinstance(state, HetLoRAState), "HetLoRA's loss term runs with its own state"
        return self.weight * tail_norm(params, self.pairs, state.rank, self.gamma)


def build(p: HetLoRAParams, spec: ModelSpec) -> Recipe[HetLoRAState]:
    pairs = pairs_of(spec.infos)
    r_max = spec.shapes[next(iter(pairs))][0]

    def rank(ops: ClientOps, st: HetLoRAState) -> int:
        if st.rank:
            return st.rank
        return p.ranks[ops.cid % len(p.ranks)] if p.ranks else int(ops.rng(RANK_DRAW).integers(p.r_min, r_max + 1))

    def receive(ops: ClientOps, rnd: int, received: Tensors, st: HetLoRAState) -> tuple[Tensors, HetLoRAState]:
        r = rank(ops, st)
        start = truncate(received, pairs, r)
        return start, HetLoRAState(r, float(tail_norm(start, pairs, r, p.gamma)))

    def send(ops: ClientOps, rnd: int, trained: Tensors,
             st: HetLoRAState) -> tuple[Tensors, HetLoRAState, dict[str, float]]:
        r = st.rank
        if p.prune and float(tail_norm(trained, pairs, r, p.gamma)) < st.tail_before:
            r = max(p.r_min, math.floor(p.gamma * r))
        up = truncate(trained, pairs, r)
        return up, HetLoRAState(r), {"rank": float(r), **sparsity_weights(up, pairs)}

    def predict(ops: ClientOps, params: Tensors, st: HetLoRAState) -> np.ndarray | Scores:
        return ops.test_logits(truncate(params, pairs, rank(ops, st)))

    terms: list[LossTerm] = [SelfPruning(pairs, p.gamma, p.lam)] if p.lam > 0 else []
    return Recipe(S.all_global(spec.infos), terms, personalize=Personal(predict=predict),
                  exchange=Exchange(receive, send), state=HetLoRAState)


HETLORA = Algorithm(HetLoRAParams, build, "a LoRA rank per client: truncated download, rank self-pruning, "
                    "zero-padded aggregation with sparsity weights (HetLoRA)", "https://arxiv.org/abs/2401.06432",
                    check_config)
