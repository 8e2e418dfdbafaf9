"""The ClientApp of fedsplice on each SuperNode (Flower 1.42 Message API), and the run-config keys.

Every message carries a client task (`fedsplice.federation.tasks`) for some of the clients this
node serves; the node runs it on its own data and PRIVATE state and answers only what the task
returns:
  query               the node's partition (which clients it serves)
  train               `fit` for each client id: their GLOBAL uploads; under SecAgg+
                      (privacy.secure_aggregation) Flower's four-stage protocol (`secagg`), whose
                      masked-vector stage fits one client and sends only its masked update
  evaluate            `evaluate`: each client's metrics on its local test set (PM)
  train.personalize   `personalize`: FedPuReL's phase 2, trained here; its metrics
  train.cold_start    `cold_start`: a held-out client's adaptation curve
An error a retry would repeat (a config error, a bug) reaches the server as `ClientTaskError`
and stops the run; a fault of the host (memory, network, disk) is a dropout (`faults`).
PRIVATE tensors and their optimizer state live in a `DiskStore` in the node's own folder (node
config `state-dir`, one subfolder `run-<run key>` per run: the key comes with every task and
stays the same when the run is resumed), so they survive from one message (process) to the
next and never enter a message. After each fit the node also keeps that client's state under
the round (`rounds/round-NNNNNN/`, hard links); a resumed run's query names the checkpoint's
round and the node restores every client to its last state of a round <= it (`rollback`), so
the rollback happens where the state is. The ServerApp is `fedsplice.app.flower.server`.

Run config (pyproject [tool.flwr.app.config], written by `fedsplice flower app`/`up`):
  fedsplice-config  the resolved experiment config, TOML text
  out-dir           the run directory, on the ServerApp's host
  min-nodes         SuperNodes to wait for before round 0
  node-wait-s       how long to wait for them
  resume            true: continue the run in out-dir from its last checkpoint
Node config (flower-supernode --node-config):
  partition-id, num-partitions   which clients this node serves (cid % num-partitions == partition-id)
  state-dir         where PRIVATE state is kept (default ~/.cache/fedsplice/flower-state)
  data-path         optional: this host's copy of the dataset (replaces data.dataset, e.g. "jsonl:/data/x.jsonl");
                    with per-site data (data.dataset = "sites"): required, this site's own file
  cache-dir         optional: this host's fedsplice asset cache (FEDSPLICE_CACHE)
  device            optional: this node's device ("cpu", "cuda", "cuda:N", "mps", "auto"), in place of
                    the run config's runtime.device (`fedsplice flower up --devices`); the run
                    config's runtime.precision and model.dtype still apply
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedsplice.errors import ConfigError
from fedsplice.federation import (
    SITES,
    DiskStore,
    accepts,
    build,
    client_task,
    config_from_text,
    fit_client,
    validate_config,
    wire,
)
from fedsplice.runtimes.flower import secagg
from fedsplice.runtimes.flower.faults import classified
from fedsplice.runtimes.flower.nodestate import prune, rollback, run_folder, snapshot, state_root
from fedsplice.runtimes.flower.partition import client_fingerprint, owned
from fedsplice.runtimes.flower.records import from_record, to_record, wire_scalar
from fedsplice.runtimes.flower.transport import (
    CONFIG_KEY,
    GLOBAL_KEY,
    RESULT_KEY,
    ROLLBACK_ERROR,
    ROLLBACK_FIELD,
    RUN_KEY_FIELD,
    TASK_KEY,
    UP_PREFIX,
)
from fedsplice.version import __version__

if TYPE_CHECKING:
    from flwr.common import ConfigRecordValues

client_app = ClientApp(mods=[secagg.secagg_mod])  # SecAgg+ rounds only; other messages pass by


# ============================================================================ ClientApp


class Node:
    """What one ClientApp process needs: the experiment (built from the run config, with this
    node's data location) and the node's PRIVATE-state store."""

    _cached: Node | None = None  # a warm executor serves many messages (and runs) per process
    _key: tuple = ()

    def __init__(self, context: Context):
        nc = context.node_config
        self.partition_id, self.num_partitions = partition(nc)
        if "cache-dir" in nc:
            os.environ["FEDSPLICE_CACHE"] = str(nc["cache-dir"])
        cfg = on_node_device(config_from_text(str(context.run_config[CONFIG_KEY])), nc)
        with device_errors(nc):  # the device is resolved when the model is built
            self.exp = build(cfg, site_of(nc, cfg, self.partition_id, self.num_partitions))
        self.state_root, self.run_id = state_root(nc), context.run_id
        self._stores: dict[Path, DiskStore] = {}

    @classmethod
    def get(cls, context: Context) -> Node:
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

    def store(self, task) -> DiskStore:
        """The PRIVATE-state store of a task's run (its run key; Flower's run id without one)."""
        folder = run_folder(self.state_root, task, self.run_id)
        if folder not in self._stores:
            self._stores[folder] = DiskStore(folder)
        return self._stores[folder]

    def global_params(self, msg: Message) -> dict:
        like = {n: self.exp.init_params[n] for n in self.exp.global_names}
        return from_record(msg.content.array_records[GLOBAL_KEY], like, private=set(self.exp.private_names))


def site_of(nc, cfg, partition_id: int, num_partitions: int) -> tuple[str, int] | None:
    """Per-site data (data.dataset = "sites"): (this node's own file, its client id). Otherwise
    None, after pointing the config at this host's copy of the data set (`data-path`), if given."""
    if cfg.data.dataset != SITES:
        if "data-path" in nc:
            cfg.data.dataset = str(nc["data-path"])
            validate_config(cfg)
        return None
    if "data-path" not in nc:
        raise ValueError("per-site data (data.dataset = 'sites'): start the SuperNode with its own file, "
                         "--node-config 'partition-id=P num-partitions=N data-path=\"csv:/data/site.csv\"'")
    if num_partitions != cfg.data.num_clients:
        raise ValueError(f"per-site data: num-partitions = {num_partitions} but data.num_clients = "
                         f"{cfg.data.num_clients}; each SuperNode is one site (one client)")
    return str(nc["data-path"]), partition_id


DEVICE_KEY = "device"  # node config: this node's device, in place of runtime.device


def on_node_device(cfg, nc):
    """`cfg` with the node config's `device`, if it has one, as runtime.device (a spelling error
    names the node config key); unchanged otherwise. Precision and dtype stay the run config's."""
    if DEVICE_KEY not in nc:
        return cfg
    cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, device=str(nc[DEVICE_KEY])))
    with device_errors(nc):
        return validate_config(cfg)


