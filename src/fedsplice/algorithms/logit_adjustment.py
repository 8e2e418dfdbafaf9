"""Logit-adjusted training (Menon et al., ICLR 2021), a switch (`[switch.logit_adjustment]`)
that composes with any method: the training logits are shifted by τ·log(π), π the client's own
class prior (from its training labels), so rare classes are not crowded out; evaluation is
unshifted. This file is the whole of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsplice.algorithms.recipe import Link, Switch
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.algorithms.hooks import ClientOps, Tensors
    from fedsplice.config import ExperimentConfig
    from fedsplice.core.context import TaskLoss


@dataclass(frozen=True)
class LogitAdjustmentParams:
    """The [switch.logit_adjustment] table."""

    tau: float = 1.0  # τ (the paper's default)

    def check(self) -> None:
        if not (isinstance(self.tau, (int, float)) and math.isfinite(self.tau) and self.tau > 0):
            raise ConfigError(f"switch.logit_adjustment.tau must be a finite number > 0, got {self.tau!r}")


def offset(tau: float, labels: np.ndarray, num_classes: int) -> torch.Tensor:
    """τ·log(π) [C], π the label frequencies (a class the client lacks: 1e-3 counts, not -inf)."""
    counts = np.bincount(labels, minlength=num_classes)
    return tau * torch.log(torch.as_tensor((counts + 1e-3) / counts.sum(), dtype=torch.float32))


def start(p: LogitAdjustmentParams, ops: ClientOps, kept: Tensors, received: Tensors) -> Link:
    shift = offset(p.tau, ops.labels(), ops.num_classes)

    def wrap(inner: TaskLoss) -> TaskLoss:
        def adjusted(logits: torch.Tensor, y: torch.Tensor, /) -> torch.Tensor:
            return inner(logits + shift.to(logits.device), y)
        return adjusted

    return Link(wrap=wrap)


def check_config(p: LogitAdjustmentParams, cfg: ExperimentConfig) -> None:
    if cfg.model.task == "generate":
        raise ConfigError("switch.logit_adjustment: model.task = 'generate' answers in free text; logit adjustment "
                          "shifts class logits: remove [switch.logit_adjustment]")


def moved(table: dict[str, Any]) -> None:
    """client.logit_adjustment = τ (0: off), as an earlier version wrote it, read as
    [switch.logit_adjustment] tau = τ."""
    client = table.get("client")
    if not isinstance(client, dict) or "logit_adjustment" not in client:
        return
    tau = client.pop("logit_adjustment")
    switches = table.setdefault("switch", {})
    if isinstance(switches, dict) and "logit_adjustment" in switches:  # a saved config never has both
        raise ConfigError(f"client.logit_adjustment = {tau} is now [switch.logit_adjustment] tau, which this config "
                          f"sets too: write switch.logit_adjustment.tau = {tau} (or switch.logit_adjustment = false "
                          f"to turn it off)")
    if not isinstance(tau, (int, float)) or tau < 0:
        raise ConfigError(f"client.logit_adjustment must be >= 0 (0 = off), got {tau!r}; it is now "
                          f"[switch.logit_adjustment] tau")
    if tau > 0 and isinstance(switches, dict):
        switches["logit_adjustment"] = {"tau": tau}


LOGIT_ADJUSTMENT = Switch(LogitAdjustmentParams, start, "logit-adjusted training: logits + τ·log(local prior)",
                          "Long-tail learning via logit adjustment (Menon et al., ICLR 2021)", label="+la",
                          check_config=check_config, moved=moved)
