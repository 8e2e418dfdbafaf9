"""Gradient purification (FedPuReL Eq. 5; docs/design.md §3.2): the task gradient loses its component
that opposes the alignment gradient, so a step never increases the alignment loss to first order.

A grad transform combines per-loss gradients into the one the optimizer steps with
(`transform(grads: {loss: [tensor per param]}) -> ([tensor per param], stats)`). Pure math.

Ties (docs/fidelity.md "purification ties"): the sign of ⟨g_task, g_align⟩ decides whether a
step is projected, but where that product is rounding noise its sign is the CPU's, not the
model's. Two such cases are not conflicts:
- g_align is zero to working precision: ‖g_align‖ ≤ tie_tol·‖g_task‖. While the model still
  sits at zero-shot (LoRA's B = 0 in its first step, f = z), the alignment gradient is the
  rounding noise of f − z (cached z vs this batch's f: ~1e-7 relative), not a direction.
- the two are orthogonal to working precision: |⟨g_task, g_align⟩| ≤ tie_tol·‖g_task‖‖g_align‖.
  Projecting would change g_task by at most tie_tol·‖g_task‖ anyway.
tie_tol = 0 is the exact sign rule of the paper and the official code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast, overload

import torch

# Measured (benchmarks/purify_ties.py, benchmarks/results/purify_ties.md): ‖g_align‖/‖g_task‖ is
# <= 2.4e-7 (two float32 ulps) where the model sits at zero-shot and >= 8.9e-4 once it has taken
# one step; 1e-5 leaves a factor of 40 above the one and 90 below the other.
TIE_TOL = 1e-5


_N = TypeVar("_N", torch.Tensor, float)  # is_tie's numbers: floats, or 0-d tensors
# grads {"task": [tensor per param], "align": [...]} -> (the step's gradient per param, statistics)
GradTransform = Callable[[dict[str, list[torch.Tensor]]], tuple[list[torch.Tensor], dict[str, torch.Tensor]]]


@overload
def is_tie(dot: float, norm_task: float, norm_align: float, tie_tol: float = ...) -> bool: ...
@overload
def is_tie(dot: torch.Tensor, norm_task: torch.Tensor, norm_align: torch.Tensor,
           tie_tol: float = ...) -> torch.Tensor: ...
def is_tie(dot: _N, norm_task: _N, norm_align: _N, tie_tol: float = TIE_TOL) -> torch.Tensor | bool:
    """Whether the sign of dot = ⟨g_task, g_align⟩ is below working precision (see above).
    Floats give a bool, 0-d tensors a bool tensor (no host sync)."""
    return (norm_align <= tie_tol * norm_task) | (abs(dot) <= tie_tol * norm_task * norm_align)


def project(g_task: torch.Tensor, g_align: torch.Tensor, tie_tol: float = TIE_TOL) -> tuple[torch.Tensor, torch.Tensor]:
    """Remove the component of g_task opposing g_align (only when ⟨g_task, g_align⟩ < 0 and that
    is not a tie). Returns (the gradient, whether it was projected: a bool 0-d tensor). No host
    sync: without a conflict the coefficient is 0 and g_task − 0·g_align is g_task exactly."""
    dot = (g_task * g_align).sum()
    nrm = (g_align * g_align).sum()
    conflict = (dot < 0) & (nrm > 0) & ~is_tie(dot, g_task.norm(), nrm.sqrt(), tie_tol)
    coef = torch.where(conflict, dot / torch.where(conflict, nrm, torch.ones_like(nrm)), torch.zeros_like(dot))
    return g_task - coef * g_align, conflict


def purification(granularity: str = "tensor", tie_tol: float = TIE_TOL) -> GradTransform:
    """The grad transform: step with the purified task gradient only.

    granularity "tensor" projects each parameter tensor separately (the official code);
    "flat" projects the concatenation of all tensors (the paper's Eq. 5).
    """

    def transform(grads: dict[str, list[torch.Tensor]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        gt, ga = grads["task"], grads["align"]
        if granularity == "flat":
            flat_t = torch.cat([g.reshape(-1) for g in gt])
            flat_a = torch.cat([g.reshape(-1) for g in ga])
            flat, hit = project(flat_t, flat_a, tie_tol)
            parts, i = [], 0
            for g in gt:
                parts.append(flat[i:i + g.numel()].view_as(g))
                i += g.numel()
            hit = hit.to(flat_t.dtype)
            return parts, {"purified_steps": hit, "purified_tensors": hit, **geometry(gt, ga, parts, tie_tol)}
        res = [project(a, b, tie_tol) for a, b in zip(gt, ga)]
        hits = torch.stack([h for _, h in res]).to(gt[0].dtype)
        out = [g for g, _ in res]
        return out, {"purified_steps": hits.max(), "purified_tensors": hits.mean(), **geometry(gt, ga, out, tie_tol)}

    return transform


def geometry(g_task: list[torch.Tensor], g_align: list[torch.Tensor], g_out: list[torch.Tensor],
             tie_tol: float = TIE_TOL) -> dict[str, torch.Tensor]:
    """What purification did to a step, over all tensors together (the results page shows it per
    round): cos(g_task, g_align) and ‖g̃‖ / ‖g_task‖, as 0-d tensors (the loop reads them with its
    other statistics). cos is 0 where g_align is zero to working precision (‖g_align‖ ≤
    tie_tol·‖g_task‖, as `is_tie`): at zero-shot it is rounding noise, whose direction is the
    CPU's; the ratio is 1 where g_task is zero."""
    # sum() starts from the int 0: a tensor for a non-empty list
    dot = cast(torch.Tensor, sum((t * a).sum() for t, a in zip(g_task, g_align)))
    nt = torch.sqrt(cast(torch.Tensor, sum((t * t).sum() for t in g_task)))
    na = torch.sqrt(cast(torch.Tensor, sum((a * a).sum() for a in g_align)))
    no = torch.sqrt(cast(torch.Tensor, sum((o * o).sum() for o in g_out)))
    tiny = torch.finfo(nt.dtype).tiny
    cos = torch.where((nt > 0) & (na > tie_tol * nt), dot / (nt * na).clamp_min(tiny), torch.zeros_like(dot))
    return {"purify_cos": cos, "purify_norm_ratio": torch.where(nt > 0, no / nt.clamp_min(tiny), torch.ones_like(nt))}
