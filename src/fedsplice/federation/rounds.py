"""The one round loop, and the stages after it, over any transport.

A transport is what a runtime provides: `fit(rnd, cids, down) -> [Reply]` (one round of local
training for the sampled clients) and `run(task, cids, down) -> {cid: dict}` (a client task of
`fedsplice.federation.tasks.TASKS`, for the clients that answered, in the order of `cids`). `down` is the serialized
GLOBAL tensors. A transport may return fewer results than clients asked, or replies with
`error`/`late` set: the loop treats them the same way whichever runtime sent them.

Per round: the sampled clients (pre-drawn, `Experiment.sampling`) receive the GLOBAL tensors,
train, and upload theirs; replies are validated (`gather`), the deltas averaged by sample count
(or robustly), and the server optimizer steps. Only the global test set (GM) is scored here.
Under secure aggregation (privacy.secure_aggregation, Flower's SecAgg+) the transport's
`fit_secure` returns only the mean of the deltas (`secure_gather`), and the server optimizer
steps with that.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np

from fedsplice.core import wire

# aggregate, deltas, gather, evaluate_global: re-exported (benchmarks/profile_run.py times them here)
from fedsplice.core.robust import aggregate as aggregate
from fedsplice.core.server import OWN_WEIGHT, Params, own_weights, weighted_mean
from fedsplice.core.server import deltas as deltas
from fedsplice.errors import ConfigError
from fedsplice.federation.calls import ask
from fedsplice.federation.checkpoint import RoundState
from fedsplice.federation.evaluation import evaluate_global as evaluate_global
from fedsplice.federation.evaluation import pooled_gm, summarize_pm
from fedsplice.federation.gather import Gathered, Upload, secure_gather
from fedsplice.federation.gather import gather as gather
from fedsplice.federation.ledger import SERVER, write_split
from fedsplice.federation.ledger import append as ledger_append
from fedsplice.federation.ledger import rows as ledger_rows
from fedsplice.federation.privacy import secure_release, server_aggregate

if TYPE_CHECKING:
    from fedsplice.federation.experiment import Experiment
    from fedsplice.federation.ledger import Row
    from fedsplice.federation.metrics import Metrics


SECAGG_NEEDS_FLOWER = ("privacy.secure_aggregation = true runs Flower's SecAgg+: use runtime.kind = 'flower' "
                       "or `fedsplice flower up`")


@dataclass
class Reply:
    cid: int
    payload: bytes  # the serialized GLOBAL tensors the client uploads
    num_examples: int
    stats: dict[str, float]
    up_bytes: int  # measured on what crossed the wire (here: the payload itself)
    down_bytes: int
    error: str = ""  # the client failed (dropout, crash, lost connection): why; no update
    late: bool = False  # the reply came after the round deadline; it is not aggregated


@runtime_checkable
class Transport(Protocol):
    """What a runtime provides to the round loop (module docstring): it moves client tasks and
    their results, and does no math. InProcess, Workers and FlowerTransport implement it. Each
    also has an `observer` attribute (fedsplice.federation.calls.Observer, None: no one watches);
    the loop's calls tell it when they begin and end, and a runtime that can tell reports each
    client task as it ends (`observer.client_done(task)`)."""

    def fit(self, rnd: int, cids: list[int], down: bytes) -> list[Reply]: ...

    def run(self, task: str, cids: list[int], down: bytes) -> dict[int, Metrics]: ...


def initial_global(exp: Experiment) -> Params:
    params = exp.model.trainable()
    return {n: params[n].detach().to("cpu", copy=True) for n in exp.global_names}


def gm_and_pm(exp: Experiment, transport: Transport, global_params: Params, gm_first: bool = False) -> Metrics:
    """GM here, on the global test set; PM as the `evaluate` task on every training client.
    (`gm_first`: the order zero-shot runs have always used; frozen-prefix caches fill in the
    order texts are first seen, so the order is kept for bytewise-reproducible results.)"""
    if exp.data.global_test_size == 0:  # per-site data without a server test set: GM on the sites
        down = wire.encode(global_params)
        gm = pooled_gm(exp, list(ask(transport, "evaluate_global", exp.train_ids, down).values()))
        per_client = ask(transport, "evaluate", exp.train_ids, down)
        return {"gm": gm, "pm": summarize_pm(exp, in_order(per_client))}
    if gm_first:
        gm = evaluate_global(exp, global_params)
    per_client = ask(transport, "evaluate", exp.train_ids, wire.encode(global_params))
    if not gm_first:
        gm = evaluate_global(exp, global_params)
    return {"gm": gm, "pm": summarize_pm(exp, in_order(per_client))}


def in_order(per_client: dict[int, Metrics]) -> list[Metrics]:
    """Replies by client id (a deployment answers in arrival order): client_accuracy pairs up."""
    return [per_client[c] for c in sorted(per_client)]


def evaluate_only(exp: Experiment, transport: Transport, on_round: Callable[[Metrics], None]) -> dict[str, Any]:
    """Runs that train nothing (zero-shot): one evaluation, no traffic."""
    global_params = initial_global(exp)
    on_round({"round": 0, **gm_and_pm(exp, transport, global_params, gm_first=True)})
    return {"global_params": global_params, "server_state": {}, "up_bytes": 0, "down_bytes": 0}


def round_record(rnd: int, got: Gathered, ok: bool, t0: float) -> Metrics:
    """What metrics.jsonl logs of a round's training (evaluation is added by the caller)."""
    stats = [r.stats for r, _ in got.accepted] if ok else []
    record: Metrics = {"round": rnd, "clients": [r.cid for r, _ in got.accepted]}
    if stats:
        record["train_loss"] = float(np.mean([s["loss"] for s in stats]))
    record.update(up_bytes=got.up_bytes, down_bytes=got.down_bytes, dropped=got.count("dropped"),
                  late=got.count("late"), rejected=got.count("rejected"), time_s=time.perf_counter() - t0)
    if not ok:
        record["skipped"] = True
    if got.attempts > 1:
        record["attempts"] = got.attempts
    if got.events:
        record["events"] = got.events
    for k in (stats[0] if stats else ()):  # in a fixed order: metrics.jsonl is compared bytewise
        # a client's own aggregation weights (core.server.OWN_WEIGHT) are not statistics
        if k not in ("steps", "loss") and not k.startswith(OWN_WEIGHT) and all(k in s for s in stats):
            record[k] = float((np.max if k == "dp_local_epsilon" else np.mean)([s[k] for s in stats]))  # ε: the worst
    return record


