"""The one local training loop. Algorithms change it only through loss terms and grad transforms."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import torch

from fedsplice.config import ClientConfig
from fedsplice.core.context import TrainContext
from fedsplice.model.device import grad_scaler

if TYPE_CHECKING:
    from fedsplice.algorithms import Recipe
    from fedsplice.algorithms.hooks import GradTransform, LossTerm, Objective
    from fedsplice.core.server import Params
    from fedsplice.model.taskmodel import TaskModel

Sums = dict[str, list[torch.Tensor | float]]  # a round's per-step statistics, by name (`accumulate`)
# one DP-SGD step (federation.dpsgd): (the data loss, the parameter-only terms, the tensors, the batch size)
DPStep = Callable[[torch.Tensor, torch.Tensor | float, list[torch.nn.Parameter], int], None]


class PrivateSteps(Protocol):
    """DP-SGD on the loop's steps: a federation.dpsgd.LocalDP (which imports this module)."""

    def attached(self, model: TaskModel, opt: torch.optim.Optimizer, batch_size: int
                 ) -> AbstractContextManager[DPStep]: ...


class WeightedTerm(Protocol):
    """A loss term with a weight (PFAdapter's λo, HetLoRA's λ): `term_diagnostics` measures it."""

    weight: float


def make_optimizer(params: list[torch.nn.Parameter], cfg: ClientConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def export_opt_state(opt: torch.optim.Optimizer, names_by_param: dict[torch.Tensor, str],
                     keep: set[str]) -> dict[str, torch.Tensor]:
    """Optimizer state of the `keep` parameters, as name-keyed CPU tensors ("<param>/<slot>")."""
    out = {}
    for p, st in opt.state.items():
        name = names_by_param[p]
        if name in keep:
            for slot, v in st.items():
                if torch.is_tensor(v):
                    out[f"{name}/{slot}"] = v.detach().to("cpu", copy=True)
    return out


def import_opt_state(opt: torch.optim.Optimizer, params: dict[str, torch.nn.Parameter],
                     state: Mapping[str, torch.Tensor]) -> None:
    for key, v in state.items():
        name, slot = key.rsplit("/", 1)
        p = params[name]
        # Adam's step counter stays where torch keeps it (CPU); moments go beside their tensor
        opt.state[p][slot] = v.clone() if slot == "step" else v.to(p.device, copy=True)


def cross_entropy_objective(model: torch.nn.Module, texts: list[str], y: torch.Tensor, ids: np.ndarray,
                            ctx: TrainContext) -> dict[str, torch.Tensor]:
    """The plain task loss: ctx.task_loss (cross-entropy, wrapped by the config's switches) of the logits."""
    return {"task": ctx.task_loss(model(texts), y)}


def response_objective(model: torch.nn.Module, texts: list[str], y: torch.Tensor, ids: np.ndarray,
                       ctx: TrainContext) -> dict[str, torch.Tensor]:
    """model.task = "generate": the mean -log p of the batch's response tokens (prompts masked)."""
    return {"task": cast("TaskModel", model).response_loss(texts)}


def default_objective(model: torch.nn.Module) -> Objective:
    """The task's own loss: cross-entropy over classes, or the response loss of free-text answers."""
    return response_objective if getattr(model, "task", None) == "generate" else cross_entropy_objective


def backward(losses: dict[str, torch.Tensor], total: torch.Tensor, plist: list[torch.nn.Parameter],
             grad_transform: GradTransform | None, sums: Sums, scaler: torch.amp.GradScaler | None = None) -> None:
    """Set every parameter's .grad: of the summed losses, or, with a grad transform, the
    transform's combination of each loss's own gradient (adding its statistics to `sums`).
    `scaler` (fp16's GradScaler) scales the losses; a transform sees the true gradients (divided
    back, exactly: the scale is a power of two) and its result is scaled again for scaler.step."""
    up = scaler.scale if scaler is not None else (lambda x: x)
    if grad_transform is None:
        up(total).backward()
        return
    s = scaler.get_scale() if scaler is not None else 1.0
    last = len(losses) - 1  # the graph is kept for the next loss only: the last grad frees it
    grads = {k: [g / s if g is not None else torch.zeros_like(p) for g, p in zip(
        torch.autograd.grad(up(v), plist, retain_graph=i < last, allow_unused=True), plist)]
        for i, (k, v) in enumerate(losses.items())}
    final, tstats = grad_transform(grads)
    for p, g in zip(plist, final):
        p.grad = g * s if s != 1.0 else g
    for k, v in tstats.items():
        accumulate(sums, k, v)


def accumulate(sums: Sums, key: str, v: torch.Tensor | float) -> None:
    """Add a step's statistic (a 0-d tensor or a float) to the round's running sums: tensors stay
    on the device, so the loop does not wait for it every step; `means` reads them once a round."""
    sums.setdefault(key, []).append(v.detach() if torch.is_tensor(v) else float(v))


def means(sums: Sums, steps: int) -> dict[str, float]:
    """{key: mean over the round's steps} of the running sums, summed in float64."""
    out = {}
    for k, vs in sums.items():
        ts = [v for v in vs if torch.is_tensor(v)]
        t = float(torch.stack([v.double() for v in ts]).sum()) if ts else 0.0  # the one read of a key
        out[k] = (t + sum(v for v in vs if not torch.is_tensor(v))) / max(steps, 1)
    return out


def planned_steps(n: int, cfg: ClientConfig, epochs: int | None) -> int:
    per_epoch = -(-n // cfg.batch_size)
    total = (epochs or cfg.local_epochs) * per_epoch
    return min(total, cfg.max_steps) if cfg.max_steps else total


def side_norms(grads: Sequence[torch.Tensor | None], names: list[str], split: Mapping[str, str]) -> dict[str, float]:
    """The L2 norm of a gradient over the GLOBAL and over the PRIVATE tensors (`names`' order)."""
    sq: dict[str, list[torch.Tensor]] = {"global": [], "private": []}
    for n, g in zip(names, grads):
        if g is not None:
            sq["private" if split.get(n) == "private" else "global"].append((g.detach() ** 2).sum())
    return {k: float(torch.stack(v).double().sum()) ** 0.5 if v else 0.0 for k, v in sq.items()}


def ratios(base: dict[str, float], terms: dict[str, tuple[dict[str, float], torch.Tensor, float]]) -> dict[str, float]:
    """term_diagnostics' statistics from the task's side norms and each term's (norms, value, weight)."""
    out = dict[str, float]()
    for key, (t, v, weight) in terms.items():
        out[f"{key}_raw"] = float(v.detach()) / weight
        for side in ("global", "private"):
            if base[side] > 0:  # a side without tensors (or without a task gradient) has no ratio
                out[f"{key}_grad_ratio_{side}"] = t[side] / base[side]
    return out


def term_diagnostics(task: torch.Tensor, terms: dict[str, tuple[torch.Tensor, float]], plist: list[torch.nn.Parameter],
                     names: list[str], split: dict[str, str]) -> dict[str, float]:
    """Per loss term, ‖∇term‖ / ‖∇task‖ on the GLOBAL and on the PRIVATE tensors (PFAdapter's
    question: does λo·Lo move anything next to the task loss?), and the unweighted term value."""
    def norms(loss: torch.Tensor) -> dict[str, float]:
        return side_norms(torch.autograd.grad(loss, plist, retain_graph=True, allow_unused=True), names, split)

    return ratios(norms(task), {k: (norms(v), v, w) for k, (v, w) in terms.items()})


def optimizer_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, max_grad_norm: float = 0.0) -> None:
    """opt.step(); with fp16's GradScaler: unscale, skip a step whose gradients overflowed, and
    adapt the scale. `max_grad_norm` > 0 first clips the gradient of all the optimizer's tensors
    together to that L2 norm, on the unscaled gradient (as Hugging Face's Trainer does)."""
    if max_grad_norm > 0:
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], max_grad_norm)
    if scaler is None:
        opt.step()
        return
    scaler.step(opt)
    scaler.update()


