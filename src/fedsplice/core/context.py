"""TrainContext: what an objective, a loss term and the client loop may read during one client's
local training (docs/extending.md). Built by the federation layer (`federation.tasks.train_context`)
once per client-round; its tensors move to the model's device with `to`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

import torch

if TYPE_CHECKING:
    from fedsplice.core.grab import Balancer

_T = TypeVar("_T")


@dataclass
class TrainContext:
    client: int = 0
    round: int = 0  # 1-based; 0 outside the rounds (cold start, phase 2 after the rounds)
    # the GLOBAL tensors received this round (FedProx's reference), by name
    global_ref: Mapping[str, torch.Tensor] = field(default_factory=dict)
    split: dict[str, str] = field(default_factory=dict)  # trainable name -> GLOBAL / PRIVATE
    # added to the logits of the task loss: logit adjustment's tau·log(local prior) [C], or 0
    logit_offset: torch.Tensor | float = 0.0
    # frozen zero-shot logits of the whole training set [N, C], indexed by sample id (a recipe
    # with needs_zero_shot and runtime.cache); None: compute them per step
    zero_shot: torch.Tensor | None = None
    # the frozen global model's logits on the client's training data, indexed by sample id (a
    # FedPuReL phase 2's residual objective)
    global_logits: torch.Tensor | None = None
    grab: Balancer | None = None  # Fed-GraB's balancer (fedsplice.core.grab.Balancer) when grab.enabled
    # a method's own state within one local update (e.g. a step counter): empty at its start
    scratch: dict[str, object] = field(default_factory=dict)
    # the method's client slot as its Exchange.receive left it this round (HetLoRA: the client's
    # rank), read-only: what persists is what the method's hooks return
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def to(self, device: torch.device) -> TrainContext:
        """A copy with every tensor on `device` (the balancer moves its own state) and an empty
        scratch: the loop's context for one local update."""
        def move(v: _T) -> _T:  # the same kind of value, its tensors on `device`
            if torch.is_tensor(v):
                return cast(_T, v.to(device))
            if isinstance(v, dict):
                return cast(_T, {k: t.to(device) if torch.is_tensor(t) else t for k, t in v.items()})
            return v

        moved = {f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)
                 if f.name not in ("grab", "scratch")}
        return dataclasses.replace(self, scratch={}, **moved)
