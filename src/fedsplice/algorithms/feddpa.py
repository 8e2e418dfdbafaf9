"""FedDPA (Yang et al., "Dual-Personalizing Adapter for Federated Foundation Models", NeurIPS
2024, https://arxiv.org/abs/2403.19211; official code Lydia-yang/FedDPA@cf638c1): FedDPA-T, a
global and a local LoRA adapter on the same modules, trained in turn, mixed per test instance.
Everything of the method is in this file (its registration aside); docs/fidelity.md has its rows.

- Parameters: the shared LoRA ("default", GLOBAL, averaged) and a local one ("local", PRIVATE,
  never sent) of rank method.local_r, its LoraParts (the code copies the global adapter's config).
- Training (the code's iterative FedDPA-T): round 1 trains the global adapter alone, the local
  one off. Every later round: first the local adapter with the received global frozen, forward
  W0x + a·ΔW_l x + (1−a)·ΔW_g x (a = method.local_weight = 0.5; the code detaches the global
  branch, here it is frozen: the same gradient); then the global adapter alone, from the received
  global, the local one off (W0x + ΔW_g x). Each phase has its own optimizer and runs
  method.local_epochs (the code: local_num_epochs for each phase); method.budget = "shared" splits
  one local budget instead.
- Test time (PM): for each test instance x, α(x) = method.max_weight · mean_j cos(e(x), e(x_j)),
  over method.instance_num training instances x_j of the client drawn at random for that x, e
  the input features of the model with the local adapter only (the code: the last token's hidden
  state, W0 + local; on model.task = "generate" that is the prompt's last token). Forward
  W0x + α·ΔW_g x + (1−α)·ΔW_l x (the code puts α on the GLOBAL adapter; method.alpha_on =
  "local" is the other reading). GM: the global adapter alone.
  method.alpha_grid > 0 (ours) rounds α to a grid so that instances share forwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, cast

import numpy as np
import torch
from torch import nn

from fedsplice.algorithms.hooks import Around, ClientOps, Scores, Tensors
from fedsplice.algorithms.recipe import Algorithm, LoraParts, ModelSpec, Personal, Phase, PhasesOf, Recipe
from fedsplice.core import split as S
from fedsplice.errors import ConfigError

if TYPE_CHECKING:
    from fedsplice.config import ExperimentConfig

LOCAL = "local"  # the local adapter's name (its tensors' kind: "lora_local")
SHARED = "default"  # peft's name of the shared adapter
EVAL_DRAWS = 0  # ClientOps.rng key of the reference draws (the same at every evaluation)


@dataclass
class FedDPAParams:
    local_r: int = 8  # the code copies the global adapter's config: peft.r = 8
    local_weight: float = 0.5  # a: the local adapter's weight in the local phase (main.py: local_weight)
    local_epochs: int = 1  # each phase's epochs (the code: local_num_epochs for both phases)
    # per_phase: each phase its own epochs (the code: twice a one-phase method's steps); shared:
    # the two phases split the client's one local budget (for a comparison at equal steps)
    budget: Literal["per_phase", "shared"] = "per_phase"
    instance_num: int = 5  # S: training instances drawn per test instance
    max_weight: float = 0.5  # λ: α = λ · mean cosine similarity (the code: half = True, max_weight 0.5)
    alpha_on: Literal["global", "local"] = "global"  # which adapter α weights (the code: global)
    # > 0: α rounded to this grid (Ext.), so that test instances of equal α share a forward: on a
    # dual encoder every distinct α also re-encodes the class side (LoRA is in its text tower)
    alpha_grid: float = 0.0

    def check(self) -> None:
        if self.local_r < 1:
            raise ConfigError(f"method.local_r must be >= 1 (the local adapter's rank), got {self.local_r}")
        if not 0.0 <= self.local_weight <= 1.0:
            raise ConfigError(f"method.local_weight must be in [0, 1] (the code: 0.5), got {self.local_weight}")
        if self.alpha_grid < 0:
            raise ConfigError(f"method.alpha_grid must be >= 0 (0: every instance its exact α), got {self.alpha_grid}")
        if self.local_epochs < 1 or self.instance_num < 1:
            raise ConfigError(f"method.local_epochs and method.instance_num must be >= 1, got "
                              f"{self.local_epochs} and {self.instance_num}")


def check_config(p: FedDPAParams, cfg: ExperimentConfig) -> None:
    if cfg.peft.type != "lora":
        raise ConfigError("algorithm 'feddpa' trains a global and a local LoRA adapter: set peft.type = 'lora'")
    if cfg.model.task not in ("encoder_head", "dual_encoder", "generate"):
        raise ConfigError(f"algorithm 'feddpa' weighs its adapters by input-feature similarity, which "
                          f"model.task = {cfg.model.task!r} has not: use 'encoder_head', 'dual_encoder' or "
                          f"'generate' (instruction records, the paper's own task)")


@dataclass(frozen=True)
class Mix:
    """An adapter mix (hooks.Around): in its context each named LoRA adapter's output is
    multiplied by its factor (its scaling s becomes factor·s in every peft LoRA layer, which
    multiplies B(A(x)) by it in the forward: h = W0 x + Σ_adapter factor·s·B A x; 0: off); the
    others keep theirs. Restored on exit. A value, so phases compare equal."""

    factors: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, factors: Mapping[str, float]) -> Mix:
        return cls(tuple((k, float(f)) for k, f in factors.items()))

    @contextmanager
    def __call__(self, model: nn.Module) -> Iterator[None]:
        saved = []
        for mod in model.modules():
            scaling = getattr(mod, "scaling", None)  # peft's LoraLayer: {adapter: alpha / r}
            if isinstance(scaling, dict):
                for adapter, f in self.factors:
                    if adapter in scaling:
                        saved.append((scaling, adapter, scaling[adapter]))
                        scaling[adapter] = scaling[adapter] * f
        try:
            yield
        finally:
            for scaling, adapter, s in saved:
                scaling[adapter] = s


def mix_groups(factors: Mapping[str, np.ndarray]) -> list[tuple[Around, np.ndarray]]:
    """{adapter: a factor per test sample} -> [(Mix, positions)]: the samples of equal factors,
    scored as one batch (ClientOps.test_logits' groups)."""
    table = np.stack([np.asarray(f, dtype=np.float64) for f in factors.values()], 1)
    rows, group = np.unique(table, axis=0, return_inverse=True)
    return [(Mix(tuple(zip(factors, row.tolist()))), np.flatnonzero(group.reshape(-1) == g))
            for g, row in enumerate(rows)]


def phases(p: FedDPAParams) -> PhasesOf:
    """round -> the round's phases: the global adapter alone in round 1, else local then global."""
    glob = Phase(S.GLOBAL, p.local_epochs, Mix.of({LOCAL: 0.0}))
    local = Phase(S.PRIVATE, p.local_epochs, Mix.of({LOCAL: p.local_weight, SHARED: 1.0 - p.local_weight}))
    return lambda rnd: (glob,) if rnd <= 1 else (local, glob)


def instance_alpha(test: np.ndarray, bank: np.ndarray, refs: np.ndarray, lam: float) -> np.ndarray:
    """α_i = λ · mean_j cos(test_i, bank[refs[i, j]]): test [n, D], bank [N, D], refs [n, S]."""
    def unit(x: np.ndarray) -> np.ndarray:
        return cast(np.ndarray, x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12))
    cos = np.einsum("nd,nsd->ns", unit(test.astype(np.float64)), unit(bank.astype(np.float64))[refs])
    return cast(np.ndarray, lam * cos.mean(1))  # numpy's stubs: Any


