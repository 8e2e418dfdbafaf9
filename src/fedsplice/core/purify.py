"""Gradient purification (FedPuReL Eq. 5; DESIGN §3.2): the task gradient loses its component
that opposes the alignment gradient, so a step never increases the alignment loss to first order.

A grad transform combines per-loss gradients into the one the optimizer steps with
(`transform(grads: {loss: [tensor per param]}) -> ([tensor per param], stats)`). Pure math.
"""

from __future__ import annotations

import numpy as np
import torch


def project(g_task: torch.Tensor, g_align: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """Remove the component of g_task opposing g_align (only when ⟨g_task, g_align⟩ < 0)."""
    dot = (g_task * g_align).sum()
    nrm = (g_align * g_align).sum()
    if dot < 0 and nrm > 0:
        return g_task - (dot / nrm) * g_align, True
    return g_task, False


def purification(granularity: str = "tensor"):
    """The grad transform: step with the purified task gradient only.

    granularity "tensor" projects each parameter tensor separately (the official code);
    "flat" projects the concatenation of all tensors (the paper's Eq. 5).
    """

    def transform(grads: dict[str, list[torch.Tensor]]):
        gt, ga = grads["task"], grads["align"]
        if granularity == "flat":
            flat_t = torch.cat([g.reshape(-1) for g in gt])
            flat_a = torch.cat([g.reshape(-1) for g in ga])
            out, hit = project(flat_t, flat_a)
            parts, i = [], 0
            for g in gt:
                parts.append(out[i:i + g.numel()].view_as(g))
                i += g.numel()
            return parts, {"purified_steps": float(hit), "purified_tensors": float(hit)}
        res = [project(a, b) for a, b in zip(gt, ga)]
        hits = [h for _, h in res]
        return [g for g, _ in res], {"purified_steps": float(any(hits)),
                                     "purified_tensors": float(np.mean(hits)) if hits else 0.0}

    return transform