def accepted_rows(exp: Experiment, got: Gathered, rnd: int) -> list[Row]:
    """The server's ledger rows of a round: every upload it accepted, as received."""
    eps = exp.privacy.epsilon(rnd) if exp.privacy is not None else None
    return [row for r, _ in got.accepted for row in ledger_rows(r.payload, rnd, r.cid, eps,
                                                                  r.stats.get("dp_local_epsilon"))]


def weights_of(exp: Experiment, accepted: list[tuple[Upload, Params]]) -> dict[str, list[float]]:
    """The clients' own weights per tensor (core.server.own_weights), where the server can use
    them: a plain mean, no DP-FedAvg nor SecAgg+ (a method's check_config refuses those first)."""
    own = own_weights([r.stats for r, _ in accepted])
    p, sc = exp.cfg.privacy, exp.cfg.server
    if own and (p.enabled or p.secure_aggregation or sc.aggregation != "mean"):
        raise ConfigError(f"algorithm {exp.cfg.algorithm!r} weighs its uploads itself, which needs "
                          f"server.aggregation = 'mean', privacy.mode = 'off' and no secure aggregation")
    return own


def aggregate_round(exp: Experiment, accepted: list[tuple[Upload, Params]], global_params: Params,
                    rnd: int = 0) -> tuple[Params, dict[str, float]]:
    """The aggregate of the accepted updates' deltas: server.aggregation over them, with the
    clients' own weights per tensor where they report them (core.server.own_weights, from a
    method's Exchange.send; the rest by sample size), or DP-FedAvg's clipped, noised sum over m
    (federation.privacy); and what the round logs of it."""
    sc = exp.cfg.server
    ds, n = [deltas(u, global_params) for _, u in accepted], [r.num_examples for r, _ in accepted]
    own = weights_of(exp, accepted)
    if exp.privacy is not None:
        return server_aggregate(exp.privacy, exp.cfg, rnd, ds)
    if not own:
        return aggregate(ds, n, sc.aggregation, sc.trim_fraction), {}
    return {k: weighted_mean([{k: d[k]} for d in ds], own.get(k, n))[k] for k in ds[0]}, {}


