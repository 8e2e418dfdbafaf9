"""Loss terms added to the task loss in the one local training loop.

A loss term is a callable `term(params, ctx) -> scalar tensor` over the name-keyed trainable
parameters; `ctx` (a `fedsplice.core.context.TrainContext`) carries per-round references (e.g.
the global weights received, for FedProx).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fedsplice.core.context import TrainContext
from fedsplice.core.split import ParamInfo
from fedsplice.errors import ConfigError

# ----------------------------------------------------------------- PFAdapter orthogonality
# Lo = Σ_layers Σ_{g∈G} Σ_{p∈P} ‖ΔW_gᵀ ΔW_p‖²_F with ΔW = s·B·A (B: out×r, A: r×in).
# Never form d×d products: both forms below are O(d·r²).


def ortho_column(a_g: Tensor, b_g: Tensor, a_p: Tensor, b_p: Tensor, s_g: float, s_p: float) -> Tensor:
    """‖ΔW_gᵀΔW_p‖² = s_g²s_p²·tr(Mᵀ(A_gA_gᵀ)M(A_pA_pᵀ)), M = B_gᵀB_p; needs equal output sizes."""
    m = b_g.T @ b_p
    return (s_g * s_p) ** 2 * torch.trace(m.T @ (a_g @ a_g.T) @ m @ (a_p @ a_p.T))


def ortho_row(a_g: Tensor, b_g: Tensor, a_p: Tensor, b_p: Tensor, s_g: float, s_p: float) -> Tensor:
    """‖ΔW_gΔW_pᵀ‖² = s_g²s_p²·tr((B_gᵀB_g)(A_gA_pᵀ)(B_pᵀB_p)(A_pA_gᵀ)); needs equal input sizes.

    Used where output sizes differ (grouped-query attention: q is wider than v).
    """
    c = a_g @ a_p.T
    return (s_g * s_p) ** 2 * torch.trace((b_g.T @ b_g) @ c @ (b_p.T @ b_p) @ c.T)


def ortho_naive(a_g: Tensor, b_g: Tensor, a_p: Tensor, b_p: Tensor, s_g: float, s_p: float,
                form: str = "column") -> Tensor:
    """The d×d reference, for tests and the overhead benchmark only."""
    dw_g, dw_p = s_g * b_g @ a_g, s_p * b_p @ a_p
    prod = dw_g.T @ dw_p if form == "column" else dw_g @ dw_p.T
    return (prod**2).sum()


@dataclass(frozen=True)
class OrthoPair:
    a_g: str
    b_g: str
    a_p: str
    b_p: str
    s_g: float
    s_p: float
    form: str  # "column" or "row"


class Orthogonality:
    """λo·Lo between the LoRA of `global_roles` and of the other roles, per attention block.

    on = "BA" is Eq. 11 (the updates ΔW = s·B·A). on = "A" is our extension, not the paper's:
    Σ ‖A_g A_pᵀ‖²_F on the down-projections alone (no scale), which is non-zero from the first
    step since A starts random while B starts at zero."""

    def __init__(self, infos: Mapping[str, ParamInfo], shapes: Mapping[str, tuple[int, ...]],
                 scalings: Mapping[str, float], global_roles: Iterable[str], weight: float, on: str = "BA"):
        self.weight, self.on = weight, on
        self.pairs: list[OrthoPair] = []
        blocks: dict[str, dict[str, dict[str, str]]] = {}
        for name, info in infos.items():
            if info.kind == "lora" and info.role is not None and info.layer is not None and info.factor is not None:
                blocks.setdefault(info.layer, {}).setdefault(info.role, {})[info.factor] = name
        g_roles = set(global_roles)
        for layer in sorted(blocks):
            roles = blocks[layer]
            for g in sorted(r for r in roles if r in g_roles):
                for p in sorted(r for r in roles if r not in g_roles):
                    self.pairs.append(self._pair(roles[g], roles[p], shapes, scalings, layer, g, p))
        # Pairs of one form and shape are stacked and computed in a few batched products: one
        # Python op per pair (24 pairs in MiniLM) cost more than the arithmetic. Grouped once here.
        groups: dict[tuple[str, *tuple[tuple[int, ...], ...]], list[OrthoPair]] = {}
        for pr in self.pairs:
            key: tuple[str, *tuple[tuple[int, ...], ...]] = (
                pr.form, *(tuple(shapes[n]) for n in (pr.a_g, pr.b_g, pr.a_p, pr.b_p)))
            groups.setdefault(key, []).append(pr)
        # The scales (s_g·s_p)² are kept as Python floats (float64) and made tensors in the
        # parameters' own dtype and device (cached): a float32 copy put a 2e-8 relative error on
        # float64 runs (rsLoRA's alpha/sqrt(r), for one, is not a float32 number).
        self._groups = [(key[0], grp, [(pr.s_g * pr.s_p) ** 2 for pr in grp]) for key, grp in groups.items()]
        if on == "A" and any(shapes[pr.a_g][1] != shapes[pr.a_p][1] for pr in self.pairs):
            raise ConfigError("method.ortho_on = 'A' needs equal LoRA input sizes in every global/private pair; "
                              "use method.ortho_on = 'BA'")
        self._scales: dict[tuple[int, torch.dtype, torch.device], Tensor] = {}

    def _scale(self, i: int, like: torch.Tensor) -> torch.Tensor:
        key = (i, like.dtype, like.device)
        if key not in self._scales:
            self._scales[key] = torch.tensor(self._groups[i][2], dtype=like.dtype, device=like.device)
        return self._scales[key]

    @staticmethod
    def _pair(g: dict[str, str], p: dict[str, str], shapes: Mapping[str, tuple[int, ...]],
              scalings: Mapping[str, float], layer: str, rg: str, rp: str) -> OrthoPair:
        (out_g, _), (_, in_g) = shapes[g["B"]], shapes[g["A"]]
        (out_p, _), (_, in_p) = shapes[p["B"]], shapes[p["A"]]
        if out_g == out_p:
            form = "column"
        elif in_g == in_p:
            form = "row"
        else:
            raise ConfigError(
                f"orthogonality between roles {rg} and {rp} in {layer}: neither input nor output "
                f"sizes match ({in_g}x{out_g} vs {in_p}x{out_p}); set method.ortho_lambda = 0")
        return OrthoPair(g["A"], g["B"], p["A"], p["B"], scalings[g["A"]], scalings[p["A"]], form)

    def __call__(self, params: Mapping[str, Tensor], ctx: TrainContext | None = None) -> Tensor:
        total = None
        for i, (form, grp, _) in enumerate(self._groups):
            a_g, b_g, a_p, b_p = (torch.stack([params[getattr(pr, f)] for pr in grp])
                                  for f in ("a_g", "b_g", "a_p", "b_p"))
            scale = self._scale(i, a_g)
            t: Callable[[Tensor], Tensor] = lambda x: x.transpose(1, 2)  # noqa: E731
            if self.on == "A":
                term = ((a_g @ t(a_p)) ** 2).sum()
            else:
                term = (scale * self._trace(form, a_g, b_g, a_p, b_p, t)).sum()
            total = term if total is None else total + term
        return self.weight * (torch.zeros(()) if total is None else total)

    @staticmethod
    def _trace(form: str, a_g: Tensor, b_g: Tensor, a_p: Tensor, b_p: Tensor,
               t: Callable[[Tensor], Tensor]) -> Tensor:
        if form == "column":  # as ortho_column, batched over pairs
            m = t(b_g) @ b_p
            prod = t(m) @ (a_g @ t(a_g)) @ m @ (a_p @ t(a_p))
        else:  # as ortho_row
            c = a_g @ t(a_p)
            prod = (t(b_g) @ b_g) @ c @ (t(b_p) @ b_p) @ t(c)
        return prod.diagonal(dim1=1, dim2=2).sum(-1)


def proximal(params: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor], names: list[str],
             mu: float) -> torch.Tensor:
    """FedProx: μ/2·‖θ − θ⁰‖² over the tensors `names`, θ⁰ = `ref` (the weights received)."""
    sq = sum(((params[n] - ref[n]) ** 2).sum() for n in names)
    return torch.as_tensor(0.5 * mu * sq)  # the same tensor (a float 0 without names)


def prompt_contrastive(z_template: torch.Tensor, z_global: torch.Tensor, z_personal: torch.Tensor,
                       tau: float) -> torch.Tensor:
    """FedPGP's prompt-wise contrastive loss (Cui et al. 2024; its official code): for each class
    c, a two-way InfoNCE with the global prompt's features pulled toward the hand-crafted ones
    (positive) and pushed from the personalized ones (negative),
    mean_c −log(e^{pos_c/τ} / (e^{pos_c/τ} + e^{neg_c/τ})) = mean_c softplus((neg_c − pos_c)/τ),
    pos_c = cos(z_template_c, z_global_c), neg_c = cos(z_global_c, z_personal_c); [C, D] each."""
    n = torch.nn.functional.normalize
    pos = (n(z_template, dim=-1) * n(z_global, dim=-1)).sum(-1)
    neg = (n(z_global, dim=-1) * n(z_personal, dim=-1)).sum(-1)
    return torch.nn.functional.softplus((neg - pos) / tau).mean()
