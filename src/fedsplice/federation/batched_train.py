"""A round's clients trained together through one base model (issue 50, runtime.batch_train).

Every step, each client still training contributes its next batch (drawn from its own data-order
stream, as `train.local_train` draws it); the union runs as ONE forward and ONE backward over the
frozen base, each row through its own client's LoRA factors (`model.grouped`: the factors of the
step's clients stacked from their own tensors, so each gradient lands on its owner's tensors).
Each client's loss is its task loss over its own rows plus its loss terms on its own tensors; the
sum of the clients' losses is differentiated once, and each client's own optimizer steps (with
its own gradient clipping) on its own tensors only. A client whose local steps are done drops out
of the batch. The math per client is the sequential loop's: tests/test_batched_train.py shows
equal tensors and metrics within rounding.

What may batch is decided by the plan (`plan.train_refusal`): LoRA factors are the only
trainable tensors, and the step is the default one (no objective, gradient transform, phases or
DP-SGD of the method's own, no LoRA dropout, whose masks follow each client's own stream).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedsplice.core import streams
from fedsplice.core.context import TrainContext
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
    term_diagnostics,
)
from fedsplice.model.grouped import Owned, grouped

if TYPE_CHECKING:
    from fedsplice.core.server import Params
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.fitting import Fitting
    from fedsplice.federation.store import Store


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


def fit_together(exp: Experiment, store: Store, cids: list[int], rnd: int,
                 down: bytes) -> list[tuple[bytes, dict[str, float]]]:
    """fitting.fit of every client in `cids`, their training done together (one upload each, in order)."""
    fits = [fit_start(exp, store, c, rnd, down) for c in cids]
    trained = train_together(exp, fits)
    return [fit_end(exp, store, f, params, opt, stats) for f, (params, opt, stats) in zip(fits, trained)]


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


def _factors(ts: list[Trainee], mods: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {m: (torch.stack([t.params[f"{m}.lora_A.default.weight"] for t in ts]),
                torch.stack([t.params[f"{m}.lora_B.default.weight"] for t in ts])) for m in mods}


def _losses(exp: Experiment, ts: list[Trainee], step: int, last: bool,
            mods: list[str]) -> list[tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, float]]]]:
    """One forward over the union of the clients' batches of `step`: each client's losses (its
    task loss on its rows, plus its loss terms, whose values go to its statistics), or with
    `last` (a client's last step, alone: term_diagnostics) its weighted terms, no statistics."""
    model, rec = exp.model, exp.recipe
    texts = [Owned(t.texts[i], k) for k, t in enumerate(ts) for i in t.batches[step]]
    amp = getattr(model, "autocast", nullcontext)  # runtime.precision, as the sequential loop's
    with amp(), grouped(model, _factors(ts, mods)):
        logits = model(texts)
        out, start = [], 0
        for t in ts:
            idx = t.batches[step]
            rows = logits[start:start + len(idx)]
            start += len(idx)
            out.append({"task": t.ctx.task_loss(rows, t.labels[torch.from_numpy(idx).to(t.labels.device)])})
    got = []
    for t, losses in zip(ts, out):  # parameter-only terms in fp32, as the sequential loop adds them
        weighted, _ = add_terms(losses, list(rec.loss_terms), t.params, t.ctx, t.sums if not last else {}, last)
        got.append((losses, weighted))
    return got


def train_together(exp: Experiment, fits: list[Fitting]) -> list[tuple[Params, Params, dict[str, float]]]:
    """train.local_train of each client in `fits`, from its `start` tensors, all at once:
    (its trained tensors on the CPU, its kept optimizer state, its statistics) each."""
    model = exp.model
    names = sorted(model.trainable())
    mods = sorted({n.rsplit(".lora_", 1)[0] for n in names})
    dev = getattr(model, "device", torch.device("cpu"))
    ts = [_trainee(exp, f, names, dev) for f in fits]
    # no step draws from torch's stream (LoRA dropout is off): it ends as the last client's seed leaves it
    streams.seed_torch(exp.cfg, fits[-1].rnd, fits[-1].cid)
    model.train()
    for step in range(max(len(t.batches) for t in ts)):
        live = [t for t in ts if step < len(t.batches)]
        got = _losses(exp, live, step, False, mods)
        for t in live:
            # on its last step: the terms' diagnostics, measured on its batch alone (same math)
            if t.f.client_cfg.diagnostics and step == len(t.batches) - 1:
                alone, weighted = _losses(exp, [t], step, True, mods)[0]
                if weighted:
                    plist = [t.params[n] for n in names]
                    t.diag = term_diagnostics(alone["task"], weighted, plist, names, t.ctx.split)
        totals = [sum(losses.values()) for losses, _ in got]
        for t in live:
            t.opt.zero_grad(set_to_none=True)
        torch.autograd.backward(torch.stack([torch.as_tensor(x) for x in totals]).sum())
        for t, (losses, _), total in zip(live, got, totals):
            optimizer_step(t.opt, None, t.f.client_cfg.max_grad_norm)
            accumulate(t.sums, "loss", total)
            for k, v in losses.items():
                accumulate(t.sums, f"{k}_loss", v)
    out = []
    for t in ts:
        keep = set(t.f.keep)
        opt = export_opt_state(t.opt, {p: n for n, p in t.params.items()}, keep)
        steps = len(t.batches)
        params = {n: p.detach().to("cpu", copy=True) for n, p in t.params.items()}
        out.append((params, opt, {"steps": steps, **means(t.sums, steps), **t.diag}))
    return out