def add_terms(losses: dict[str, torch.Tensor], loss_terms: Sequence[LossTerm], params: Mapping[str, torch.Tensor],
              ctx: TrainContext, sums: Sums,
              last: bool) -> tuple[dict[str, tuple[torch.Tensor, float]], torch.Tensor | float]:
    """Add the parameter-only loss terms to losses["task"] (their values to `sums`); return, on
    the round's `last` step, {name: (term, weight)} of the weighted ones, for term_diagnostics;
    and the terms' sum (0.0 without terms: DP-SGD adds its gradient after the noise)."""
    weighted: dict[str, tuple[torch.Tensor, float]] = {}
    reg: torch.Tensor | float = 0.0
    for term in loss_terms:
        v = term(params, ctx)
        key = type(term).__name__.lower()
        accumulate(sums, key, v)
        if last and getattr(term, "weight", 0) > 0 and v.requires_grad:
            weighted[key] = (v, cast(WeightedTerm, term).weight)
        losses["task"] = losses["task"] + v
        reg = reg + v
    return weighted, reg


@dataclass(frozen=True)
class Step:
    """What one local step optimizes (a recipe's training parts).

    `objective(model, texts, y, ids, ctx) -> {name: loss}` gives the losses of one forward
    (None: cross-entropy as "task"); parameter-only `loss_terms` are added to "task". Without a
    `grad_transform` the step follows the gradient of the sum of all losses; with one, the
    gradient of each loss is taken separately and the transform combines them
    (`grad_transform(grads: {loss: [tensor per param]}) -> ([tensor per param], stats)`), as
    FedPuReL's purification does."""

    objective: Objective | None = None
    loss_terms: tuple[LossTerm, ...] = ()
    grad_transform: GradTransform | None = None

    @classmethod
    def of(cls, recipe: Recipe) -> Step:
        return cls(recipe.objective, tuple(recipe.loss_terms), recipe.grad_transform)


