"""The Flower ServerApp and ClientApp of fedsplice (Flower 1.42 Message API).

ServerApp (runs where the SuperLink is): builds the experiment from the run config, then runs
fedsplice's own `runner.run_experiment` — the same round loop, server optimizer, evaluation,
cold start and run directory as `fedsplice run` — with `FlowerTransport` as the transport.

ClientApp (runs on each SuperNode, one process per message, as Flower's subprocess isolation
does): "query" answers the node's partition; "train" runs `simulation.client_update` for each
client id in the message; "evaluate" runs `simulation.evaluate_client`. PRIVATE tensors and
their optimizer state live in a `store.DiskStore` in the node's own folder (node config
`state-dir`, one subfolder per run), so they survive from one message (process) to the next
and never enter a message.

Run config (pyproject [tool.flwr.app.config], written by `fedsplice flower app`/`up`):
  fedsplice-config  the resolved experiment config, TOML text
  out-dir           the run directory, on the ServerApp's host
  min-nodes         SuperNodes to wait for before round 0
  node-wait-s       how long to wait for them
Node config (flower-supernode --node-config):
  partition-id, num-partitions   which clients this node serves (cid % num-partitions == partition-id)
  state-dir         where PRIVATE state is kept (default ~/.cache/fedsplice/flower-state)
  data-path         optional: this host's copy of the dataset (replaces data.dataset, e.g. "jsonl:/data/x.jsonl")
  cache-dir         optional: this host's fedsplice asset cache (FEDSPLICE_CACHE)
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

CONFIG_KEY, OUT_KEY, MIN_NODES_KEY, NODE_WAIT_KEY = "fedsplice-config", "out-dir", "min-nodes", "node-wait-s"
STATUS_FILE = "flower-status.json"

server_app = ServerApp()
client_app = ClientApp()


def config_from_text(text: str):
    """The ExperimentConfig from TOML text, validated like a config file."""
    import tomllib

    from fedsplice.config import ExperimentConfig, from_dict

    cfg = from_dict(ExperimentConfig, tomllib.loads(text))
    cfg.check()
    return cfg


def _say(line: str) -> None:
    print(line, flush=True)  # the ServerApp's stdout is streamed by `flwr run --stream` / `flwr log`


# ============================================================================ ServerApp


def run_on_grid(grid: Grid, cfg, out: Path, *, min_nodes: int, node_wait_s: float) -> dict:
    """`runner.run_experiment` with the round loop's transport = FlowerTransport(grid)."""
    from fedsplice.app import rundir
    from fedsplice.app import runner
    from fedsplice.runtimes.flower.transport import FlowerTransport, JsonLog

    events = JsonLog(out / "events.jsonl", echo=_say)
    audit = JsonLog(out / "wire.jsonl")
    made = {}

    def make_transport(exp, store):
        t = made["t"] = FlowerTransport(grid, exp, events=events, audit=audit, min_nodes=min_nodes,
                                        node_wait_s=node_wait_s, say=_say)
        if exp.recipe.personalize:  # the runner runs it in this (the server's) process, on all data
            events({"event": "personalization_on_server", "node_id": 0, "cids": list(exp.train_ids),
                    "detail": "this algorithm's local personalization stage runs in the ServerApp "
                              "process, not on the SuperNodes (a runner hook is needed to move it)"})
        return t

    results = runner.run_experiment(cfg, out, overwrite=True, quiet=True, make_transport=make_transport,
                                    echo=lambda line: _say("[fedsplice] " + line))
    t = made.get("t")
    if t is not None:
        tot = t.totals
        results["flower"] = {
            "supernodes": len(set(t.owner.values())) if t.owner else 0,
            "events": events.count,
            "messages": tot["messages"],
            # The simulation runtime's figures for the same tensors (safetensors payloads; one
            # broadcast per sampled client). Uploads compare one to one: Flower's up_bytes are the
            # payload plus the message envelope. Downloads do not: Flower sends one message per
            # SuperNode per round, however many of its clients were sampled (docs/flower.md).
            "up_payload_bytes": tot["up_payload_bytes"], "down_payload_bytes": tot["down_payload_bytes"],
            "up_envelope_bytes": tot["up_bytes"] - tot["up_payload_bytes"],
            "uploaded_tensors": tot["up_tensors"],
            "eval_down_bytes": tot["eval_down_bytes"], "eval_up_bytes": tot["eval_up_bytes"],
        }
        rundir.write_results(out, results)
    return results


@server_app.main()
def server_main(grid: Grid, context: Context) -> None:
    from fedsplice.data.assets import atomic_write_json

    rc = context.run_config
    out = Path(str(rc[OUT_KEY]))
    status = out / STATUS_FILE
    t0 = time.time()
    try:
        cfg = config_from_text(str(rc[CONFIG_KEY]))
        _say(f"[fedsplice] ServerApp: {cfg.algorithm} on {cfg.data.dataset}, {cfg.server.rounds} rounds -> {out}")
        results = run_on_grid(grid, cfg, out, min_nodes=int(rc.get(MIN_NODES_KEY, 1)),
                              node_wait_s=float(rc.get(NODE_WAIT_KEY, 300.0)))
        atomic_write_json(status, {"ok": True, "run_id": context.run_id, "time_s": round(time.time() - t0, 1),
                                   "gm_accuracy": results["gm"]["accuracy"], "pm_accuracy": results["pm"]["accuracy"]})
        _say("[fedsplice] ServerApp: done")
    except BaseException as e:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(status, {"ok": False, "run_id": context.run_id, "error": f"{type(e).__name__}: {e}",
                                   "traceback": traceback.format_exc()})
        _say(f"[fedsplice] ServerApp failed: {type(e).__name__}: {e}")
        raise


