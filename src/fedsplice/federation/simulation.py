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

from fedsplice.core import wire
from fedsplice.federation.experiment import STREAM_CLIENT, Experiment, rng
from fedsplice.algorithms.fedpurel import tkl
from fedsplice.federation.metrics import classification_metrics, longtail_metrics, per_class_counts, summarize_clients
from fedsplice.federation.checkpoint import RoundState
from fedsplice.core.robust import aggregate, gather
from fedsplice.core.server import deltas
from fedsplice.federation.train import local_train


def _client_seed(exp: Experiment, rnd: int, cid: int) -> None:
    # Dropout (if any) draws from torch's global RNG; fix it per (seed, round, client).
    torch.manual_seed(hash((exp.cfg.seed, rnd, cid)) & 0x7FFFFFFF)


def private_state(exp: Experiment, store, cid: int) -> tuple[dict, dict]:
    """(PRIVATE tensors, their optimizer state) of a client; fresh ones if it never trained."""
    return split_state(exp, store.get(cid))


def split_state(exp: Experiment, st: dict | None) -> tuple[dict, dict]:
    """(PRIVATE tensors, their optimizer state) from a client's stored state (None: fresh)."""
    if st is None:
        return {n: exp.init_params[n].clone() for n in exp.private_names}, {}
    params = {k[len("param/"):]: v for k, v in st.items() if k.startswith("param/")}
    opt = {k[len("opt/"):]: v for k, v in st.items() if k.startswith("opt/")}
    return params, opt


def train_context(exp: Experiment, cid: int, received: dict, **extra) -> dict:
    """What the objective and loss terms may read: the weights received this round (FedProx),
    the client's logit-adjustment offset, and the frozen caches (zero-shot logits)."""
    ctx = {"global_ref": received, "client": cid, **exp.caches, **extra}
    tau = exp.cfg.client.logit_adjustment
    if tau > 0:  # Menon et al.: tau * log(local class prior), from the client's own labels
        counts = np.bincount(exp.data.train_labels[exp.clients[cid].train_idx], minlength=len(exp.data.class_names))
        ctx["logit_offset"] = tau * torch.log(torch.as_tensor((counts + 1e-3) / counts.sum(), dtype=torch.float32))
    return ctx


def client_update(exp: Experiment, store, cid: int, rnd: int, down: bytes) -> tuple[bytes, dict]:
    """One client's round: decode the GLOBAL tensors, train, keep PRIVATE state, encode the upload."""
    received = wire.decode(down)
    stored = store.get(cid)  # read once: PRIVATE tensors, optimizer state, error-feedback residual
    priv, opt_state = split_state(exp, stored)
    exp.model.load_params({**received, **priv})
    c = exp.clients[cid]
    _client_seed(exp, rnd, cid)
    r = exp.recipe
    new_opt, stats = local_train(
        exp.model, [exp.data.train_texts[i] for i in c.train_idx], exp.data.train_labels[c.train_idx],
        cfg=exp.cfg.client, loss_terms=r.loss_terms, objective=r.objective, grad_transform=r.grad_transform,
        ids=c.train_idx, keep_opt=set(exp.private_names), opt_state=opt_state,
        rng=rng(exp.cfg, STREAM_CLIENT, rnd, cid), ctx=train_context(exp, cid, received, round=rnd))
    params = exp.model.trainable()
    codec = exp.cfg.client.upload
    residual = {k[3:]: v for k, v in (stored or {}).items() if k.startswith("ef/")} if codec == "int8" else {}
    up, residual = wire.compress({n: params[n] for n in exp.global_names}, received, codec, residual)
    store.put(cid, {**{f"param/{n}": params[n] for n in exp.private_names},
                    **{f"opt/{k}": v for k, v in new_opt.items()},
                    **{f"ef/{k}": v for k, v in residual.items()}})  # error feedback: never sent
    return up, stats


def score(exp: Experiment, labels: np.ndarray, logits: np.ndarray, test_idx: np.ndarray) -> dict:
    """Metrics of logits on test samples `test_idx`, with what pooling needs: per-class counts of
    the model and of the zero-shot model on the same samples, and TKL to zero-shot."""
    c = len(exp.data.class_names)
    m = classification_metrics(labels, logits, c)
    zs = exp.caches["zero_shot_test"][torch.as_tensor(test_idx)]
    correct, total = per_class_counts(labels, logits.argmax(1), c)
    zs_correct, _ = per_class_counts(labels, zs.numpy().argmax(1), c)
    m["tkl"] = float(tkl(torch.as_tensor(logits), zs).mean())
    m.update(class_correct=correct.tolist(), class_total=total.tolist(), zs_class_correct=zs_correct.tolist())
    return m


