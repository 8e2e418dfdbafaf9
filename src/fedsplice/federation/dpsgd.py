"""privacy.local = "dpsgd": sample-level DP-SGD (Abadi et al., CCS 2016) inside each client, by Opacus.

Every local step, Opacus' hooks give each example's gradient of every trainable tensor, GLOBAL
and PRIVATE alike (both are fitted to the client's records, and the personalized model is what
the site serves); Opacus' DPOptimizer clips each to L2 norm C (all tensors as one vector), sums
them, adds N(0, (z·C)²) per coordinate and divides by the batch size. Parameter-only loss terms
(PFAdapter's orthogonality) read no data: their gradient is added after the noise, at no privacy
cost. Each client's ε comes from Opacus' accountant over its own steps (sample rate
batch_size / its examples), counted in its state across rounds.

What Opacus cannot clip per example is refused at build time with one line (`check`): a method's
own objective or gradient rule, a class side that trains (its tensors see every class at
once), and trainable tensors in modules Opacus has no per-example rule for (CoOp prompts, ...).
A switch that couples a batch's examples refuses DP-SGD in its own check (the gradient balancer's).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from fedsplice.config.privacy import OWN_RULE, OWN_STAGE, refuse_under_dpsgd
from fedsplice.core import privacy as dp
from fedsplice.core.streams import PRIVACY
from fedsplice.errors import ConfigError
from fedsplice.federation.privacy import epsilon, noise_for
from fedsplice.federation.train import DPStep, planned_steps

if TYPE_CHECKING:
    from opacus.optimizers import DPOptimizer

    from fedsplice.algorithms import Recipe
    from fedsplice.config import ExperimentConfig
    from fedsplice.core.server import Params
    from fedsplice.data.partition import Client
    from fedsplice.model.taskmodel import TaskModel

WHERE = "privacy.local = 'dpsgd'"
LOCAL = 1  # the stream key of DP-SGD's noise beside the client-level noise's (seeded noise only)


def _samplers() -> dict[type[torch.nn.Module], object]:
    from opacus.grad_sample import GradSampleModule  # heavy: only when DP-SGD is on

    return cast("dict[type[torch.nn.Module], object]", GradSampleModule.GRAD_SAMPLERS)  # opacus: untyped


def check(cfg: ExperimentConfig, recipe: Recipe, model: TaskModel) -> None:
    """Refuse, in one line each, what per-example clipping cannot bound."""
    if cfg.privacy.local != "dpsgd":
        return
    off = "set privacy.local = 'off'"
    if recipe.objective is not None or recipe.grad_transform is not None:
        refuse_under_dpsgd(cfg.privacy, cfg.algorithm, OWN_RULE)
    stage = recipe.personalize
    if stage is not None and (stage.fit is not None or stage.after is not None):
        refuse_under_dpsgd(cfg.privacy, cfg.algorithm, OWN_STAGE)
    if getattr(model, "class_side_trains", False):
        raise ConfigError(f"{WHERE}: peft.type = {cfg.peft.type!r} trains the class side, whose tensors see "
                          f"every class at once rather than one example; train only the input side (CLIP: "
                          f"peft.type = 'lora' with peft.tower = 'vision_model') or {off}")
    if getattr(model, "amp_dtype", torch.float32) != torch.float32:
        raise ConfigError(f"{WHERE} clips per-example gradients in fp32: set runtime.precision = 'fp32' "
                          f"(it resolved to {str(model.amp_dtype).removeprefix('torch.')})")
    samplers, groups = _samplers(), trained_groups(recipe)
    for mname, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if groups is not None and recipe.split.get(name) not in groups:
                continue  # never trained locally (FLoRA's merged dense ΔW)
            if p.requires_grad and (type(mod) not in samplers or pname not in ("weight", "bias")):
                raise ConfigError(f"{WHERE}: Opacus has no per-example gradient rule for {mname}.{pname} (in a "
                                  f"{type(mod).__name__}; peft.type = {cfg.peft.type!r}): use peft.type = "
                                  f"'lora', 'adapter' or 'head', or {off}")


def trained_groups(recipe: Recipe) -> set[str] | None:
    """The split groups a method's local phases train (None: every trainable tensor trains);
    phases that change with the round are read at rounds 1 and 2 (FedDPA's first and later)."""
    phases = recipe.phases
    if not phases:
        return None
    return {ph[0] for r in (1, 2) for ph in (phases(r) if callable(phases) else phases)}


class PerExample(Protocol):
    """A parameter under Opacus' hooks: its per-example gradients, stacked."""

    grad_sample: torch.Tensor


@dataclass
class LocalDP:
    """One client's DP-SGD over one stage (its round, or a cold start): the noise multiplier, its
    noise stream, and the steps it has taken in all (`steps`, carried in its state)."""

    noise_multiplier: float
    clip: float
    sample_rate: float
    delta: float
    accountant: str
    gen_seed: list[int] | None  # None: the OS's entropy
    steps: int = 0

    def state(self) -> dict[str, torch.Tensor]:
        """The client's `dp` slot (federation.state): its steps so far."""
        return {"steps": torch.tensor(self.steps, dtype=torch.int64)}

    def epsilon(self) -> float:
        return epsilon(self.noise_multiplier, self.sample_rate, self.steps, self.delta, self.accountant)

    @contextmanager
    def attached(self, model: TaskModel, opt: torch.optim.Optimizer, batch_size: int) -> Iterator[DPStep]:
        """Opacus on `model` and `opt` for one call of the training loop: yields `step`."""
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        dev = next(iter(opt.param_groups[0]["params"])).device
        gen = dp.generator(self.gen_seed and [*self.gen_seed, self.steps], device=dev)
        with model.per_sample() if hasattr(model, "per_sample") else _nothing():
            gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=False)
            dpo = DPOptimizer(opt, noise_multiplier=self.noise_multiplier, max_grad_norm=self.clip,
                              expected_batch_size=batch_size, generator=gen)
            try:
                yield lambda task, reg, plist, size: self._step(dpo, task, reg, plist, size)
            finally:
                dpo.zero_grad(set_to_none=True)
                gsm.to_standard_module()  # removes its hooks and per-example buffers: the model is plain again

    def _step(self, dpo: DPOptimizer, task: torch.Tensor, reg: torch.Tensor | float, plist: list[torch.nn.Parameter],
              size: int) -> None:
        """One DP-SGD step on a batch of `size` examples: the data loss's per-example gradients
        privatized (their clipped sum plus noise, divided by `size`: batches are fixed slices of
        a shuffled epoch, so a short last batch is a mean over its own examples, as without DP),
        then the parameter-only terms' plain gradient added (they read no data), then the update."""
        dpo.zero_grad(set_to_none=True)
        dpo.expected_batch_size = size
        with warnings.catch_warnings():  # the first trainable layer's input needs no gradient: expected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            task.backward()  # type: ignore[no-untyped-call]  # torch: Tensor.backward is unannotated
        rows = {cast(PerExample, p).grad_sample.shape[0] for p in plist
                if torch.is_tensor(getattr(p, "grad_sample", None))}
        if rows != {size}:  # a forward that mixes examples (B·C rows, a shared pass): no per-example bound
            raise ConfigError(f"{WHERE}: this model's forward gave per-example gradients over {sorted(rows)} rows "
                              f"for a batch of {size} examples, so no example's influence is bounded; set "
                              f"privacy.local = 'off' for this model or task")
        dpo.pre_step()
        if torch.is_tensor(reg) and reg.requires_grad:
            for p, g in zip(plist, torch.autograd.grad(reg, plist, allow_unused=True)):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        dpo.original_optimizer.step()
        self.steps += 1


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


