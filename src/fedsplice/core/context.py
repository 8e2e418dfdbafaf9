"""TrainContext: what an objective, a loss term and the client loop may read during one client's
local training (docs/extending.md). Built by the federation layer (`federation.tasks.train_context`)
once per client-round; its tensors move to the model's device with `to`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast

import torch
import torch.nn.functional as F

_T = TypeVar("_T")


class TaskLoss(Protocol):
    """(logits [N, C], labels [N]) -> the scalar task loss."""

    def __call__(self, logits: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor: ...


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
    return F.cross_entropy(logits, y)


@dataclass
class TrainContext:
    client: int = 0
    round: int = 0  # 1-based; 0 outside the rounds (cold start, phase 2 after the rounds)
    split: dict[str, str] = field(default_factory=dict)  # trainable name -> GLOBAL / PRIVATE
    # the classification loss an objective applies to its logits: cross-entropy, wrapped by the
    # config's switches (logit adjustment shifts the logits, a gradient balancer re-weights them;
    # fedsplice.algorithms.switches), so no objective has to know them
    task_loss: TaskLoss = cross_entropy
    # the method's client state (Recipe.state) as its Exchange.receive left it this round
    # (HetLoRA: the client's rank), read-only: what persists is what the method's hooks return
    state: object = field(default_factory=dict)

    def to(self, device: torch.device) -> TrainContext:
        """A copy with every tensor on `device`: the loop's context for one local update (a
        switch's task loss moves what it holds itself)."""
        def move(v: _T) -> _T:  # the same kind of value, its tensors on `device`
            if torch.is_tensor(v):
                return cast(_T, v.to(device))
            if isinstance(v, dict):
                return cast(_T, {k: t.to(device) if torch.is_tensor(t) else t for k, t in v.items()})
            if dataclasses.is_dataclass(v) and not isinstance(v, type):  # a method's state
                return cast(_T, dataclasses.replace(v, **{f.name: move(getattr(v, f.name))
                                                          for f in dataclasses.fields(v)}))
            return v

        return dataclasses.replace(self, **{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})
