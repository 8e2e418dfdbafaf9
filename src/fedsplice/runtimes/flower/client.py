"""The ClientApp of fedsplice on each SuperNode (Flower 1.42 Message API), and the run-config keys.

Every message carries a client task (`fedsplice.federation.tasks`) for some of the clients this
node serves; the node runs it on its own data and PRIVATE state and answers only what the task
returns:
  query               the node's partition (which clients it serves)
  train               `fit` for each client id: their GLOBAL uploads
  evaluate            `evaluate`: each client's metrics on its local test set (PM)
  train.personalize   `personalize`: FedPuReL's phase 2, trained here; its metrics
  train.cold_start    `cold_start`: a held-out client's adaptation curve
PRIVATE tensors and their optimizer state live in a `DiskStore` in the node's own folder (node
config `state-dir`, one subfolder per run), so they survive from one message (process) to the
next and never enter a message. The ServerApp is `fedsplice.app.flower.server`.

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
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsplice.version import __version__
from fedsplice.federation import DiskStore, accepts, build, client_task, config_from_text, fit_client, validate_config, wire
from fedsplice.runtimes.flower.records import finite_json, from_record, to_record
from fedsplice.runtimes.flower.transport import (CONFIG_KEY, GLOBAL_KEY, RESULT_KEY, TASK_KEY, UP_PREFIX,
                                                 client_fingerprint, owned)

client_app = ClientApp()


# ============================================================================ ClientApp


class Node:
    """What one ClientApp process needs: the experiment (built from the run config, with this
    node's data location) and the node's PRIVATE-state store."""

    _cached: "Node | None" = None  # a warm executor serves many messages (and runs) per process
    _key: tuple = ()

    def __init__(self, context: Context):
        nc = context.node_config
        self.partition_id, self.num_partitions = partition(nc)
        if "cache-dir" in nc:
            os.environ["FEDSPLICE_CACHE"] = str(nc["cache-dir"])
        cfg = config_from_text(str(context.run_config[CONFIG_KEY]))
        if "data-path" in nc:
            cfg.data.dataset = str(nc["data-path"])
            validate_config(cfg)
        self.exp = build(cfg)
        root = Path(str(nc.get("state-dir", Path.home() / ".cache" / "fedsplice" / "flower-state")))
        self.store = DiskStore(root.expanduser() / f"run-{context.run_id}")

    @classmethod
    def get(cls, context: Context) -> "Node":
        key = (context.run_id, str(context.run_config[CONFIG_KEY]), tuple(sorted(context.node_config.items())))
        if cls._cached is None or cls._key != key:
            cls._cached, cls._key = None, ()
            cls._cached, cls._key = cls(context), key
        return cls._cached

    def check(self, cids: list[int], task: str = "fit") -> None:
        for cid in cids:
            if not (accepts(self.exp, task, cid) and owned(cid, self.partition_id, self.num_partitions)):
                raise ValueError(f"client {cid} is not served by this node for {task} "
                                 f"(partition {self.partition_id}/{self.num_partitions})")

    def global_params(self, msg: Message) -> dict:
        like = {n: self.exp.init_params[n] for n in self.exp.global_names}
        return from_record(msg.content.array_records[GLOBAL_KEY], like, private=set(self.exp.private_names))


def partition(nc) -> tuple[int, int]:
    try:
        p, n = int(nc["partition-id"]), int(nc["num-partitions"])
    except KeyError as e:
        raise ValueError(f"node config lacks {e.args[0]!r}; start the SuperNode with "
                         "--node-config 'partition-id=P num-partitions=N'") from None
    if not (n >= 1 and 0 <= p < n):
        raise ValueError(f"node config partition-id={p}, num-partitions={n}: need 0 <= partition-id < num-partitions")
    return p, n


def _task(msg: Message) -> tuple[int, list[int]]:
    rec = msg.content.config_records[TASK_KEY]
    return int(rec["round"]), [int(c) for c in rec["cids"]]


def _result(payload: dict, arrays: dict | None = None) -> RecordDict:
    content = RecordDict(arrays or {})
    content[RESULT_KEY] = ConfigRecord({"json": json.dumps(payload, default=finite_json)})
    return content


@client_app.query()
def node_query(msg: Message, context: Context) -> Message:
    p, n = partition(context.node_config)
    return Message(RecordDict({"result": ConfigRecord({"partition-id": p, "num-partitions": n,
                                                       "fedsplice-version": __version__,
                                                       "python": sys.version.split()[0]})}),
                   reply_to=msg)


@client_app.train()
def node_train(msg: Message, context: Context) -> Message:
    node = Node.get(context)
    rnd, cids = _task(msg)
    node.check(cids)
    down = wire.encode(node.global_params(msg))
    arrays, res = {}, {}
    allowed = set(node.exp.global_names)
    for cid in cids:
        up, stats = fit_client(node.exp, node.store, cid, rnd, down)
        tensors = wire.decode(up)
        assert set(tensors) <= allowed  # fit uploads GLOBAL names only
        arrays[f"{UP_PREFIX}{cid}"] = to_record(tensors)
        res[str(cid)] = {"stats": stats, "num_examples": len(node.exp.clients[cid].train_idx),
                         "fingerprint": client_fingerprint(node.exp, cid)}
    return Message(_result(res, arrays), reply_to=msg)


def _run(task: str, msg: Message, context: Context) -> Message:
    """A client task other than fit: its result per client, as JSON (no tensors leave)."""
    node = Node.get(context)
    _, cids = _task(msg)
    node.check(cids, task)
    g = node.global_params(msg)
    return Message(_result({str(cid): {"metrics": client_task(task, node.exp, node.store, cid, g)} for cid in cids}),
                   reply_to=msg)


@client_app.evaluate()
def node_evaluate(msg: Message, context: Context) -> Message:
    return _run("evaluate", msg, context)


@client_app.train("personalize")
def node_personalize(msg: Message, context: Context) -> Message:
    return _run("personalize", msg, context)


@client_app.train("cold_start")
def node_cold_start(msg: Message, context: Context) -> Message:
    return _run("cold_start", msg, context)
