"""PFAdapter (Liu et al., arXiv:2607.12111; docs/design.md §3.1).

- Split (§III-B): LoRA on the q, k projections is GLOBAL (uploaded, averaged); v, o LoRA is
  PRIVATE (never leaves the client) — `fedsplice.core.split.by_roles`.
- Loss (Eq. 11): task cross-entropy + λo · Σ ‖ΔW_gᵀ ΔW_p‖²_F between every global and private
  LoRA update of a layer — `fedsplice.core.losses.Orthogonality` (O(d·r²), never d×d).
- Server: FedAvg of the GLOBAL deltas (any `[server] optimizer` composes).
- Traffic: only q, k LoRA travels, about half of federated LoRA's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fedsplice.algorithms.hooks import LossTerm
from fedsplice.algorithms.recipe import Algorithm, ModelSpec, Recipe
from fedsplice.config import check_roles
from fedsplice.core import split as S
from fedsplice.core.losses import Orthogonality
from fedsplice.errors import ConfigError


@dataclass
class PFAdapterParams:
    global_roles: list[str] = field(default_factory=lambda: ["q", "k"])
    ortho_lambda: float = 0.1  # λo
    selective_aggregation: bool = True  # off: every LoRA tensor is GLOBAL (ablation), λo kept
    # "BA": Eq. 11 on the updates ΔW = s·B·A; "A": ‖A_g A_pᵀ‖²_F, our extension (docs/fidelity.md)
    ortho_on: str = "BA"

    def check(self) -> None:
        check_roles("method.global_roles", self.global_roles)
        if not self.global_roles:
            raise ConfigError("method.global_roles is empty; PFAdapter shares at least one role (default q, k)")
        if self.ortho_lambda < 0:
            raise ConfigError(f"method.ortho_lambda must be >= 0, got {self.ortho_lambda}")
        if self.ortho_on not in ("BA", "A"):
            raise ConfigError(f"method.ortho_on must be 'BA' (Eq. 11) or 'A' (our extension), got {self.ortho_on!r}")


def build(p: PFAdapterParams, spec: ModelSpec) -> Recipe:
    infos = spec.infos
    split = S.by_roles(infos, p.global_roles) if p.selective_aggregation else S.all_global(infos)
    terms: list[LossTerm] = []
    if p.ortho_lambda > 0:
        terms.append(Orthogonality(infos, spec.shapes, spec.scalings, p.global_roles, p.ortho_lambda, p.ortho_on))
    return Recipe(split, terms)


PFADAPTER = Algorithm(PFAdapterParams, build, "LoRA q,k global / v,o private + orthogonality loss (PFAdapter)",
                      "Liu et al., PFAdapter: Hierarchical LoRA Decomposition for Personalized Federated "
                      "MLLMs, arXiv:2607.12111")
