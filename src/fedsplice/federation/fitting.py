"""The `fit` client task: one round of a client, from the GLOBAL tensors it receives to the
upload it sends, in three parts: `fit_start` (its state, the method's hooks before training, the
tensors it trains from), the training (`tasks.train_phases` on the one model, or the round's
clients together: `fedsplice.federation.batched_train`), and `fit_end` (the method's upload rule,
privacy, the codec, the ledger, the state it keeps).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedsplice.algorithms import clone
from fedsplice.algorithms.state import pack
from fedsplice.core import wire
from fedsplice.core.context import TrainContext
from fedsplice.federation.dpsgd import session as dpsgd_session
from fedsplice.federation.ledger import site_upload
from fedsplice.federation.privacy import client_release
from fedsplice.federation.state import ClientState, switch_state
from fedsplice.federation.tasks import (
    OnClient,
    method_state,
    round_config,
    split_state,
    start_switches,
    train_context,
    train_phases,
)
from fedsplice.federation.train import Step

if TYPE_CHECKING:
    from fedsplice.algorithms import Link
    from fedsplice.config import ClientConfig
    from fedsplice.core.server import Params
    from fedsplice.federation.dpsgd import LocalDP
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.store import Store


@dataclass
class Fitting:
    """One client's round between its download and its training."""

    cid: int
    rnd: int
    received: Params  # the GLOBAL tensors as downloaded
    stored: ClientState | None
    links: dict[str, Link]  # the switches, started (their state is kept in fit_end)
    slot: object  # the method's state (Recipe.state)
    start: dict[str, torch.Tensor]  # every trainable tensor it trains from
    keep: list[str]  # the names whose optimizer state it keeps
    opt_state: Params
    private: LocalDP | None  # DP-SGD's session (None: off)
    ctx: TrainContext
    client_cfg: ClientConfig


def fit_start(exp: Experiment, store: Store, cid: int, rnd: int, down: bytes) -> Fitting:
    """Decode the GLOBAL tensors; the client's state, its switches, the method's hooks before
    training (Personal.fit, Exchange.receive): what it trains from."""
    received = wire.decode(down)
    stored = ClientState.from_store(store.get(cid))  # read once: every slot of the client's state
    priv, opt_state = split_state(exp, stored)
    links = start_switches(exp, cid, stored, received)
    r, ex = exp.recipe, exp.recipe.exchange
    slot = method_state(exp, stored)  # the method's own state
    if r.personalize and r.personalize.fit:  # the method's own stage, before the round's training
        slot = r.personalize.fit(OnClient(exp, cid), rnd, received, slot)
    start: Mapping[str, torch.Tensor] = received
    if ex and ex.receive:  # the method's own download rule (e.g. truncated to the client's rank)
        start, slot = ex.receive(OnClient(exp, cid), rnd, received, slot)
    # pooled (centralized): its optimizer state persists across rounds, one continuous training run;
    # else client.optimizer_state says whether PRIVATE tensors keep theirs
    keep = (exp.global_names + exp.private_names if r.pooled
            else exp.private_names if exp.cfg.client.optimizer_state == "keep_private" else [])
    private = dpsgd_session(exp, cid, rnd, stored.dp if stored is not None else None)  # None: no DP-SGD
    return Fitting(cid, rnd, received, stored, links, slot, {**priv, **start}, keep, opt_state, private,
                   train_context(exp, cid, links.values(), round=rnd, state=slot), round_config(exp, cid, rnd))


def fit_end(exp: Experiment, store: Store, f: Fitting, params: Params, new_opt: Params,
            stats: dict[str, float]) -> tuple[bytes, dict[str, float]]:
    """From every trainable tensor as trained (on the CPU): the method's upload rule, privacy,
    the codec and the ledger; the state the client keeps; the upload and the statistics."""
    cid, rnd, received, stored, slot, ex = f.cid, f.rnd, f.received, f.stored, f.slot, exp.recipe.exchange
    local_eps = None if f.private is None else f.private.epsilon()
    if local_eps is not None:
        stats["dp_local_epsilon"] = local_eps
    trained = {n: params[n] for n in exp.global_names}
    if ex and ex.send:  # the method's own upload rule (e.g. its rank pruned), from all it trained
        sent, slot, extra = ex.send(OnClient(exp, cid), rnd, params, slot)
        trained, stats = {n: sent[n] for n in exp.global_names}, {**stats, **extra}
    if exp.privacy is not None:  # distributed DP: clipped and noised here, before anything leaves
        trained = client_release(exp.privacy, exp.cfg, cid, rnd, trained, received)
    codec = exp.cfg.client.upload
    residual = dict(stored.ef) if stored is not None and codec == "int8" else {}
    up, residual = wire.compress(trained, received, codec, residual)
    if exp.ledger is not None and not exp.recipe.pooled:  # the site's record of what it sends (federation.ledger)
        site_upload(exp.ledger, cid, rnd, up, exp.privacy.epsilon(rnd) if exp.privacy is not None else None,
                    local_eps, secagg=exp.cfg.privacy.secure_aggregation)
    store.put(cid, ClientState(params={n: params[n] for n in exp.private_names}, opt=new_opt, ef=residual,
                               switch=switch_state({n: link.state() for n, link in f.links.items()}),
                               method=pack(slot), dp=f.private.state() if f.private is not None else {}).to_store())
    return up, stats


def fit(exp: Experiment, store: Store, cid: int, rnd: int, down: bytes) -> tuple[bytes, dict[str, float]]:
    """One client's round: decode the GLOBAL tensors, train, keep PRIVATE state, encode the upload."""
    f = fit_start(exp, store, cid, rnd, down)
    exp.model.load_params(f.start)  # receive may also reset PRIVATE tensors (FLoRA's fresh LoRA)
    new_opt, stats = train_phases(exp, cid, rnd=rnd, torch_round=rnd, ctx=f.ctx, step=Step.of(exp.recipe),
                                  keep_opt=f.keep, opt_state=f.opt_state, client_cfg=f.client_cfg, private=f.private)
    params = clone(exp.model.trainable())  # on the CPU: the wire and the store never hold device tensors
    return fit_end(exp, store, f, params, new_opt, stats)
