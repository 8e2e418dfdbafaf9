"""Flower's SecAgg+ for a fedsplice round (privacy.secure_aggregation): never our own cryptography.

Server: `run` drives Flower's `SecAggPlusWorkflow` for one round. The workflow was written for
Flower's legacy Strategy API, so it gets a LegacyContext whose Strategy (`_Round`) does no math:
`configure_fit` returns the round's SuperNodes with their FitIns (the GLOBAL tensors, the client
id, the round), and `aggregate_fit` keeps what the workflow decoded: the weighted mean of the
survivors' updates. Each client uploads its update (trained − received GLOBAL tensors, float64)
with its weight (1 under DP's fixed weights, else its sample count); the workflow clips every
coordinate to ±clipping_range, quantizes it (stochastic rounding), masks it, sums the masked
vectors mod 2^32, recovers dropped clients' masks from the survivors' Shamir shares, and divides
by the summed weight. The ServerApp never holds one client's update. Every message the workflow
sends or receives goes through `_Tap`, which shows it to the transport (bytes, wire audit, the
masked vectors for the server's ledger).

Client: `secagg_mod` is Flower's `secaggplus_mod` for the messages of a SecAgg+ round (those
carrying its config record); every other message passes by. After the masked-vector stage it
writes the site's ledger rows of the masked vector it sent (`SITE_KEY`: the ClientApp's note of
where its ledger is; removed before the reply leaves).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import flwr.compat.common.recorddict_compat as compat
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Scalar, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp import Grid

from fedsplice.federation import site_masked
from fedsplice.runtimes.flower.faults import fatal_reason
from fedsplice.runtimes.flower.records import weigh, wire_scalar

SITE_KEY = "fedsplice.site"  # the ClientApp's note to secagg_mod (JSON); never leaves the node
RESULT_METRIC = "fedsplice"  # FitRes.metrics key of the client's result (stats, weight, fingerprint)


# ============================================================================ server


class _Node(ClientProxy):
    """A SuperNode as the legacy workflow names it. The workflow reads only `node_id` and talks to
    the node through the Grid, so the legacy per-proxy calls are refused outright."""

    def __init__(self, node_id: int):
        super().__init__(str(node_id))
        self.node_id = node_id

    def _legacy(self, *args, **kwargs):
        raise TypeError(f"SuperNode {self.node_id}: SecAggPlusWorkflow reaches nodes through the Grid; "
                        f"the legacy ClientProxy calls are not used")

    get_properties = get_parameters = fit = evaluate = reconnect = _legacy


class _Round(Strategy):
    """The workflow's Strategy for one round: the nodes to ask, and a place for the decoded sum."""

    def __init__(self, fitins: dict[int, FitIns]):
        self.fitins = fitins
        self.results: list[tuple[ClientProxy, FitRes]] | None = None

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Node(node), ins) for node, ins in self.fitins.items()]

    def aggregate_fit(self, server_round, results, failures):
        self.results = list(results)
        return None, {}  # the round loop applies the mean (federation.rounds), not the workflow

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class _Tap:
    """The grid as the workflow uses it, with every message shown to `see(direction, message)`."""

    def __init__(self, grid, see: Callable[[str, Message], None]):
        self.grid, self.see = grid, see

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        for m in messages:
            self.see("down", m)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        for r in replies:
            self.see("up", r)
        return replies


class Watch:
    """What the transport sees of a SecAgg+ round's messages, each shown to `audit(direction, node,
    message, weight)` as well: bytes per node [down, up], the masked vectors received, and the
    error replies a retry would repeat (faults.fatal_reason)."""

    def __init__(self, audit: Callable):
        self.audit, self.messages = audit, 0
        self.bytes: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        self.masked: dict[int, list[bytes]] = {}
        self.fatal: list[str] = []

    def __call__(self, direction: str, msg: Message) -> None:
        up = direction == "up"
        node = msg.metadata.src_node_id if up else msg.metadata.dst_node_id
        w = weigh(msg)
        self.audit(direction, node, msg, w)
        self.bytes[node][up] += w.total
        self.messages += 1
        why = fatal_reason(msg.error.code, str(msg.error.reason)) if up and msg.has_error() else None
        if why:
            self.fatal.append(f"SuperNode {node}: {why}")
        if up and masked(msg) is not None:
            self.masked[node] = cast(list[bytes], masked(msg))


