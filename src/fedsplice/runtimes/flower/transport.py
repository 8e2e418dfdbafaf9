"""`FlowerTransport`: the round loop's fit/evaluate calls, carried by Flower messages.

`fedsplice.federation.run_rounds` is the one round loop (validation, retries, min_replies, aggregation,
server optimizer); a runtime only moves tasks and results. This transport runs inside the
ServerApp and turns `fit(rnd, cids, down)` into one "train" message per SuperNode that serves
any of `cids` (the GLOBAL tensors once, as an ArrayRecord, plus the round and the client ids),
and each reply back into one `Reply` per client; `run(task, cids, down)` sends the other client
tasks (evaluate, personalize, cold_start) the same way, so every client-side stage runs on the
SuperNode that holds the client's data. No math here.

Which SuperNode serves which client: at the first call every connected SuperNode is asked (a
"query" message) for its `partition-id` and `num-partitions` (its node config); node p of n
serves the clients (training and held-out) with `cid % n == p` (n = data.num_clients: one client per node,
Flower's own convention; fewer nodes each serve several clients).

Every task carries the run's key (`run_key`), under which the nodes keep PRIVATE state: it is
the same when a run is resumed (Flower's run id is not), and the query of a resumed run tells
the nodes to roll that state back to the end of the checkpoint's round (`rollback`).

Faults never raise here: a node that does not answer before `server.round_deadline_s` gives
`late` replies; a Flower error reply for a fault (node unavailable, a crashed or out-of-memory
ClientApp, an I/O or network error) or a node that is gone gives replies with `error` set; an
ArrayRecord that cannot be read, or data that differs from the server's partition, too. The
round loop then counts, retries or skips as it does for the simulation. Every such event is
also logged to events.jsonl with the node id. A node that missed a deadline or was reported
unavailable is not asked again in this run.

Every message sent and received is weighed (records.weigh) and audited: wire.jsonl gets the
names in every ArrayRecord and a byte scan of the serialized message for every PRIVATE name.
A reply whose bytes contain a PRIVATE name is refused whole.

Errors do raise: a ClientApp that raised `faults.ClientTaskError` (its wrapper for every error a
retry would repeat: a configuration error, a node that does not serve a client, a bug) or that
could not be loaded ends the run with `faults.ClientError`, naming the node and the error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import cast

import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fedsplice.federation import SITES, Experiment, Observer, Reply, Secured, check_update, masked_rows, wire
from fedsplice.runtimes.flower import secagg
from fedsplice.runtimes.flower.faults import ClientError, fatal_reason
from fedsplice.runtimes.flower.partition import client_fingerprint, owned
from fedsplice.runtimes.flower.records import JsonLog, RecordError, decode, scan, split_bytes, to_record, weigh

GLOBAL_KEY, TASK_KEY, RESULT_KEY, UP_PREFIX = "global", "task", "result", "up."  # message contents
# run config keys (pyproject [tool.flwr.app.config]) and the ServerApp's status file
CONFIG_KEY, OUT_KEY, MIN_NODES_KEY, NODE_WAIT_KEY = "fedsplice-config", "out-dir", "min-nodes", "node-wait-s"
RESUME_KEY = "resume"  # true: continue the run in out-dir from its last checkpoint
STATUS_FILE = "flower-status.json"
# task record fields: the run's key (names the nodes' PRIVATE-state folder, the same across
# resumes) and, in the query, the round whose end the nodes roll their PRIVATE state back to
RUN_KEY_FIELD, ROLLBACK_FIELD, ROLLBACK_ERROR = "run-key", "rollback", "rollback-error"
# client task -> (Flower message type, group id prefix); fit is MessageType.TRAIN
TASK_MESSAGES = {"evaluate": (MessageType.EVALUATE, "eval"), "personalize": ("train.personalize", "personalize"),
                 "cold_start": ("train.cold_start", "cold_start"),
                 "evaluate_global": (f"{MessageType.EVALUATE}.global", "eval_global")}


class FlowerRuntimeError(RuntimeError):
    """The Flower run cannot start or go on (no nodes, nobody to evaluate); the message says why."""


class FlowerTransport:
    def __init__(self, grid, exp: Experiment, *, events: JsonLog, audit: JsonLog, min_nodes: int = 1,
                 node_wait_s: float = 300.0, say: Callable[[str], None] = print, poll_s: float = 0.5,
                 run_key: str = "", rollback: int = 0):
        self.grid, self.exp = grid, exp
        # run_key: the nodes keep PRIVATE state under it (not Flower's run id, new on each resume);
        # rollback: the query makes them restore it to the end of this round (0: a fresh start)
        self.run_key, self.rollback = run_key, rollback
        deadline = exp.cfg.server.round_deadline_s
        self.deadline = deadline if deadline > 0 else None  # None: wait for every reply
        self.min_nodes, self.node_wait_s = min_nodes, node_wait_s
        self.events, self.audit, self.say, self.poll_s = events, audit, say, poll_s
        self.owner: dict[int, int] | None = None  # cid -> node id
        self.gone: set[int] = set()  # nodes not asked again
        self.private = set(exp.private_names)
        self.like = {n: exp.init_params[n] for n in exp.global_names}
        # per-site data: the server holds none of it, so it has nothing to compare a site's with
        self.per_site = exp.cfg.data.dataset == SITES
        self.fingerprints = {} if self.per_site else {c: client_fingerprint(exp, c) for c in exp.train_ids}
        self.round = 0  # the last round trained; an evaluation is of the model after it
        # the Transport attribute; replies come per node, so a call's tasks count when it returns
        self.observer: Observer | None = None
        self._reference: dict = {}  # the GLOBAL tensors sent in the current round
        self._sent: dict[int, int] = {}  # node -> bytes of the message just sent to it
        # Flower-measured bytes vs the simulation's safetensors payload of the same tensors
        self.totals = {"messages": 0, "up_bytes": 0, "down_bytes": 0, "up_payload_bytes": 0,
                       "down_payload_bytes": 0, "up_tensors": 0, "eval_down_bytes": 0, "eval_up_bytes": 0}

    # ------------------------------------------------------------------ nodes

    def _connect(self) -> None:
        t0 = time.monotonic()
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= self.min_nodes:
                break
            if time.monotonic() - t0 > self.node_wait_s:
                raise FlowerRuntimeError(
                    f"only {len(nodes)} SuperNode(s) connected after {self.node_wait_s:.0f}s, "
                    f"{self.min_nodes} needed (runtime.num_supernodes); check the SuperNodes' logs")
            time.sleep(self.poll_s)
        self.say(f"[fedsplice] {len(nodes)} SuperNode(s) connected after {time.monotonic() - t0:.1f}s")
        parts: dict[int, tuple[int, int]] = {}
        devices: dict[int, str] = {}  # node -> its node config's device ("": runtime.device)
        extra = {ROLLBACK_FIELD: self.rollback} if self.run_key else {}
        for node, (rep, err, _) in self._exchange(MessageType.QUERY, "query", {n: [] for n in nodes},
                                                  None, 0, extra).items():
            if err:
                self._event("node_query_failed", node, [], err)
                continue
            assert rep is not None  # no error text: a reply came (_exchange)
            self._audit("up", "query", 0, node, [], rep, weigh(rep))
            rec = rep.content.config_records[RESULT_KEY]
            if self.run_key and (rec.get(ROLLBACK_ERROR) or ROLLBACK_ERROR not in rec):
                # a node that kept state of later rounds would give other numbers: stop here
                raise FlowerRuntimeError(f"SuperNode {node} could not restore its PRIVATE state to the end of "
                                         f"round {self.rollback}: {rec.get(ROLLBACK_ERROR) or 'no rollback support'!s}")
            parts[node] = (int(cast(int, rec["partition-id"])), int(cast(int, rec["num-partitions"])))
            devices[node] = str(rec.get("device", ""))
        if not parts:
            raise FlowerRuntimeError("no SuperNode answered the partition query; see events.jsonl")
        counts = sorted({n for _, n in parts.values()})
        if len(counts) > 1:
            raise FlowerRuntimeError(f"SuperNodes disagree on num-partitions: {counts}; give every "
                                     "SuperNode the same num-partitions in its --node-config")
        seen: dict[int, int] = {}
        for node, (p, _) in sorted(parts.items()):
            if p in seen:
                raise FlowerRuntimeError(f"SuperNodes {seen[p]} and {node} both have partition-id={p}")
            seen[p] = node
        everyone = self.exp.train_ids + self.exp.holdout_ids
        self.owner = {cid: node for cid in everyone for node, (p, n) in parts.items() if owned(cid, p, n)}
        unserved = [c for c in everyone if c not in self.owner]
        if unserved:
            self._event("clients_unserved", 0, unserved,
                        "no connected SuperNode has partition-id = cid % num-partitions for them; "
                        "they are treated as dropped")
        by_node: dict[int, list[int]] = {}
        for cid, node in sorted(self.owner.items()):
            by_node.setdefault(node, []).append(cid)
        for node, cids in by_node.items():
            p, n = parts[node]
            on = f" on {devices[node]}" if devices.get(node) else ""
            self.say(f"[fedsplice] SuperNode {node}: partition {p}/{n}, clients {cids}{on}")

    def _event(self, event: str, node: int, cids: list[int], detail: str, rnd: int | None = None) -> None:
        rec: dict = {"event": event}
        if rnd is not None:
            rec["round"] = rnd
        rec.update(node_id=node, cids=cids, detail=detail)
        self.events(rec)

    def _group(self, cids: list[int], kind: str, rnd: int) -> tuple[dict[int, list[int]], dict[int, str]]:
        """node -> its clients among `cids`; cid -> why it cannot be asked."""
        if self.owner is None:
            self._connect()
        assert self.owner is not None  # set by _connect
        online = set(self.grid.get_node_ids())
        by_node: dict[int, list[int]] = {}
        skipped: dict[int, str] = {}
        for cid in cids:
            node = self.owner.get(cid)
            why = ("no SuperNode serves this client" if node is None
                   else f"SuperNode {node} missed a deadline or became unavailable earlier"
                   if node in self.gone else f"SuperNode {node} is offline" if node not in online else "")
            if why:
                skipped[cid] = why
                self._event("client_skipped", node or 0, [cid], f"{kind}: {why}", rnd)
            else:
                assert node is not None  # no reason to skip: a SuperNode serves it
                by_node.setdefault(node, []).append(cid)
        return by_node, skipped

    # ------------------------------------------------------------------ messages

    def _exchange(self, kind: str, group: str, by_node: dict[int, list[int]], global_params: dict | None,
                  rnd: int, extra: dict | None = None) -> dict[int, tuple[Message | None, str, bool]]:
        """One message per node; node -> (reply, error text, late). `extra`: more task fields."""
        nodes = list(by_node)
        if not nodes:
            return {}
        record = to_record(global_params) if global_params is not None else None
        msgs = []
        self._sent = {}
        for node in nodes:
            task = {"round": rnd, "cids": list(by_node[node]), **(extra or {})}
            if self.run_key:
                task[RUN_KEY_FIELD] = self.run_key
            content = RecordDict({TASK_KEY: ConfigRecord(task)})
            if record is not None:
                content[GLOBAL_KEY] = record
            msg = Message(content, dst_node_id=node, message_type=kind, group_id=group,
                          ttl=self.deadline or 12 * 3600.0)
            w = weigh(msg)
            self._audit("down", kind, rnd, node, by_node[node], msg, w)
            self._sent[node] = w.total
            msgs.append(msg)
        out: dict[int, tuple[Message | None, str, bool]] = {}
        pending: dict[str, int] = {}
        for node, mid in zip(nodes, self.grid.push_messages(msgs)):
            if mid is None:
                out[node] = (None, f"the SuperLink refused the message to SuperNode {node}", False)
            else:
                pending[mid] = node
        self.totals["messages"] += len(msgs)
        end = None if self.deadline is None else time.monotonic() + self.deadline
        while pending and (end is None or time.monotonic() < end):
            for rep in self.grid.pull_messages(list(pending)):
                sender = pending.pop(rep.metadata.reply_to_message_id, None)
                if sender is None:
                    continue
                self.totals["messages"] += 1
                if rep.has_error():
                    fatal = fatal_reason(rep.error.code, str(rep.error.reason))
                    if fatal is not None:
                        self._event("client_error", sender, by_node[sender], f"{kind}: {fatal}", rnd)
                        raise ClientError(f"SuperNode {sender}, clients {by_node[sender]}, {kind} of round {rnd}: "
                                          f"{fatal}. A retry would repeat it, so the run stops (rounds already "
                                          f"checkpointed are kept); fix it and resume")
                    err = f"SuperNode {sender}: Flower error {rep.error.code}: {rep.error.reason}"
                    if "unavailable" in str(rep.error.reason).lower():
                        self.gone.add(sender)
                    out[sender] = (rep, err, False)
                else:
                    out[sender] = (rep, "", False)
            if pending:
                time.sleep(self.poll_s)
        for node in pending.values():
            self.gone.add(node)
            out[node] = (None, f"SuperNode {node}: no reply within server.round_deadline_s="
                         f"{self.deadline:g}s; not asked again in this run", True)
        for node, (_, err, _) in out.items():
            if err:
                self._event("reply_dropped", node, by_node[node], f"{kind}: {err}", rnd)
        return out

    def _audit(self, direction: str, kind: str, rnd: int, node: int, cids: list[int], msg: Message, w) -> list[str]:
        arrays = {k: sorted(r.keys()) for k, r in msg.content.array_records.items()} if msg.has_content() else {}
        hits = scan(w.blob, self.private)
        self.audit({"dir": direction, "kind": kind, "round": rnd, "node_id": node, "cids": cids,
                    "bytes": w.total, "records": w.per_record, "arrays": arrays, "private_hits": hits,
                    # the same scan for GLOBAL names: shows the scan sees the names that do travel
                    "global_hits": len(scan(w.blob, set(self.like)))})
        return hits

    def _result(self, kind: str, rnd: int, node: int, cids: list[int], rep: Message):
        """Weigh and audit a reply; its result table, or an error text."""
        w = weigh(rep)
        hits = self._audit("up", kind, rnd, node, cids, rep, w)
        if hits:
            return w, None, f"SuperNode {node}: the reply's serialized bytes contain PRIVATE name {hits[0]}"
        try:
            return w, json.loads(cast(str, rep.content.config_records[RESULT_KEY]["json"])), ""
        except Exception as e:  # noqa: BLE001 - a malformed reply is refused, never a crash
            return w, None, f"SuperNode {node}: malformed result record ({type(e).__name__}: {e})"

    # ------------------------------------------------------------------ the transport API

    def fit(self, rnd: int, cids: list[int], down: bytes) -> list[Reply]:
        self.round = rnd
        by_node, skipped = self._group(cids, "train", rnd)
        self._reference = wire.decode(down)
        got = self._exchange(MessageType.TRAIN, str(rnd), by_node, self._reference, rnd)
        replies: dict[int, Reply] = {c: Reply(c, b"", 0, {}, 0, 0, error=why) for c, why in skipped.items()}
        for node, (rep, err, late) in got.items():
            ncids = by_node[node]
            down_share = dict(zip(ncids, split_bytes(self._sent.get(node, 0), len(ncids))))
            self.totals["down_bytes"] += sum(down_share.values())
            self.totals["down_payload_bytes"] += len(down) * len(ncids)
            refused = False  # an error reply or a missed deadline is logged once, by _exchange
            if not err and rep is not None:
                w, res, err = self._result("train", rnd, node, ncids, rep)
                refused = bool(err)
            if err:
                if refused:
                    self._event("reply_refused", node, ncids, err, rnd)
                for c in ncids:
                    replies[c] = Reply(c, b"", 0, {}, 0, down_share[c], error="" if late else err, late=late)
                continue
            assert rep is not None  # no error text: a reply came (_exchange)
            per_client = {c: w.per_record.get(f"{UP_PREFIX}{c}", 0) for c in ncids}
            envelope = dict(zip(ncids, split_bytes(max(w.total - sum(per_client.values()), 0), len(ncids))))
            for c in ncids:
                replies[c] = self._client_reply(rnd, node, c, rep, res, per_client[c] + envelope[c], down_share[c])
        return [replies[c] for c in cids if c in replies]

    def _client_reply(self, rnd: int, node: int, cid: int, rep: Message, res: dict, up: int, down: int) -> Reply:
        info = res.get(str(cid))
        key = f"{UP_PREFIX}{cid}"
        try:
            if key not in rep.content.array_records or not isinstance(info, dict):
                raise RecordError("the reply holds no update for this client")
            # names, shapes, dtypes and values are the round loop's to check (robust.check_update)
            tensors = decode(rep.content.array_records[key], self.like)
            if not self.per_site and info.get("fingerprint") != self.fingerprints[cid]:
                raise RecordError("the SuperNode's data for this client differs from the server's partition "
                                  "(same dataset and seed on every host?)")
        except RecordError as e:
            self._event("reply_refused", node, [cid], str(e), rnd)
            return Reply(cid, b"", 0, {}, up, down, error=f"SuperNode {node}: {e}")
        reason = check_update(tensors, self._reference, self.private)
        if reason:  # the round loop refuses it too (and counts it); here it is logged with the node id
            self._event("reply_invalid", node, [cid], reason, rnd)
        payload = wire.encode(tensors)
        self.totals["up_bytes"] += up
        self.totals["up_payload_bytes"] += len(payload)
        self.totals["up_tensors"] += len(tensors)
        # FedAvg's weight: the site's own count (per-site data), else the server's partition (fingerprinted)
        n = int(info.get("num_examples", 0)) if self.per_site else len(self.exp.clients[cid].train_idx)
        return Reply(cid, payload, n, info.get("stats", {}), up, down)

    def fit_secure(self, rnd: int, cids: list[int], down: bytes) -> Secured:
        """`fit` through Flower's SecAgg+ (`secagg`): one client per SuperNode; the round's mean
        delta, weighted 1 per client under DP's fixed weights, else by sample count."""
        self.round = rnd
        by_node, skipped = self._group(cids, "train", rnd)
        for node, ncids in by_node.items():
            if len(ncids) > 1:
                raise FlowerRuntimeError(f"privacy.secure_aggregation sums one client per SuperNode, and SuperNode "
                                         f"{node} serves clients {ncids}: start one SuperNode per training client")
        names, fixed, self._reference = self.exp.global_names, self.exp.privacy is not None, wire.decode(down)
        cid_of = {node: ncids[0] for node, ncids in by_node.items()}
        sizes = [len(self.exp.clients[c].train_idx) for c in cid_of.values()]
        tasks = {node: {"round": rnd, "cid": cid, "fixed": fixed, **({RUN_KEY_FIELD: self.run_key} if self.run_key
                                                                      else {})} for node, cid in cid_of.items()}
        watch = secagg.Watch(lambda d, node, msg, w: self._audit(d, "secagg", rnd, node, by_node.get(node, []), msg, w))
        max_weight = 1.0 if fixed else float(max(sizes)) if sizes and not self.per_site else 1000.0
        out = secagg.run(self.grid, rnd, secagg.fit_ins([self._reference[n].numpy() for n in names], tasks),
                         self.exp.cfg.privacy, max_weight, self.deadline, watch)
        self.totals["messages"] += watch.messages
        if watch.fatal:
            raise ClientError(f"round {rnd} (SecAgg+): {watch.fatal[0]}. A retry would repeat it, so the run stops")
        replies = [Reply(c, b"", 0, {}, 0, 0, error=why) for c, why in skipped.items()]
        rows, reason = [], ""
        eps = self.exp.privacy.epsilon(rnd) if self.exp.privacy is not None else None
        for node, cid in cid_of.items():
            res, (dn, up) = out.results.get(node), watch.bytes[node]
            self.totals["up_bytes"] += up
            self.totals["down_bytes"] += dn
            if res is None:
                replies.append(Reply(cid, b"", 0, {}, up, dn, error=f"SuperNode {node} left the SecAgg+ round"))
                continue
            if not self.per_site and res.get("fingerprint") != self.fingerprints[cid]:
                reason = reason or f"SuperNode {node}: its data for client {cid} differs from the server's partition"
            rows += masked_rows(watch.masked[node], names, rnd, cid, eps, res["stats"].get("dp_local_epsilon"))
            replies.append(Reply(cid, b"", int(res["num_examples"]), res["stats"], up, dn))
        mean = None if out.mean is None else {n: torch.from_numpy(a) for n, a in zip(names, out.mean, strict=True)}
        return Secured(replies, mean, rows, reason or ("" if mean is not None else "SecAgg+ halted: too few nodes"))

    def run(self, task: str, cids: list[int], down: bytes) -> dict[int, dict]:
        """Client task `task` on the nodes that serve `cids`: {cid: result} for those that answered."""
        rnd = self.round
        kind, group = TASK_MESSAGES[task]
        by_node, _ = self._group(cids, task, rnd)
        got = self._exchange(kind, f"{group}-{rnd}", by_node, wire.decode(down), rnd)
        results: dict[int, dict] = {}
        for node, (rep, err, _) in got.items():
            ncids = by_node[node]
            self.totals["eval_down_bytes"] += self._sent.get(node, 0)
            if err:
                continue
            assert rep is not None  # no error text: a reply came (_exchange)
            w, res, err = self._result(kind, rnd, node, ncids, rep)
            self.totals["eval_up_bytes"] += w.total
            if err:
                self._event("reply_refused", node, ncids, err, rnd)
                continue
            for cid in ncids:
                m = res.get(str(cid), {}).get("metrics")
                if isinstance(m, dict):
                    results[cid] = m
        missing = [c for c in cids if c not in results]
        if missing:
            detail = (f"PM after round {rnd} averages {len(results)} of {len(cids)} clients" if task == "evaluate"
                      else f"{task} after round {rnd}: {len(results)} of {len(cids)} clients answered")
            self._event("pm_partial" if task == "evaluate" else f"{task}_partial", 0, missing, detail, rnd)
        if not results:
            raise FlowerRuntimeError(f"{task} after round {rnd}: no SuperNode answered; see events.jsonl")
        return {c: results[c] for c in cids if c in results}
