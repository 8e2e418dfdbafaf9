"""Temperature-aligned KL (FedPuReL Eq. 3-4; docs/design.md §3.2): both predictions are brought to the
same entropy before their KL is taken, so the alignment loss compares ranks, not confidence.

Pure tensor math: torch only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TAU_MIN, TAU_MAX, BISECTION_STEPS = 0.05, 20.0, 30


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """H(softmax(logits)) per row."""
    logp = F.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@torch.no_grad()
def temperature_for_entropy(logits: torch.Tensor, target: torch.Tensor, steps: int = BISECTION_STEPS,
                            lo: float = TAU_MIN, hi: float = TAU_MAX) -> torch.Tensor:
    """Per-row τ with H(softmax(a/τ)) = target, by vectorized bisection on [lo, hi].

    The entropy grows monotonically with τ, so bisection converges; we bisect geometrically
    (τ spans 2.6 decades) and clamp to the interval when the target lies outside it.
    """
    a = logits.detach().double()
    t = target.detach().double()
    lo_t = torch.full(t.shape, lo, dtype=torch.float64, device=a.device)
    hi_t = torch.full(t.shape, hi, dtype=torch.float64, device=a.device)
    for _ in range(steps):
        mid = (lo_t * hi_t).sqrt()
        too_cold = entropy(a / mid.unsqueeze(-1)) < t
        lo_t = torch.where(too_cold, mid, lo_t)
        hi_t = torch.where(too_cold, hi_t, mid)
    return (lo_t * hi_t).sqrt().to(logits.dtype)


def aligned_temperatures(f: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """τ_f, τ_z bringing both predictions to H* = ½(H(softmax f) + H(softmax z)); no gradient."""
    with torch.no_grad():
        h_star = 0.5 * (entropy(f.detach()) + entropy(z.detach()))
    return temperature_for_entropy(f, h_star), temperature_for_entropy(z, h_star)


def tkl(f: torch.Tensor, z: torch.Tensor, aligned: bool = True) -> torch.Tensor:
    """Per-sample KL(softmax(z/τ_z) ‖ softmax(f/τ_f)); τ's carry no gradient. aligned=False
    gives the plain KL (τ = 1), the paper's Table 6 ablation."""
    if aligned:
        tf, tz = aligned_temperatures(f, z)
        f, z = f / tf.unsqueeze(-1), z / tz.unsqueeze(-1)
    log_pz, log_pf = F.log_softmax(z.detach(), -1), F.log_softmax(f, -1)
    return (log_pz.exp() * (log_pz - log_pf)).sum(-1)
