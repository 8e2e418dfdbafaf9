"""A round's clients trained together through one base model (issue 50, runtime.batch_train).

Every step, each client still training contributes its next batch (drawn from its own data-order
stream, as `train.local_train` draws it); the union runs as ONE forward and ONE backward over the
frozen base, each row through its own client's LoRA factors (`model.grouped`: the factors of the
step's clients stacked from their own tensors, so each gradient lands on its owner's tensors).
Each client's loss is its task loss over its own rows plus its loss terms on its own tensors; the
sum of the clients' losses is differentiated once, and each client's own optimizer steps (with
its own gradient clipping) on its own tensors only. A client whose local steps are done drops out
of the batch; the loss terms' diagnostics come from the joint graph (`diagnose`). The math per
client is the sequential loop's: tests/test_batched_train.py shows equal tensors, statistics and
metrics within rounding.

What may batch is decided by the plan (`batching.train_refusal`): LoRA factors, or a dual
encoder's CoOp context alone (whose clients' class sides then run as one forward instead:
`_logits`), are the only trainable tensors, and the step is the default one (no objective,
gradient transform, phases or DP-SGD of the method's own, no LoRA dropout, whose masks follow
each client's own stream).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
import torch

from fedsplice.core import streams
from fedsplice.core.context import TrainContext
from fedsplice.federation.batched import CHUNK as EVAL_CHUNK
from fedsplice.federation.batching import PROMPT_CTX
from fedsplice.federation.fitting import fit_end, fit_start
from fedsplice.federation.train import (
    Sums,
    accumulate,
    add_terms,
    export_opt_state,
    import_opt_state,
    make_optimizer,
    means,
    optimizer_step,
    planned_steps,
    ratios,
    side_norms,
)
from fedsplice.model.grouped import Owned, grouped, lora_modules, stacked

if TYPE_CHECKING:
    from fedsplice.core.server import Params
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.fitting import Fitting
    from fedsplice.federation.store import Store
    from fedsplice.model.taskmodel import TaskModel


@dataclass
class Trainee:
    """One client's side of the joint loop: its tensors, optimizer, batches and statistics."""

    f: Fitting
    ctx: TrainContext  # the client's, on the model's device
    params: dict[str, torch.nn.Parameter]  # its own, on the model's device, trained in place
    opt: torch.optim.Optimizer
    texts: list[str]
    labels: torch.Tensor
    batches: list[np.ndarray]  # the positions of each step's batch, in the sequential loop's order
    sums: Sums = field(default_factory=dict)
    diag: dict[str, float] = field(default_factory=dict)


# Clients trained in one joint pass: a step's activations (kept for the backward) grow with every
# client in it, so a round of many clients trains CHUNK at a time, as many as evaluation scores a pass.
CHUNK = EVAL_CHUNK


def fit_together(exp: Experiment, store: Store, cids: list[int], rnd: int, down: bytes,
                 done: Callable[[], None] | None = None) -> list[tuple[bytes, dict[str, float]]]:
    """fitting.fit of every client in `cids`, their training done together CHUNK clients at a
    time (one upload each, in order); `done()` as each client's last step ends (a progress tick)."""
    out = []
    for i in range(0, len(cids), CHUNK):
        fits = [fit_start(exp, store, c, rnd, down) for c in cids[i:i + CHUNK]]
        trained = train_together(exp, fits, done)
        out += [fit_end(exp, store, f, params, opt, stats) for f, (params, opt, stats) in zip(fits, trained)]
    return out


def _trainee(exp: Experiment, f: Fitting, names: list[str], dev: torch.device) -> Trainee:
    c, d, cfg = exp.clients[f.cid], exp.data, f.client_cfg
    params = {n: torch.nn.Parameter(f.start[n].detach().to(dev, torch.float32, copy=True)) for n in names}
    opt = make_optimizer([params[n] for n in names], cfg)
    import_opt_state(opt, params, f.opt_state)
    rng = streams.rng(exp.cfg, streams.CLIENT, f.rnd, f.cid)  # the client's data order, as train_client's
    n, bs = len(c.train_idx), cfg.batch_size
    batches = [order[i:i + bs] for order in (rng.permutation(n) for _ in range(cfg.local_epochs))
               for i in range(0, n, bs)][:planned_steps(n, cfg, None)]
    return Trainee(f, f.ctx.to(dev), params, opt, [d.train_texts[i] for i in c.train_idx],
                   torch.as_tensor(d.train_labels[c.train_idx], dtype=torch.long).to(dev), batches)


class Losses(NamedTuple):
    """One client's losses of a joint step (train.local_train's names)."""

    losses: dict[str, torch.Tensor]  # "task" (with the loss terms added) and each other loss
    task: torch.Tensor  # the task loss alone
    weighted: dict[str, tuple[torch.Tensor, float]]  # on its last step: {term: (value, weight)}


