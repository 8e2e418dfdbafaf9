"""The in-process runtime: the one round loop, evaluation and cold start.

Per round: every sampled client receives the GLOBAL tensors (serialized, measured), restores
its PRIVATE tensors and their optimizer state from the store, trains, and uploads its GLOBAL
tensors (serialized, measured, audited). The server averages the deltas by sample count and
steps its optimizer. Deterministic given the seed: data order and dropout draw from generators
derived from (seed, round, client).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


def evaluate_global(exp: Experiment, global_params: dict) -> dict:
    """GM: GLOBAL tensors + fresh PRIVATE ones on the balanced global test set."""
    d = exp.data
    fresh = {n: exp.init_params[n] for n in exp.private_names}
    exp.model.load_params({**global_params, **fresh})
    logits = exp.model.predict(d.test_texts, exp.cfg.eval.batch_size).numpy()
    return classification_metrics(d.test_labels, logits, len(d.class_names))


def evaluate_client(exp: Experiment, store, cid: int, global_params: dict) -> dict:
    """One client's personalized model (GLOBAL + its PRIVATE tensors) on its local test set."""
    d = exp.data
    priv, _ = private_state(exp, store, cid)
    exp.model.load_params({**global_params, **priv})
    idx = exp.clients[cid].test_idx
    lg = exp.model.predict([d.test_texts[i] for i in idx], exp.cfg.eval.batch_size).numpy()
    return classification_metrics(d.test_labels[idx], lg, len(d.class_names))


def evaluate(exp: Experiment, global_params: dict, store) -> dict:
    """GM on the global test set; PM over ALL training clients (in-process)."""
    return {"gm": evaluate_global(exp, global_params),
            "pm": summarize_clients([evaluate_client(exp, store, c, global_params) for c in exp.train_ids])}


@dataclass
class Reply:
    cid: int
    payload: bytes  # the serialized GLOBAL tensors the client uploads
    num_examples: int
    stats: dict
    up_bytes: int  # measured on what crossed the wire (here: the payload itself)
    down_bytes: int


class InProcess:
    """The simulation transport: clients run one after another in this process, one backbone.

    A runtime is anything with `fit(rnd, cids, down) -> [Reply]` and
    `evaluate(cids, down) -> [metrics]`; the Flower runtime implements the same two calls.
    """

    def __init__(self, exp: Experiment, store, progress: Callable[[], None] | None = None):
        self.exp, self.store, self.progress = exp, store, progress

    def fit(self, rnd: int, cids: list[int], down: bytes) -> list[Reply]:
        out = []
        for cid in cids:
            up, st = client_update(self.exp, self.store, cid, rnd, down)
            out.append(Reply(cid, up, len(self.exp.clients[cid].train_idx), st, len(up), len(down)))
            if self.progress:
                self.progress()
        return out

    def evaluate(self, cids: list[int], down: bytes) -> list[dict]:
        g = wire.decode(down)
        return [evaluate_client(self.exp, self.store, c, g) for c in cids]


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


def run_rounds(exp: Experiment, store, on_round: Callable[[dict], None], progress=None,
               transport=None) -> dict:
    """The one round loop. Calls on_round(record) after every round; returns the final state."""
    cfg = exp.cfg
    transport = transport or InProcess(exp, store, progress)
    params = exp.model.trainable()
    global_params = {n: params[n].detach().clone() for n in exp.global_names}
    server_state = exp.server_opt.init(global_params)
    allowed, private = set(exp.global_names), set(exp.private_names)
    up_total = down_total = 0

    def evaluation(gp: dict) -> dict:
        per_client = transport.evaluate(exp.train_ids, wire.encode(gp))
        return {"gm": evaluate_global(exp, gp), "pm": summarize_clients(per_client)}

    on_round({"round": 0, **evaluation(global_params)})
    for rnd in range(1, cfg.server.rounds + 1):
        t0 = time.perf_counter()
        replies = transport.fit(rnd, exp.sampling[rnd - 1], wire.encode(global_params))
        uploads = []
        for r in replies:
            received = wire.decode(r.payload)
            wire.audit(received, allowed, private, f"client {r.cid}")
            uploads.append(received)
        up_round = sum(r.up_bytes for r in replies)
        down_round = sum(r.down_bytes for r in replies)
        up_total, down_total = up_total + up_round, down_total + down_round
        if exp.global_names:
            mean = weighted_mean([deltas(u, global_params) for u in uploads], [r.num_examples for r in replies])
            global_params, server_state = exp.server_opt.update(mean, server_state, global_params)
        stats = [r.stats for r in replies]
        record = {"round": rnd, "clients": [r.cid for r in replies],
                  "train_loss": float(np.mean([s["loss"] for s in stats])),
                  "up_bytes": up_round, "down_bytes": down_round, "time_s": time.perf_counter() - t0}
        for k in stats[0]:
            if k not in ("steps", "loss"):
                record[k] = float(np.mean([s[k] for s in stats]))
        if rnd % cfg.eval.every == 0 or rnd == cfg.server.rounds:
            record.update(evaluation(global_params))
        on_round(record)
    return {"global_params": global_params, "server_state": server_state,
            "up_bytes": up_total, "down_bytes": down_total}
