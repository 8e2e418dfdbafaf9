"""The in-process runtime: the one round loop, evaluation and cold start.

Per round: every sampled client receives the GLOBAL tensors (serialized, measured), restores
its PRIVATE tensors and their optimizer state from the store, trains, and uploads its GLOBAL
tensors (serialized, measured, audited). The server averages the deltas by sample count and
steps its optimizer. Deterministic given the seed: data order and dropout draw from generators
derived from (seed, round, client).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from fedsplice import wire
from fedsplice.experiment import STREAM_CLIENT, Experiment, rng
from fedsplice.metrics import classification_metrics, summarize_clients
from fedsplice.server import deltas, weighted_mean
from fedsplice.train import local_train


def _client_seed(exp: Experiment, rnd: int, cid: int) -> None:
    # Dropout (if any) draws from torch's global RNG; fix it per (seed, round, client).
    torch.manual_seed(hash((exp.cfg.seed, rnd, cid)) & 0x7FFFFFFF)


def private_state(exp: Experiment, store, cid: int) -> tuple[dict, dict]:
    """(PRIVATE tensors, their optimizer state) of a client; fresh ones if it never trained."""
    st = store.get(cid)
    if st is None:
        return {n: exp.init_params[n].clone() for n in exp.private_names}, {}
    params = {k[len("param/"):]: v for k, v in st.items() if k.startswith("param/")}
    opt = {k[len("opt/"):]: v for k, v in st.items() if k.startswith("opt/")}
    return params, opt


def client_update(exp: Experiment, store, cid: int, rnd: int, down: bytes) -> tuple[bytes, dict]:
    """One client's round: decode the GLOBAL tensors, train, keep PRIVATE state, encode the upload."""
    received = wire.decode(down)
    priv, opt_state = private_state(exp, store, cid)
    exp.model.load_params({**received, **priv})
    c = exp.clients[cid]
    _client_seed(exp, rnd, cid)
    new_opt, stats = local_train(
        exp.model, [exp.data.train_texts[i] for i in c.train_idx], exp.data.train_labels[c.train_idx],
        cfg=exp.cfg.client, loss_terms=exp.recipe.loss_terms, grad_transforms=exp.recipe.grad_transforms,
        keep_opt=set(exp.private_names), opt_state=opt_state, rng=rng(exp.cfg, STREAM_CLIENT, rnd, cid),
        ctx={"global_ref": received, "round": rnd, "client": cid})
    params = exp.model.trainable()
    store.put(cid, {**{f"param/{n}": params[n] for n in exp.private_names},
                    **{f"opt/{k}": v for k, v in new_opt.items()}})
    return wire.encode({n: params[n] for n in exp.global_names}), stats


def evaluate(exp: Experiment, global_params: dict, store) -> dict:
    """GM: global tensors + fresh PRIVATE ones on the balanced global test set.
    PM: each training client's own model on its local test set, over ALL training clients."""
    cfg, d = exp.cfg, exp.data
    c = len(d.class_names)
    fresh = {n: exp.init_params[n] for n in exp.private_names}
    exp.model.load_params({**global_params, **fresh})
    logits = exp.model.predict(d.test_texts, cfg.eval.batch_size).numpy()
    gm = classification_metrics(d.test_labels, logits, c)
    per_client = []
    for cid in exp.train_ids:
        priv, _ = private_state(exp, store, cid)
        exp.model.load_params({**global_params, **priv})
        idx = exp.clients[cid].test_idx
        lg = exp.model.predict([d.test_texts[i] for i in idx], cfg.eval.batch_size).numpy()
        per_client.append(classification_metrics(d.test_labels[idx], lg, c))
    return {"gm": gm, "pm": summarize_clients(per_client)}


def cold_start(exp: Experiment, global_params: dict) -> dict:
    """Held-out clients get the final GLOBAL tensors and fresh PRIVATE ones; accuracy on their
    local test sets at step 0 and after 1..N local epochs (PFAdapter §V)."""
    cfg, d = exp.cfg, exp.data
    c = len(d.class_names)
    epochs = cfg.eval.cold_start_epochs
    curves = []
    for cid in exp.holdout_ids:
        fresh = {n: exp.init_params[n].clone() for n in exp.private_names}
        exp.model.load_params({**global_params, **fresh})
        cl = exp.clients[cid]
        texts = [d.train_texts[i] for i in cl.train_idx]
        test = [d.test_texts[i] for i in cl.test_idx]
        accs, opt_state = [], {}
        for e in range(epochs + 1):
            if e > 0:
                _client_seed(exp, -e, cid)
                opt_state, _ = local_train(
                    exp.model, texts, d.train_labels[cl.train_idx], cfg=cfg.client,
                    loss_terms=exp.recipe.loss_terms, grad_transforms=exp.recipe.grad_transforms,
                    keep_opt=set(exp.model.trainable()), opt_state=opt_state,
                    rng=rng(cfg, STREAM_CLIENT, 10**6 + e, cid), ctx={"global_ref": global_params},
                    epochs=1)
            lg = exp.model.predict(test, cfg.eval.batch_size).numpy()
            accs.append(classification_metrics(d.test_labels[cl.test_idx], lg, c)["accuracy"])
        curves.append(accs)
    arr = np.array(curves)
    return {"clients": exp.holdout_ids, "epochs": list(range(epochs + 1)),
            "accuracy": arr.mean(0).tolist(), "accuracy_std": arr.std(0).tolist(),
            "per_client": arr.tolist()}


def run_rounds(exp: Experiment, store, on_round: Callable[[dict], None], progress=None) -> dict:
    """The one round loop. Calls on_round(record) after every round; returns the final state."""
    cfg = exp.cfg
    params = exp.model.trainable()
    global_params = {n: params[n].detach().clone() for n in exp.global_names}
    server_state = exp.server_opt.init(global_params)
    allowed, private = set(exp.global_names), set(exp.private_names)
    up_total = down_total = 0
    record = {"round": 0, **evaluate(exp, global_params, store)}
    on_round(record)
    for rnd in range(1, cfg.server.rounds + 1):
        t0 = time.perf_counter()
        down = wire.encode(global_params)
        uploads, weights, stats, up_round = [], [], [], 0
        for cid in exp.sampling[rnd - 1]:
            up, st = client_update(exp, store, cid, rnd, down)
            received = wire.decode(up)
            wire.audit(received, allowed, private, f"client {cid}")
            uploads.append(received)
            weights.append(len(exp.clients[cid].train_idx))
            stats.append(st)
            up_round += len(up)
            if progress:
                progress()
        down_round = len(down) * len(uploads)
        up_total, down_total = up_total + up_round, down_total + down_round
        if exp.global_names:
            mean = weighted_mean([deltas(u, global_params) for u in uploads], weights)
            global_params, server_state = exp.server_opt.update(mean, server_state, global_params)
        record = {"round": rnd, "clients": exp.sampling[rnd - 1],
                  "train_loss": float(np.mean([s["loss"] for s in stats])),
                  "up_bytes": up_round, "down_bytes": down_round, "time_s": time.perf_counter() - t0}
        for k in stats[0]:
            if k not in ("steps", "loss"):
                record[k] = float(np.mean([s[k] for s in stats]))
        if rnd % cfg.eval.every == 0 or rnd == cfg.server.rounds:
            record.update(evaluate(exp, global_params, store))
        on_round(record)
    return {"global_params": global_params, "server_state": server_state,
            "up_bytes": up_total, "down_bytes": down_total}