# ============================================================================ ClientApp


class _Node:
    """What one ClientApp process needs: the experiment (built from the run config, with this
    node's data location) and the node's PRIVATE-state store."""

    _cached: "_Node | None" = None  # a warm executor serves many messages (and runs) per process
    _key: tuple = ()

    def __init__(self, context: Context):
        nc = context.node_config
        self.partition_id, self.num_partitions = _partition(nc)
        if "cache-dir" in nc:
            os.environ["FEDSPLICE_CACHE"] = str(nc["cache-dir"])
        from fedsplice.federation.experiment import build
        from fedsplice.federation.store import DiskStore

        cfg = config_from_text(str(context.run_config[CONFIG_KEY]))
        if "data-path" in nc:
            cfg.data.dataset = str(nc["data-path"])
            cfg.check()
        self.exp = build(cfg)
        root = Path(str(nc.get("state-dir", Path.home() / ".cache" / "fedsplice" / "flower-state")))
        self.store = DiskStore(root.expanduser() / f"run-{context.run_id}")

    @classmethod
    def get(cls, context: Context) -> "_Node":
        key = (context.run_id, str(context.run_config[CONFIG_KEY]), tuple(sorted(context.node_config.items())))
        if cls._cached is None or cls._key != key:
            cls._cached, cls._key = None, ()
            cls._cached, cls._key = cls(context), key
        return cls._cached

    def check(self, cids: list[int]) -> None:
        from fedsplice.runtimes.flower.transport import owned

        for cid in cids:
            if cid not in self.exp.train_ids or not owned(cid, self.partition_id, self.num_partitions):
                raise ValueError(f"client {cid} is not served by this node "
                                 f"(partition {self.partition_id}/{self.num_partitions})")

    def global_params(self, msg: Message) -> dict:
        from fedsplice.runtimes.flower.records import from_record
        from fedsplice.runtimes.flower.transport import GLOBAL_KEY

        like = {n: self.exp.init_params[n] for n in self.exp.global_names}
        return from_record(msg.content.array_records[GLOBAL_KEY], like, private=set(self.exp.private_names))


def _partition(nc) -> tuple[int, int]:
    try:
        p, n = int(nc["partition-id"]), int(nc["num-partitions"])
    except KeyError as e:
        raise ValueError(f"node config lacks {e.args[0]!r}; start the SuperNode with "
                         "--node-config 'partition-id=P num-partitions=N'") from None
    if not (n >= 1 and 0 <= p < n):
        raise ValueError(f"node config partition-id={p}, num-partitions={n}: need 0 <= partition-id < num-partitions")
    return p, n


def _task(msg: Message) -> tuple[int, list[int]]:
    from fedsplice.runtimes.flower.transport import TASK_KEY

    rec = msg.content.config_records[TASK_KEY]
    return int(rec["round"]), [int(c) for c in rec["cids"]]


def _result(payload: dict, arrays: dict | None = None) -> RecordDict:
    from fedsplice.runtimes.flower.records import finite_json
    from fedsplice.runtimes.flower.transport import RESULT_KEY

    content = RecordDict(arrays or {})
    content[RESULT_KEY] = ConfigRecord({"json": json.dumps(payload, default=finite_json)})
    return content


@client_app.query()
def node_query(msg: Message, context: Context) -> Message:
    from fedsplice import __version__

    p, n = _partition(context.node_config)
    return Message(RecordDict({"result": ConfigRecord({"partition-id": p, "num-partitions": n,
                                                       "fedsplice-version": __version__,
                                                       "python": sys.version.split()[0]})}),
                   reply_to=msg)


@client_app.train()
def node_train(msg: Message, context: Context) -> Message:
    from fedsplice.core import wire
    from fedsplice.runtimes.flower.records import to_record
    from fedsplice.runtimes.flower.transport import UP_PREFIX, client_fingerprint
    from fedsplice.federation.simulation import client_update

    node = _Node.get(context)
    rnd, cids = _task(msg)
    node.check(cids)
    down = wire.encode(node.global_params(msg))
    arrays, res = {}, {}
    allowed = set(node.exp.global_names)
    for cid in cids:
        up, stats = client_update(node.exp, node.store, cid, rnd, down)
        tensors = wire.decode(up)
        assert set(tensors) <= allowed  # client_update uploads GLOBAL names only
        arrays[f"{UP_PREFIX}{cid}"] = to_record(tensors)
        res[str(cid)] = {"stats": stats, "num_examples": len(node.exp.clients[cid].train_idx),
                         "fingerprint": client_fingerprint(node.exp, cid)}
    return Message(_result(res, arrays), reply_to=msg)


@client_app.evaluate()
def node_evaluate(msg: Message, context: Context) -> Message:
    from fedsplice.federation.simulation import evaluate_client

    node = _Node.get(context)
    _, cids = _task(msg)
    node.check(cids)
    g = node.global_params(msg)
    res = {str(cid): {"metrics": evaluate_client(node.exp, node.store, cid, g)} for cid in cids}
    return Message(_result(res), reply_to=msg)