def run_rounds(exp: Experiment, on_round: Callable[[Metrics], None], *, transport: Transport,
               start: RoundState | None = None, on_state: Callable[[RoundState], None] | None = None) -> dict[str, Any]:
    """The one round loop. Calls on_round(record) after every round, then on_state(state) with
    the server's state at the end of that round (the runner checkpoints it); `start` continues
    from such a state (resume: round 0 is not evaluated again). Returns the final state.

    A round survives failing clients: replies are validated (`gather`), and a round with fewer
    than `server.min_replies` valid ones, after `server.max_retries` retries, is skipped (global
    tensors and server state unchanged) and marked `"skipped": true`.
    """
    sc, secure = exp.cfg.server, exp.cfg.privacy.secure_aggregation
    if secure and not hasattr(transport, "fit_secure"):
        raise ConfigError(SECAGG_NEEDS_FLOWER)
    if exp.ledger is not None:
        write_split(exp.ledger, exp.global_names, exp.private_names)
    if start is None:
        global_params = initial_global(exp)
        server_state, up_total, down_total = exp.server_opt.init(global_params), 0, 0
        on_round({"round": 0, **gm_and_pm(exp, transport, global_params)})
    else:
        global_params, server_state = dict(start.global_params), dict(start.server_state)
        up_total, down_total = start.up_bytes, start.down_bytes
    for rnd in range((start.round if start else 0) + 1, sc.rounds + 1):
        t0 = time.perf_counter()
        down, cids = wire.encode(global_params), exp.sampling[rnd - 1]
        seen = None  # the server's ledger rows of the round: what it received
        if secure:  # Flower's SecAgg+: the server gets the mean of the updates, and their masked vectors
            got, mean, seen = secure_gather(transport, rnd, cids, down, global_params)
        else:
            got = gather(transport, rnd, cids, down, global_params, set(exp.private_names),
                         min_replies=sc.min_replies, max_retries=sc.max_retries, norm_bound=sc.update_norm_bound)
        if exp.recipe.pooled:  # centralized: the data are pooled where the model is; nothing is federated
            got.up_bytes = got.down_bytes = 0
        up_total, down_total = up_total + got.up_bytes, down_total + got.down_bytes
        if exp.ledger is not None and not exp.recipe.pooled:
            ledger_append(exp.ledger / SERVER, seen if seen is not None else accepted_rows(exp, got, rnd))
        ok = len(got.accepted) >= sc.min_replies
        logged: dict[str, float] = {}
        if ok and exp.global_names:
            if secure:  # SecAgg+ sums by sample count only: a client's own weights are refused
                weights_of(exp, got.accepted)
            agg, logged = (secure_release(exp.privacy, cast(Params, mean), len(got.accepted)), {}) if secure else \
                aggregate_round(exp, got.accepted, global_params, rnd)
            global_params, server_state = exp.server_opt.update(agg, server_state, global_params)
        record = round_record(rnd, got, ok, t0)
        if exp.privacy is not None:  # every round's uploads count, a skipped one too (conservative)
            record.update(logged, dp_epsilon=exp.privacy.epsilon(rnd))
        if rnd % exp.cfg.eval.every == 0 or rnd == sc.rounds:
            record.update(gm_and_pm(exp, transport, global_params))
        on_round(record)
        if on_state is not None:
            on_state(RoundState(rnd, global_params, server_state, up_total, down_total))
    return {"global_params": global_params, "server_state": server_state,
            "up_bytes": up_total, "down_bytes": down_total}


def personalization(exp: Experiment, transport: Transport, global_params: Params) -> Metrics:
    """PM after the recipe's local stage (FedPuReL phase 2), run as the `personalize` task on
    every training client; only its metrics come back."""
    return summarize_pm(exp, in_order(ask(transport, "personalize", exp.train_ids, wire.encode(global_params))))


def cold_start(exp: Experiment, transport: Transport, global_params: Params) -> Metrics:
    """Held-out clients adapt the final GLOBAL tensors (the `cold_start` task); their mean curve."""
    curves = ask(transport, "cold_start", exp.holdout_ids, wire.encode(global_params))
    arr = np.array([c["accuracy"] for c in curves.values()])
    return {"clients": list(curves), "epochs": list(range(exp.cfg.eval.cold_start_epochs + 1)),
            "accuracy": arr.mean(0).tolist(), "accuracy_std": arr.std(0).tolist(),
            "per_client": arr.tolist()}
