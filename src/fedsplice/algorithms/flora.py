"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
Low-Rank Adaptations", NeurIPS 2024, https://arxiv.org/abs/2409.05976; official code
ziyaow1010/FederatedLLM@7bea158): clients with LoRA ranks of their own, aggregated exactly by
stacking. Everything of the method is in this file (its registration aside); docs/fidelity.md
has its rows.

- Ranks: client k trains a LoRA of rank r_k = method.ranks[k mod len] (the code: 64, 32, 16, 16,
  8, 8, 4, 4, 4, 4 for 10 clients) with one scale for every rank (the code: alpha_k = 2 r_k, so
  s = 2; here peft.alpha / peft.r), as the first r_k ranks of the model's rank-peft.r LoRA.
- Every round each client starts from the merged global model with a FRESH LoRA (A from the
  seeded init, B = 0: `main.py` builds a new adapter on the merged model each round).
- Stacking: A = [p_1 A_1; ...], B = [B_1, ...] gives s·B A = Σ_k p_k s B_k A_k exactly, which the
  server merges into the base weight (`merge_and_unload`). Here the merged base is a dense ΔW per
  adapted module (DENSE_BASE, beside its LoRA: kind "lora_dense", GLOBAL, frozen in local training); a client
  uploads ΔW + s·B_k A_k and the server's FedAvg (weights n_k / Σ n over the round's clients, the
  code's p_k) gives ΔW + Σ_k p_k s B_k A_k: the stacked product, merged.
- Evaluation: the merged model (GM); FLoRA has no personalization, so PM is the merged model too,
  on each client's local test set.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from fedsplice.algorithms.hooks import ClientOps, Tensors
from fedsplice.algorithms.recipe import (
    Algorithm,
    Beside,
    Exchange,
    Infos,
    LoraParts,
    ModelSpec,
    Personal,
    Phase,
    Recipe,
    Scalings,
)
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig


@dataclass
class FLoRAParams:
    ranks: list[int] = field(default_factory=lambda: [64, 32, 16, 16, 8, 8, 4, 4, 4, 4])  # the code's tiers
    local_epochs: int = 1  # the official README's commands: one local epoch a round

    def check(self) -> None:
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ConfigError(f"method.ranks must be a non-empty list of ranks >= 1, got {self.ranks}")
        if self.local_epochs < 1:
            raise ConfigError(f"method.local_epochs must be >= 1, got {self.local_epochs}")


@dataclass
class FLoRAState:
    """What a client keeps (Recipe.state)."""

    rank: int = 0  # its rank this round (method.ranks by client); 0: before its first round


# the merged base: a dense ΔW beside each adapted module's LoRA, zeros at the start; the module's
# output becomes W0 x + ΔW x + its LoRA (the frozen weight alone in zero-shot)
DENSE_BASE = Beside(init=lambda out_f, in_f: torch.zeros(out_f, in_f), add=lambda x, dw: F.linear(x, dw.to(x.dtype)))


def check_config(p: FLoRAParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "lora":
        raise ConfigError("algorithm 'flora' stacks clients' LoRA adapters: set peft.type = 'lora'")
    if max(p.ranks) > cfg.peft.r:
        raise ConfigError(f"method.ranks must be <= peft.r = {cfg.peft.r} (the largest client rank), got "
                          f"{p.ranks}; lower them or raise peft.r")
    if cfg.server.aggregation != "mean" or cfg.client.upload != "fp32":
        raise ConfigError("algorithm 'flora' aggregates exactly: set server.aggregation = 'mean' and "
                          "client.upload = 'fp32'")


def modules_of(infos: Infos) -> dict[str, tuple[str, str, str]]:
    """Each adapted module -> (its LoRA A, its LoRA B, its dense ΔW) tensor names."""
    out = {}
    for n, i in infos.items():
        if i.kind == "lora" and i.factor == "A":
            m = n.split(".lora_A.")[0]
            out[m] = (n, n.replace("lora_A", "lora_B"), f"{m}.lora_dense")
    return out


def merged_upload(params: Tensors, mods: Mapping[str, tuple[str, str, str]],
                  scalings: Scalings) -> dict[str, torch.Tensor]:
    """Each module's ΔW + s·B A: what FedAvg turns into the stacked product merged into ΔW."""
    return {d: (params[d].double() + scalings[a] * (params[b].double() @ params[a].double())).float()
            for a, b, d in mods.values()}


def build(p: FLoRAParams, spec: ModelSpec) -> Recipe[FLoRAState]:
    mods = modules_of(spec.infos)
    lora = [n for a, b, _ in mods.values() for n in (a, b)]

    def fresh(ops: ClientOps) -> dict[str, torch.Tensor]:
        r = p.ranks[ops.cid % len(p.ranks)]
        init = ops.fresh()
        out = {n: init[n].clone() for n in lora}
        for a, b, _ in mods.values():
            out[a][r:], out[b][:, r:] = 0, 0
        return out

    def receive(ops: ClientOps, rnd: int, received: Tensors, st: FLoRAState) -> tuple[Tensors, FLoRAState]:
        return {**received, **fresh(ops)}, FLoRAState(p.ranks[ops.cid % len(p.ranks)])

    def send(ops: ClientOps, rnd: int, trained: Tensors,
             st: FLoRAState) -> tuple[Tensors, FLoRAState, dict[str, float]]:
        return merged_upload(trained, mods, spec.scalings), st, {"rank": float(st.rank)}

    split = {n: S.GLOBAL if i.kind == "lora_dense" else S.PRIVATE for n, i in spec.infos.items()}
    return Recipe(split, phases=(Phase(S.PRIVATE, p.local_epochs),),
                  personalize=Personal(predict=lambda ops, params, slot: ops.test_logits({**params, **fresh(ops)})),
                  exchange=Exchange(receive, send), state=FLoRAState)


FLORA = Algorithm(FLoRAParams, build, "a LoRA rank per client, fresh every round; the server merges the exact "
                  "stacked aggregate into a dense base (FLoRA)", "https://arxiv.org/abs/2409.05976",
                  check_config, lora_parts=lambda p: LoraParts(beside={"dense": DENSE_BASE}))