class FeatureModel(Protocol):
    """What FedDPA reads of the model: a TaskModel's input features (algorithms import no
    model)."""

    def features(self, texts: list[str], batch_size: int, /) -> torch.Tensor: ...


LOCAL_ALONE = Mix.of({SHARED: 0.0, LOCAL: 1.0})


def local_features(model: nn.Module, texts: list[str], batch_size: int) -> torch.Tensor:
    """e(x) [N, D] (ClientOps.run's fn): the model's input features (TaskModel.features) with the
    local adapter alone (W0 + local, the code's)."""
    with LOCAL_ALONE(model):
        return cast(FeatureModel, model).features(texts, batch_size)


def dynamic_mix(p: FedDPAParams) -> Personal:
    """The PM: each test instance with its own α (instance_alpha), its adapters mixed by it."""
    def predict(ops: ClientOps, params: Tensors, slot: object) -> np.ndarray | Scores:  # it keeps no state
        test, bank = (ops.run(params, on, local_features).numpy() for on in ("test", "train"))
        rng, s = ops.rng(EVAL_DRAWS), min(p.instance_num, len(bank))
        refs = np.array([rng.choice(len(bank), size=s, replace=False) for _ in range(len(test))],
                        dtype=np.int64).reshape(len(test), s)
        alpha = instance_alpha(test, bank, refs, p.max_weight)
        if p.alpha_grid > 0:
            alpha = np.round(alpha / p.alpha_grid) * p.alpha_grid
        on_global = p.alpha_on == "global"
        return ops.test_logits(params, mix_groups({SHARED: alpha if on_global else 1.0 - alpha,
                                                   LOCAL: 1.0 - alpha if on_global else alpha}))
    return Personal(predict=predict)


def build(p: FedDPAParams, spec: ModelSpec) -> Recipe:
    split = {n: S.PRIVATE if i.kind == f"lora_{LOCAL}" else S.GLOBAL for n, i in spec.infos.items()}
    return Recipe(split, phases=phases(p), phases_share_budget=p.budget == "shared", personalize=dynamic_mix(p))


FEDDPA = Algorithm(FedDPAParams, build, "global LoRA averaged, local LoRA kept; trained in turn (local, then "
                   "global), mixed per test instance by feature similarity (FedDPA-T)",
                   "https://arxiv.org/abs/2403.19211", check_config,
                   lora_parts=lambda p: LoraParts({LOCAL: p.local_r}))
