"""Entropic partial optimal transport (FedOTP, Li et al. CVPR 2024; its official code's solver).

For each of P problems: a cost C [M, N] between M local features (an input's tokens) and N
prompts, token capacities a [M] (1/M per real token, 0 for padding) and a mass γ that each
prompt receives in equal parts (b_n = γ/N). The plan solves

    min_T ⟨T, C⟩ − ε·H(T)   s.t.  T ≥ 0,  T·1_N ≤ a,  Tᵀ·1_M = b,

so only γ ≤ 1 of the token mass moves and the worst-matching tokens can be left out (γ = 1 is
balanced OT). The solver is a Sinkhorn-like scaling loop (the official `entropic_COT_fast`,
itself a batched form of POT's `ot.partial.entropic_partial_wasserstein`):
u = min(a / (K v), 1), v = b / (Kᵀ u), K = exp(−C/ε), until the mean |Δv| over the whole batch
falls below `thresh` or after `iters` iterations; T = diag(u)·K·diag(v). It runs in float64
(exp(−C/ε) underflows in float32 for small ε) and without gradients: the plan is a constant.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def partial_plan(cost: torch.Tensor, capacity: torch.Tensor, gamma: float, eps: float,
                 iters: int = 100, thresh: float = 1e-3, chunk: int | None = None) -> torch.Tensor:
    """The plans T [P, M, N] of P problems: cost [P, M, N], capacity a [P, M] (rows sum to 1).
    `chunk`: iterations between reads of the stopping test (None: 1 on the CPU, 10 elsewhere)."""
    c = cost.double()
    a = capacity.double().unsqueeze(-1)  # [P, M, 1]
    k = torch.exp(-c / eps) * (a > 0)  # padding tokens take no mass
    b = gamma / c.shape[-1]
    v = torch.ones(c.shape[0], 1, c.shape[-1], dtype=torch.float64, device=c.device)
    u = torch.ones_like(a)
    # the stopping test is read every `chunk` iterations, and the plan is the one of the first
    # iteration that met it: the same plan, with one host sync a chunk instead of one an iteration
    chunk, it = chunk or (1 if c.device.type == "cpu" else 10), 0
    while it < iters:
        hist, met = [], []
        for _ in range(min(chunk, iters - it)):
            v_old = v
            kv = (k * v).sum(-1, keepdim=True)  # [P, M, 1]
            u = torch.where(a > 0, torch.clamp(a / kv.clamp_min(1e-300), max=1.0), torch.zeros_like(a))
            v = b / (k * u).sum(1, keepdim=True).clamp_min(1e-300)  # [P, 1, N]
            hist.append((u, v))
            met.append((v - v_old).abs().mean() < thresh)
            it += 1
        met_t = torch.stack(met)
        first = int(torch.where(met_t.any(), met_t.int().argmax(), -1))
        if first >= 0:
            u, v = hist[first]
            break
    return (u * k * v).to(cost.dtype)


def ot_scores(tokens: torch.Tensor, mask: torch.Tensor, prompts: torch.Tensor, gamma: float, eps: float,
              iters: int = 100, thresh: float = 1e-3) -> torch.Tensor:
    """FedOTP's class scores [B, K]: Σ_{m,n} T_mn·cos(token_m, prompt_n,k) for every input and
    class, T the partial plan on the cost 1 − cos. tokens [B, M, D] and prompts [N, K, D] are
    L2-normalized; mask [B, M] marks the real tokens (each gets capacity 1/M_real). The gradient
    reaches the features through the cosines only."""
    with torch.autocast(tokens.device.type, enabled=False):  # the plan's precision is the point
        sim = torch.einsum("bmd,nkd->bkmn", tokens.float(), prompts.float())  # [B, K, M, N]
    bsz, ncls, m, n = sim.shape
    cap = mask.to(torch.float64) / mask.sum(1, keepdim=True).clamp_min(1)  # [B, M]
    cap = cap.unsqueeze(1).expand(bsz, ncls, m).reshape(bsz * ncls, m)
    plan = partial_plan((1 - sim.detach()).reshape(bsz * ncls, m, n), cap, gamma, eps, iters, thresh)
    return (plan.reshape(bsz, ncls, m, n) * sim).sum((-2, -1))