@contextmanager
def device_errors(nc):
    """A ConfigError about runtime.device, when the node config set it, names the node config key."""
    try:
        yield
    except ConfigError as e:
        head = "runtime.device ="
        if DEVICE_KEY not in nc or not str(e).startswith(head):
            raise
        raise ConfigError(f"node config {DEVICE_KEY} ={str(e)[len(head):]}") from None


def partition(nc) -> tuple[int, int]:
    try:
        p, n = int(nc["partition-id"]), int(nc["num-partitions"])
    except KeyError as e:
        raise ValueError(f"node config lacks {e.args[0]!r}; start the SuperNode with "
                         "--node-config 'partition-id=P num-partitions=N'") from None
    if not (n >= 1 and 0 <= p < n):
        raise ValueError(f"node config partition-id={p}, num-partitions={n}: need 0 <= partition-id < num-partitions")
    return p, n


# ============================================================================ handlers


def _task(msg: Message) -> tuple[int, list[int]]:
    rec = msg.content.config_records[TASK_KEY]
    return int(cast(int, rec["round"])), [int(c) for c in cast(list[int], rec["cids"])]


def _result(payload: dict, arrays: dict | None = None) -> RecordDict:
    content = RecordDict(arrays or {})
    content[RESULT_KEY] = ConfigRecord({"json": json.dumps(payload, default=wire_scalar)})
    return content


@client_app.query()
@classified  # an error a retry repeats stops the run; a fault is a dropout
def node_query(msg: Message, context: Context) -> Message:
    p, n = partition(context.node_config)
    rec: dict[str, ConfigRecordValues] = {
        "partition-id": p, "num-partitions": n, "fedsplice-version": __version__, "python": sys.version.split()[0],
        DEVICE_KEY: str(context.node_config.get(DEVICE_KEY, ""))}  # "": the run config's runtime.device
    task = msg.content.config_records.get(TASK_KEY)
    if task is not None and RUN_KEY_FIELD in task:  # the run starts (0) or resumes: roll PRIVATE state back
        try:
            rollback(run_folder(state_root(context.node_config), task, context.run_id),
                     int(cast(int, task[ROLLBACK_FIELD])))
            rec[ROLLBACK_ERROR] = ""
        except (OSError, ValueError, KeyError) as e:
            rec[ROLLBACK_ERROR] = f"{type(e).__name__}: {e}"
    return Message(RecordDict({"result": ConfigRecord(rec)}), reply_to=msg)