def _losses(exp: Experiment, ts: list[Trainee], step: int) -> list[Losses]:
    """One forward over the union of the clients' batches of `step`: each client's losses (its
    task loss on its rows, plus its loss terms, whose values go to its statistics), its task loss
    alone, and on its last step its weighted terms (for the diagnostics)."""
    model, rec = exp.model, exp.recipe
    amp = getattr(model, "autocast", nullcontext)  # runtime.precision, as the sequential loop's
    with amp():
        out = []
        for t, rows in zip(ts, _logits(model, ts, step)):
            idx = t.batches[step]
            out.append({"task": t.ctx.task_loss(rows, t.labels[torch.from_numpy(idx).to(t.labels.device)])})
    got = []
    for t, losses in zip(ts, out):  # parameter-only terms in fp32, as the sequential loop adds them
        task = losses["task"]
        last = t.f.client_cfg.diagnostics and step == len(t.batches) - 1
        weighted, _ = add_terms(losses, list(rec.loss_terms), t.params, t.ctx, t.sums, last)
        got.append(Losses(losses, task, weighted))
    return got


def _logits(model: torch.nn.Module, ts: list[Trainee], step: int) -> list[torch.Tensor]:
    """Each client's logits on its batch of `step`. LoRA: one forward over the union, each row
    through its owner's factors. A CoOp context: every client's class side in one forward of the
    text encoder (TaskModel.encode_prompts), its (frozen, cached) input features scored against it."""
    if PROMPT_CTX in ts[0].params:
        ces = cast("TaskModel", model).encode_prompts([t.params[PROMPT_CTX] for t in ts])
        return [model([t.texts[i] for i in t.batches[step]], ce) for t, ce in zip(ts, ces)]
    texts = [Owned(t.texts[i], k) for k, t in enumerate(ts) for i in t.batches[step]]
    with grouped(model, stacked(lora_modules(ts[0].params), [t.params for t in ts])):
        logits = model(texts)
    return list(logits.split([len(t.batches[step]) for t in ts]))


def diagnose(ts: list[Trainee], got: list[Losses]) -> None:
    """term_diagnostics of the clients on their last step, from the joint graph: a client's
    tensors reach only its own losses, so one gradient of the sum over them gives each client
    its own gradient (one backward for the task, one per term, as the sequential loop takes)."""
    which = [(t, g) for t, g in zip(ts, got) if g.weighted]
    if not which:
        return
    names = sorted(which[0][0].params)
    flat = [t.params[n] for t, _ in which for n in names]

    def norms(loss: torch.Tensor) -> list[dict[str, float]]:
        gs = torch.autograd.grad(loss, flat, retain_graph=True, allow_unused=True)
        return [side_norms(gs[i * len(names):(i + 1) * len(names)], names, t.ctx.split)
                for i, (t, _) in enumerate(which)]

    base = norms(torch.stack([g.task for _, g in which]).sum())
    per_term = {k: norms(torch.stack([g.weighted[k][0] for _, g in which]).sum()) for k in which[0][1].weighted}
    for i, (t, g) in enumerate(which):
        t.diag = ratios(base[i], {k: (per_term[k][i], v, w) for k, (v, w) in g.weighted.items()})


def train_together(exp: Experiment, fits: list[Fitting],
                   done: Callable[[], None] | None = None) -> list[tuple[Params, Params, dict[str, float]]]:
    """train.local_train of each client in `fits`, from its `start` tensors, all at once:
    (its trained tensors on the CPU, its kept optimizer state, its statistics) each; `done()` as
    each client's last step ends."""
    model = exp.model
    names = sorted(model.trainable())
    dev = getattr(model, "device", torch.device("cpu"))
    ts = [_trainee(exp, f, names, dev) for f in fits]
    # no step draws from torch's stream (LoRA dropout is off): it ends as the last client's seed leaves it
    streams.seed_torch(exp.cfg, fits[-1].rnd, fits[-1].cid)
    model.train()
    for step in range(max(len(t.batches) for t in ts)):
        live = [t for t in ts if step < len(t.batches)]
        got = _losses(exp, live, step)
        diagnose(live, got)  # the clients on their last step
        totals = [sum(g.losses.values()) for g in got]
        for t in live:
            t.opt.zero_grad(set_to_none=True)
        torch.autograd.backward(torch.stack([torch.as_tensor(x) for x in totals]).sum())
        for t, g, total in zip(live, got, totals):
            optimizer_step(t.opt, None, t.f.client_cfg.max_grad_norm)
            accumulate(t.sums, "loss", total)
            for k, v in g.losses.items():
                accumulate(t.sums, f"{k}_loss", v)
            if done is not None and step == len(t.batches) - 1:
                done()
    out = []
    for t in ts:
        keep = set(t.f.keep)
        opt = export_opt_state(t.opt, {p: n for n, p in t.params.items()}, keep)
        steps = len(t.batches)
        params = {n: p.detach().to("cpu", copy=True) for n, p in t.params.items()}
        out.append((params, opt, {"steps": steps, **means(t.sums, steps), **t.diag}))
    return out