PLAIN = Step()  # cross-entropy, no loss terms, the plain gradient


def local_train(model: TaskModel, texts: list[str], labels: np.ndarray, *, cfg: ClientConfig, step: Step = PLAIN,
                keep_opt: set[str], opt_state: Mapping[str, torch.Tensor], rng: np.random.Generator, ctx: TrainContext,
                ids: np.ndarray | None = None, epochs: int | None = None,
                private: PrivateSteps | None = None) -> tuple[Params, dict[str, float]]:
    """Train the model's trainable tensors in place on one client's data, one `Step` at a time.

    Returns the optimizer state of the `keep_opt` names (PRIVATE tensors: their Adam moments
    persist across rounds; GLOBAL tensors start each round fresh, as they are replaced by the
    server's) and training statistics (means over steps). `private` (a federation.dpsgd.LocalDP)
    makes every step DP-SGD.
    """
    objective = step.objective or default_objective(model)
    params = model.trainable()
    names = sorted(params)
    plist = [params[n] for n in names]
    opt = make_optimizer(plist, cfg)
    import_opt_state(opt, params, opt_state)
    dev = getattr(model, "device", torch.device("cpu"))  # a TaskModel's; plain modules: CPU, fp32
    amp = getattr(model, "autocast", nullcontext)
    scaler = grad_scaler(dev, getattr(model, "amp_dtype", torch.float32))
    ctx = ctx.to(dev)
    y_all = torch.as_tensor(labels, dtype=torch.long).to(dev)
    ids = np.arange(len(texts)) if ids is None else np.asarray(ids)
    sums: Sums = {}
    steps, diag = 0, dict[str, float]()
    # -1: no step is measured (nor under DP-SGD, whose hooks would take the extra gradients as a step's)
    last = planned_steps(len(texts), cfg, epochs) - 1 if cfg.diagnostics and not private else -1
    model.train()
    with private.attached(model, opt, min(cfg.batch_size, len(texts))) if private else nullcontext() as dp_step:
        for _ in range(epochs or cfg.local_epochs):
            order = rng.permutation(len(texts))
            order_dev = torch.from_numpy(order).to(dev)  # the labels are picked on the device, one copy an epoch
            for i in range(0, len(order), cfg.batch_size):
                idx, y = order[i:i + cfg.batch_size], y_all[order_dev[i:i + cfg.batch_size]]
                with amp():  # runtime.precision: the forward and its losses under autocast
                    losses = objective(model, [texts[j] for j in idx], y, ids[idx], ctx)
                # parameter-only terms in fp32 (PFAdapter's orthogonality products are ~1e-9 early on)
                task, (weighted, reg) = losses["task"], add_terms(losses, step.loss_terms, params, ctx, sums,
                                                                  steps == last)
                total = cast(torch.Tensor, sum(losses.values()))  # "task" at least: a tensor
                if weighted:  # measured once a round, on its last step (where the terms have grown most)
                    diag = term_diagnostics(task, weighted, plist, names, ctx.split)
                if dp_step is not None:  # DP-SGD (federation.dpsgd): per-example clipping and noise
                    dp_step(task, reg, plist, len(idx))
                else:
                    opt.zero_grad(set_to_none=True)
                    backward(losses, total, plist, step.grad_transform, sums, scaler)
                    optimizer_step(opt, scaler, cfg.max_grad_norm)
                steps += 1
                accumulate(sums, "loss", total)
                for k, v in losses.items():
                    accumulate(sums, f"{k}_loss", v)
                if cfg.max_steps and steps >= cfg.max_steps:
                    break
            if cfg.max_steps and steps >= cfg.max_steps:
                break
    stats = {"steps": steps, **means(sums, steps), **diag}
    return export_opt_state(opt, {params[n]: n for n in names}, keep_opt), stats