@client_app.train()
@classified
def node_train(msg: Message, context: Context) -> Message:
    node = Node.get(context)
    if secagg.is_round(msg):
        return _secure_train(node, msg)
    rnd, cids = _task(msg)
    node.check(cids)
    down = wire.encode(node.global_params(msg))
    arrays, res = {}, {}
    store = node.store(msg.content.config_records[TASK_KEY])
    for cid in cids:
        tensors, res[str(cid)] = _fit(node, store, cid, rnd, down)
        arrays[f"{UP_PREFIX}{cid}"] = to_record(tensors)
    _prune(node, store, rnd)
    return Message(_result(res, arrays), reply_to=msg)


def _fit(node: Node, store: DiskStore, cid: int, rnd: int, down: bytes) -> tuple[dict, dict]:
    """One client's fit on this node: the GLOBAL tensors it uploads, and its result for the server."""
    node.exp.ledger = store.root / "ledger"  # the site's own ledger of what it sends, beside its PRIVATE state
    up, stats = fit_client(node.exp, store, cid, rnd, down)
    if node.exp.cfg.runtime.checkpoint_every:  # kept until no checkpoint the server keeps can need it
        snapshot(store, cid, rnd)
    tensors = wire.decode(up)
    extra = set(tensors) - set(node.exp.global_names)
    if extra:  # PRIVATE tensors never leave the site (not an assert: -O strips it)
        raise RuntimeError(f"client {cid} would upload non-GLOBAL tensors {sorted(extra)}; nothing was sent")
    return tensors, {"stats": stats, "num_examples": len(node.exp.clients[cid].train_idx),
                     "fingerprint": client_fingerprint(node.exp, cid)}


def _prune(node: Node, store: DiskStore, rnd: int) -> None:
    if node.exp.cfg.runtime.checkpoint_every:
        prune(store.root, rnd, node.exp.cfg.runtime, node.exp.cfg.server.rounds)


def _secure_train(node: Node, msg: Message) -> Message:
    """The masked-vector stage of a SecAgg+ round (secagg): fit, and hand secaggplus_mod the update
    (trained − received GLOBAL tensors, float64) and its weight (1 under DP's fixed weights)."""
    task, arrays = secagg.task_of(msg)
    rnd, cid, names = int(task["round"]), int(task["cid"]), node.exp.global_names
    node.check([cid])
    like = {n: node.exp.init_params[n] for n in names}
    if [tuple(a.shape) for a in arrays] != [tuple(like[n].shape) for n in names]:
        raise ValueError(f"the SecAgg+ task's {len(arrays)} arrays do not match this node's {len(names)} GLOBAL "
                         f"tensors (the same config on every host?)")
    received = {n: torch.from_numpy(a.copy()).to(like[n].dtype) for n, a in zip(names, arrays)}
    store = node.store(task)
    tensors, res = _fit(node, store, cid, rnd, wire.encode(received))
    _prune(node, store, rnd)
    update = [(tensors[n].double() - received[n].double()).numpy() for n in names]
    weight = 1 if task.get("fixed") else res["num_examples"]
    eps = node.exp.privacy.epsilon(rnd) if node.exp.privacy is not None else None
    return secagg.reply(msg, update, weight, res, {"ledger": str(store.root / "ledger"), "cid": cid, "round": rnd,
                                                   "names": names, "epsilon": eps,
                                                   "local_epsilon": res["stats"].get("dp_local_epsilon")})


def _run(task: str, msg: Message, context: Context) -> Message:
    """A client task other than fit: its result per client, as JSON (no tensors leave)."""
    node = Node.get(context)
    _, cids = _task(msg)
    node.check(cids, task)
    g, store = node.global_params(msg), node.store(msg.content.config_records[TASK_KEY])
    return Message(_result({str(cid): {"metrics": client_task(task, node.exp, store, cid, g)} for cid in cids}),
                   reply_to=msg)


@client_app.evaluate()
@classified
def node_evaluate(msg: Message, context: Context) -> Message:
    return _run("evaluate", msg, context)


@client_app.evaluate("global")
@classified
def node_evaluate_global(msg: Message, context: Context) -> Message:
    return _run("evaluate_global", msg, context)


@client_app.train("personalize")
@classified
def node_personalize(msg: Message, context: Context) -> Message:
    return _run("personalize", msg, context)


@client_app.train("cold_start")
@classified
def node_cold_start(msg: Message, context: Context) -> Message:
    return _run("cold_start", msg, context)
