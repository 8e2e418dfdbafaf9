"""Client tasks: every client-side stage, run where the client's data and PRIVATE state are.

A runtime moves a task's name, the client ids and the serialized GLOBAL tensors to whoever
holds those clients (this process in simulation, a SuperNode on Flower) and calls `run_task`
there; nothing of a client's data or PRIVATE tensors ever comes back, only what the task
returns. The tasks:

- `fit`          one round of local training; returns the GLOBAL upload (and keeps PRIVATE state)
- `evaluate`     the personalized model (GLOBAL + the client's PRIVATE) on its local test set
- `personalize`  the recipe's local stage after the rounds (FedPuReL phase 2)
- `cold_start`   a held-out client adapts the final GLOBAL tensors for 1..N local epochs

All training goes through `train_client`: load params -> seed -> the one training loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from fedsplice.core import wire
from fedsplice.core import streams
from fedsplice.federation.evaluation import score
from fedsplice.federation.metrics import classification_metrics
from fedsplice.federation.train import local_train

TASKS = ("evaluate", "personalize", "cold_start")  # the tasks `run_task` serves (fit has its own reply)


def split_state(exp, st: dict | None) -> tuple[dict, dict]:
    """(PRIVATE tensors, their optimizer state) from a client's stored state (None: fresh)."""
    if st is None:
        return {n: exp.init_params[n].clone() for n in exp.private_names}, {}
    params = {k[len("param/"):]: v for k, v in st.items() if k.startswith("param/")}
    opt = {k[len("opt/"):]: v for k, v in st.items() if k.startswith("opt/")}
    return params, opt


def train_context(exp, cid: int, received: dict, **extra) -> dict:
    """What the objective and loss terms may read: the weights received this round (FedProx),
    the client's logit-adjustment offset, and the frozen caches (zero-shot logits)."""
    ctx = {"global_ref": received, "client": cid, **exp.caches, **extra}
    tau = exp.cfg.client.logit_adjustment
    if tau > 0:  # Menon et al.: tau * log(local class prior), from the client's own labels
        counts = np.bincount(exp.data.train_labels[exp.clients[cid].train_idx], minlength=len(exp.data.class_names))
        ctx["logit_offset"] = tau * torch.log(torch.as_tensor((counts + 1e-3) / counts.sum(), dtype=torch.float32))
    return ctx


def train_client(exp, cid: int, *, rnd: int, torch_round: int, ctx: dict, objective=None, loss_terms=(),
                 grad_transform=None, keep_opt=frozenset(), opt_state=None, client_cfg=None,
                 epochs: int | None = None) -> tuple[dict, dict]:
    """The one client driver: seed, then the one training loop on client `cid`'s training data,
    from the parameters already loaded into the model. `rnd` keys the client's data-order stream,
    `torch_round` its dropout seed (both from `streams`)."""
    c, d = exp.clients[cid], exp.data
    streams.seed_torch(exp.cfg, torch_round, cid)
    return local_train(
        exp.model, [d.train_texts[i] for i in c.train_idx], d.train_labels[c.train_idx],
        cfg=client_cfg or exp.cfg.client, loss_terms=list(loss_terms), objective=objective,
        grad_transform=grad_transform, ids=c.train_idx, keep_opt=set(keep_opt), opt_state=opt_state or {},
        rng=streams.rng(exp.cfg, streams.CLIENT, rnd, cid), ctx=ctx, epochs=epochs)


def predict_local_test(exp, cid: int) -> np.ndarray:
    d, idx = exp.data, exp.clients[cid].test_idx
    return exp.model.predict([d.test_texts[i] for i in idx], exp.cfg.eval.batch_size).numpy()


def fit(exp, store, cid: int, rnd: int, down: bytes) -> tuple[bytes, dict]:
    """One client's round: decode the GLOBAL tensors, train, keep PRIVATE state, encode the upload."""
    received = wire.decode(down)
    stored = store.get(cid)  # read once: PRIVATE tensors, optimizer state, error-feedback residual
    priv, opt_state = split_state(exp, stored)
    exp.model.load_params({**received, **priv})
    r = exp.recipe
    new_opt, stats = train_client(exp, cid, rnd=rnd, torch_round=rnd, ctx=train_context(exp, cid, received, round=rnd),
                                  objective=r.objective, loss_terms=r.loss_terms, grad_transform=r.grad_transform,
                                  keep_opt=exp.private_names, opt_state=opt_state)
    params = exp.model.trainable()
    codec = exp.cfg.client.upload
    residual = {k[3:]: v for k, v in (stored or {}).items() if k.startswith("ef/")} if codec == "int8" else {}
    up, residual = wire.compress({n: params[n] for n in exp.global_names}, received, codec, residual)
    store.put(cid, {**{f"param/{n}": params[n] for n in exp.private_names},
                    **{f"opt/{k}": v for k, v in new_opt.items()},
                    **{f"ef/{k}": v for k, v in residual.items()}})  # error feedback: never sent
    return up, stats