def with_longtail(exp: Experiment, m: dict, correct, total, zs_correct) -> dict:
    e = exp.cfg.eval
    out = {k: v for k, v in m.items() if not isinstance(v, list)}
    out.update(longtail_metrics(correct, total, zs_correct, exp.caches["train_counts"],
                                many=e.many_threshold, few=e.few_threshold, sigma=e.balancedness_sigma))
    # per class, in class order (None: no test sample of that class): the head-to-tail plots
    out["class_accuracy"] = [float(c / t) if t else None for c, t in zip(correct, total)]
    return out


def summarize_pm(exp: Experiment, per_client: list[dict]) -> dict:
    """PM: scalar metrics averaged over ALL clients (accuracy also std/min/max); the long-tail
    metrics pool the clients' local test predictions (per-class counts summed)."""
    pooled = [np.sum([m[k] for m in per_client], axis=0) for k in ("class_correct", "class_total",
                                                                  "zs_class_correct")]
    return with_longtail(exp, summarize_clients(per_client), *pooled)


def evaluate_global(exp: Experiment, global_params: dict) -> dict:
    """GM: GLOBAL tensors + fresh PRIVATE ones on the balanced global test set (the first
    global_test_size test samples; a scenario's transformed local test copies follow it)."""
    d = exp.data
    size = d.global_test_size
    fresh = {n: exp.init_params[n] for n in exp.private_names}
    exp.model.load_params({**global_params, **fresh})
    logits = exp.model.predict(d.test_texts[:size], exp.cfg.eval.batch_size).numpy()
    m = score(exp, d.test_labels[:size], logits, np.arange(size))
    return with_longtail(exp, m, m["class_correct"], m["class_total"], m["zs_class_correct"])


def evaluate_client(exp: Experiment, store, cid: int, global_params: dict) -> dict:
    """One client's personalized model (GLOBAL + its PRIVATE tensors) on its local test set."""
    d = exp.data
    priv, _ = private_state(exp, store, cid)
    exp.model.load_params({**global_params, **priv})
    idx = exp.clients[cid].test_idx
    lg = exp.model.predict([d.test_texts[i] for i in idx], exp.cfg.eval.batch_size).numpy()
    return score(exp, d.test_labels[idx], lg, idx)


def evaluate(exp: Experiment, global_params: dict, store) -> dict:
    """GM on the global test set; PM over ALL training clients (in-process)."""
    return {"gm": evaluate_global(exp, global_params),
            "pm": summarize_pm(exp, [evaluate_client(exp, store, c, global_params) for c in exp.train_ids])}


def evaluate_only(exp: Experiment, store, on_round: Callable[[dict], None]) -> dict:
    """Runs that train nothing (zero-shot): one evaluation, no traffic."""
    params = exp.model.trainable()
    global_params = {n: params[n].detach().clone() for n in exp.global_names}
    on_round({"round": 0, **evaluate(exp, global_params, store)})
    return {"global_params": global_params, "server_state": {}, "up_bytes": 0, "down_bytes": 0}


@dataclass
class Reply:
    cid: int
    payload: bytes  # the serialized GLOBAL tensors the client uploads
    num_examples: int
    stats: dict
    up_bytes: int  # measured on what crossed the wire (here: the payload itself)
    down_bytes: int
    error: str = ""  # the client failed (dropout, crash, lost connection): why; no update
    late: bool = False  # the reply came after the round deadline; it is not aggregated


class InProcess:
    """The simulation transport: clients run one after another in this process, one backbone.

    A runtime is anything with `fit(rnd, cids, down) -> [Reply]` and
    `evaluate(cids, down) -> [metrics]`; the Flower runtime implements the same two calls. A
    runtime may return fewer replies than clients asked, or replies with `error`/`late` set:
    the round loop (`robust.gather`) treats them the same way whichever runtime sent them.

    Injected failures (`[faults]`) are drawn per (seed, round, attempt, client) from their own
    stream, so a resumed run fails the same clients. A dropped or late client does not run at
    all: its PRIVATE state does not advance (the server cancels a late client's task at the
    deadline, so its work is discarded whole).
    """

    FAULT_STREAM = 4  # after experiment.py's streams 0-3

    def __init__(self, exp: Experiment, store, progress: Callable[[], None] | None = None):
        self.exp, self.store, self.progress = exp, store, progress
        self._attempts: dict[int, int] = {}  # round -> fit calls so far (a retry draws anew)

    def _fault(self, rnd: int, attempt: int, cid: int) -> str:
        f, deadline = self.exp.cfg.faults, self.exp.cfg.server.round_deadline_s
        if f.dropout <= 0 and f.straggler <= 0:
            return ""
        u_drop, u_slow = rng(self.exp.cfg, self.FAULT_STREAM, rnd, attempt, cid).random(2)
        if u_drop < f.dropout:
            return "dropout"
        if u_slow < f.straggler and 0 < deadline < f.straggler_delay_s:
            return "late"
        return ""

    def fit(self, rnd: int, cids: list[int], down: bytes) -> list[Reply]:
        attempt = self._attempts.get(rnd, 0)
        self._attempts[rnd] = attempt + 1
        out = []
        for cid in cids:
            fault = self._fault(rnd, attempt, cid)
            if fault:
                out.append(Reply(cid, b"", 0, {}, 0, len(down), error="" if fault == "late" else
                                 "dropout (simulated)", late=fault == "late"))
                continue
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
                r = exp.recipe
                opt_state, _ = local_train(
                    exp.model, texts, d.train_labels[cl.train_idx], cfg=cfg.client,
                    loss_terms=r.loss_terms, objective=r.objective, grad_transform=r.grad_transform,
                    ids=cl.train_idx, keep_opt=set(exp.model.trainable()), opt_state=opt_state,
                    rng=rng(cfg, STREAM_CLIENT, 10**6 + e, cid),
                    ctx=train_context(exp, cid, global_params), epochs=1)
            lg = exp.model.predict(test, cfg.eval.batch_size).numpy()
            accs.append(classification_metrics(d.test_labels[cl.test_idx], lg, c)["accuracy"])
        curves.append(accs)
    arr = np.array(curves)
    return {"clients": exp.holdout_ids, "epochs": list(range(epochs + 1)),
            "accuracy": arr.mean(0).tolist(), "accuracy_std": arr.std(0).tolist(),
            "per_client": arr.tolist()}


