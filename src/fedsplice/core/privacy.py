"""Client-level differential privacy (DP-FedAvg, McMahan et al., ICLR 2018): the math.

A client's update Δ_k (its GLOBAL tensors minus what it received) is clipped as one vector to L2
norm S: Δ_k · min(1, S / ‖Δ_k‖). The server releases (Σ_k clipped Δ_k + N(0, (z·S)² I)) / m with
m fixed in advance (the planned clients a round), so one client's presence moves the sum by at
most S: the Gaussian mechanism with noise multiplier z, once per round, on a sampled fraction
q of the clients. The privacy spent is counted by Opacus' accountants (federation.privacy), never by our own math.
"""

from __future__ import annotations

import math
import secrets

import torch

Params = dict[str, torch.Tensor]


def global_norm(update: Params) -> float:
    """The L2 norm of all tensors together, in float64."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in update.values()))


def clip(update: Params, bound: float) -> tuple[Params, float]:
    """`update` scaled to L2 norm at most `bound` (as one vector), in float64; and its norm before."""
    norm = global_norm(update)
    scale = min(1.0, bound / norm) if norm > 0 else 1.0
    return {n: t.double() * scale for n, t in update.items()}, norm


def generator(seed: list[int] | None, device: torch.device | str = "cpu") -> torch.Generator:
    """The noise's RNG on `device`: from `seed` (reproducible, no secret) or, with None, from the
    OS's entropy."""
    g = torch.Generator(device=device)
    if seed is None:
        g.manual_seed(secrets.randbits(63))
    else:
        g.manual_seed(hash(tuple(seed)) & 0x7FFF_FFFF_FFFF_FFFF)
    return g


def add_noise(tensors: Params, std: float, gen: torch.Generator) -> Params:
    """tensors + N(0, std²) per coordinate, in float64, drawn in name order."""
    return {n: tensors[n].double() + std * torch.randn(tensors[n].shape, generator=gen, dtype=torch.float64)
            for n in sorted(tensors)}