def evaluate(exp, store, cid: int, global_params: dict) -> dict:
    """One client's personalized model (GLOBAL + its PRIVATE tensors) on its local test set."""
    priv, _ = split_state(exp, store.get(cid))
    exp.model.load_params({**global_params, **priv})
    idx = exp.clients[cid].test_idx
    return score(exp, exp.data.test_labels[idx], predict_local_test(exp, cid), idx)


def personalize(exp, store, cid: int, global_params: dict) -> dict:
    """The recipe's local stage (FedPuReL phase 2): cache l_G (the frozen global branch) on the
    client's data once, train a fresh PEFT of the same type on the stage's objective, and score
    l_G + l_P on the local test set."""
    stage, d, c = exp.recipe.personalize, exp.data, exp.clients[cid]
    exp.model.load_params(global_params)
    l_g = torch.zeros(len(d.train_texts), len(d.class_names))
    l_g[torch.as_tensor(c.train_idx)] = exp.model.predict([d.train_texts[i] for i in c.train_idx],
                                                          exp.cfg.eval.batch_size)
    l_g_test = predict_local_test(exp, cid)
    exp.model.load_params({n: t.clone() for n, t in exp.init_params.items()})
    if stage.steps > 0:  # 0: l_P stays at its fresh init (client.max_steps = 0 would mean "no cap")
        ccfg = dataclasses.replace(exp.cfg.client, max_steps=stage.steps, local_epochs=max(stage.steps, 1))
        train_client(exp, cid, rnd=streams.PERSONALIZE_ROUND, torch_round=streams.PERSONALIZE_TORCH_ROUND,
                     ctx=train_context(exp, cid, global_params, global_logits=l_g), objective=stage.objective,
                     client_cfg=ccfg)
    logits = l_g_test + predict_local_test(exp, cid)
    return score(exp, d.test_labels[c.test_idx], logits, c.test_idx)


def cold_start(exp, store, cid: int, global_params: dict) -> dict:
    """A held-out client: the final GLOBAL tensors and fresh PRIVATE ones; accuracy on its local
    test set at step 0 and after each of 1..N local epochs (PFAdapter §V)."""
    fresh = {n: exp.init_params[n].clone() for n in exp.private_names}
    exp.model.load_params({**global_params, **fresh})
    labels, r = exp.data.test_labels[exp.clients[cid].test_idx], exp.recipe
    accs, opt_state = [], {}
    for e in range(exp.cfg.eval.cold_start_epochs + 1):
        if e > 0:
            opt_state, _ = train_client(
                exp, cid, rnd=streams.COLD_START_ROUND + e, torch_round=-e, ctx=train_context(exp, cid, global_params),
                objective=r.objective, loss_terms=r.loss_terms, grad_transform=r.grad_transform,
                keep_opt=set(exp.model.trainable()), opt_state=opt_state, epochs=1)
        accs.append(classification_metrics(labels, predict_local_test(exp, cid), len(exp.data.class_names))["accuracy"])
    return {"accuracy": accs}


RUN = {"evaluate": evaluate, "personalize": personalize, "cold_start": cold_start}  # runtimes call run_task


def run_task(task: str, exp, store, cid: int, global_params: dict) -> dict:
    """Run client task `task` (one of TASKS) for client `cid`; what it returns is all that leaves."""
    if task not in RUN:
        raise ValueError(f"unknown client task {task!r}; one of {', '.join(TASKS)}")
    return RUN[task](exp, store, cid, global_params)


def accepts(exp, task: str, cid: int) -> bool:
    """Whether `cid` may be given `task`: cold start is for held-out clients, the rest for training ones."""
    return cid in (exp.holdout_ids if task == "cold_start" else exp.train_ids)