def run_rounds(exp: Experiment, store, on_round: Callable[[dict], None], progress=None,
               transport=None, start: RoundState | None = None,
               on_state: Callable[[RoundState], None] | None = None) -> dict:
    """The one round loop. Calls on_round(record) after every round, then on_state(state) with
    the server's state at the end of that round (the runner checkpoints it); `start` continues
    from such a state (resume: round 0 is not evaluated again). Returns the final state.

    A round survives failing clients: replies are validated (`robust.gather`), and a round with
    fewer than `server.min_replies` valid ones, after `server.max_retries` retries, is skipped
    (global tensors and server state unchanged) and marked `"skipped": true`.
    """
    cfg, sc = exp.cfg, exp.cfg.server
    transport = transport or InProcess(exp, store, progress)
    if start is None:
        params = exp.model.trainable()
        global_params = {n: params[n].detach().clone() for n in exp.global_names}
        server_state = exp.server_opt.init(global_params)
        up_total = down_total = 0
    else:
        global_params, server_state = dict(start.global_params), dict(start.server_state)
        up_total, down_total = start.up_bytes, start.down_bytes
    private = set(exp.private_names)

    def evaluation(gp: dict) -> dict:
        per_client = transport.evaluate(exp.train_ids, wire.encode(gp))
        return {"gm": evaluate_global(exp, gp), "pm": summarize_pm(exp, per_client)}

    if start is None:
        on_round({"round": 0, **evaluation(global_params)})
    for rnd in range((start.round if start else 0) + 1, sc.rounds + 1):
        t0 = time.perf_counter()
        got = gather(transport, rnd, exp.sampling[rnd - 1], wire.encode(global_params), global_params,
                     private, min_replies=sc.min_replies, max_retries=sc.max_retries,
                     norm_bound=sc.update_norm_bound)
        up_total, down_total = up_total + got.up_bytes, down_total + got.down_bytes
        ok = len(got.accepted) >= sc.min_replies
        if ok and exp.global_names:
            agg = aggregate([deltas(u, global_params) for _, u in got.accepted],
                            [r.num_examples for r, _ in got.accepted], sc.aggregation, sc.trim_fraction)
            global_params, server_state = exp.server_opt.update(agg, server_state, global_params)
        stats = [r.stats for r, _ in got.accepted] if ok else []
        record = {"round": rnd, "clients": [r.cid for r, _ in got.accepted]}
        if stats:
            record["train_loss"] = float(np.mean([s["loss"] for s in stats]))
        record.update(up_bytes=got.up_bytes, down_bytes=got.down_bytes, dropped=got.count("dropped"),
                      late=got.count("late"), rejected=got.count("rejected"),
                      time_s=time.perf_counter() - t0)
        if not ok:
            record["skipped"] = True
        if got.attempts > 1:
            record["attempts"] = got.attempts
        if got.events:
            record["events"] = got.events
        for k in (stats[0] if stats else ()):  # in a fixed order: metrics.jsonl is compared bytewise
            if k not in ("steps", "loss") and all(k in s for s in stats):
                record[k] = float(np.mean([s[k] for s in stats]))
        if rnd % cfg.eval.every == 0 or rnd == cfg.server.rounds:
            record.update(evaluation(global_params))
        on_round(record)
        if on_state is not None:
            on_state(RoundState(rnd, global_params, server_state, up_total, down_total))
    return {"global_params": global_params, "server_state": server_state,
            "up_bytes": up_total, "down_bytes": down_total}