@dataclass
class Outcome:
    mean: list[np.ndarray] | None = None  # the weighted mean of the survivors' updates; None: it failed
    results: dict[int, dict] = field(default_factory=dict)  # survivor node -> its result (FitRes metrics)


def fit_ins(arrays: list[np.ndarray], tasks: dict[int, dict]) -> dict[int, FitIns]:
    """node -> its FitIns: the GLOBAL tensors (in the order of the run's GLOBAL names) and its task."""
    params = ndarrays_to_parameters(arrays)
    return {node: FitIns(params, dict(task)) for node, task in tasks.items()}


def _count(x: float) -> int | float:
    return int(x) if x > 1 else float(x)  # Flower: an int is a count, a float a fraction


def run(grid: Grid, rnd: int, fitins: dict[int, FitIns], pc, max_weight: float, timeout: float | None,
        see: Callable[[str, Message], None]) -> Outcome:
    """One SecAgg+ round over `fitins`' nodes with [privacy] `pc`'s secagg_* settings."""
    strategy = _Round(fitins)
    ctx = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                        strategy=strategy)
    ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: rnd})
    ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()  # _Round sends each node its own FitIns
    workflow = SecAggPlusWorkflow(_count(pc.secagg_num_shares), _count(pc.secagg_threshold), max_weight=max_weight,
                                  clipping_range=float(pc.secagg_clipping_range),
                                  quantization_range=int(pc.secagg_quantization_range), timeout=timeout)
    workflow(cast(Grid, _Tap(grid, see)), ctx)  # it calls only send_and_receive
    if strategy.results is None:  # the workflow halted (too few nodes to recover the masks)
        return Outcome()
    results = {cast(_Node, p).node_id: json.loads(str(r.metrics[RESULT_METRIC])) for p, r in strategy.results}
    mean = parameters_to_ndarrays(strategy.results[0][1].parameters) if strategy.results else None
    return Outcome(mean, results)


def masked(msg: Message) -> list[bytes] | None:
    """A client's masked vector (Flower's serialized arrays), if `msg` carries one."""
    if msg.has_error() or not msg.has_content():
        return None
    rec = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    return cast(list[bytes], rec[Key.MASKED_PARAMETERS]) if rec is not None and Key.MASKED_PARAMETERS in rec else None


# ============================================================================ client


def is_round(msg: Message) -> bool:
    """Whether a train message is the masked-vector stage of a SecAgg+ round (it carries FitIns)."""
    return "fitins.parameters" in msg.content.array_records


def task_of(msg: Message) -> tuple[dict, list[np.ndarray]]:
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    return dict(ins.config), parameters_to_ndarrays(ins.parameters)


def reply(msg: Message, update: list[np.ndarray], weight: int, result: dict, note: dict) -> Message:
    """The FitRes secaggplus_mod masks: the update, its weight and the client's result; `note`
    (ledger folder, client, round, names, ε) is for secagg_mod only."""
    metrics: dict[str, Scalar] = {RESULT_METRIC: json.dumps(result, default=wire_scalar)}
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), weight, metrics)
    content = compat.fitres_to_recorddict(res, keep_input=False)
    content[SITE_KEY] = ConfigRecord({"json": json.dumps(note, default=wire_scalar)})
    return Message(content, reply_to=msg)


def secagg_mod(msg: Message, ctxt: Context, call_next) -> Message:
    """Flower's secaggplus_mod for SecAgg+ messages; the site's ledger of the masked vector sent."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS) if msg.has_content() else None
    if msg.metadata.message_type != MessageType.TRAIN or configs is None:
        return call_next(msg, ctxt)
    stage = configs.get(Key.STAGE)
    out = secaggplus_mod(msg, ctxt, call_next)
    if stage == Stage.COLLECT_MASKED_VECTORS and out.has_content():
        note = out.content.pop(SITE_KEY, None)
        arrays = masked(out)
        if isinstance(note, ConfigRecord) and arrays is not None:
            n = json.loads(str(note["json"]))
            site_masked(Path(n["ledger"]), n["cid"], n["round"], arrays, n["names"], n["epsilon"], n["local_epsilon"])
    return out