class ClientsOf(Protocol):
    """What `session` reads of an Experiment (federation.experiment imports this module)."""

    cfg: ExperimentConfig
    clients: list[Client]


def session(exp: ClientsOf, cid: int, key: int, slot: Params | None = None) -> LocalDP | None:
    """Client `cid`'s DP-SGD for one stage (None: privacy.local is off); `key` keys its seeded
    noise stream; `slot` is its stored `dp` state (the steps it took before: its accountant's
    history)."""
    p, c = exp.cfg.privacy, exp.cfg.client
    if p.local != "dpsgd":
        return None
    n = len(exp.clients[cid].train_idx)
    q = min(1.0, c.batch_size / max(n, 1))
    z = p.local_noise_multiplier or noise_for(p.local_target_epsilon, p.delta, q,
                                              exp.cfg.server.rounds * planned_steps(n, c, None), p.accountant)
    seed = [exp.cfg.seed, PRIVACY, LOCAL, cid, key] if p.noise == "seeded" else None
    return LocalDP(z, p.local_clip, q, p.delta, p.accountant, seed, int(slot["steps"]) if slot else 0)


def summary(cfg: ExperimentConfig, records: list[dict[str, Any]]) -> dict[str, str | float | None]:
    """results.json's "privacy_local": the setting and the largest ε any client spent."""
    p = cfg.privacy
    eps = [r["dp_local_epsilon"] for r in records if "dp_local_epsilon" in r]
    return {"mechanism": "dpsgd", "clip": p.local_clip, "noise_multiplier": p.local_noise_multiplier or None,
            "target_epsilon": p.local_target_epsilon or None, "delta": p.delta, "accountant": p.accountant,
            "epsilon_max": max(eps) if eps else 0.0, "noise": p.noise}
