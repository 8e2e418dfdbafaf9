"""Parallel clients in simulation (`runtime.workers = N`): N persistent worker processes.

Each worker is spawned (not forked: torch and fork do not mix), builds the experiment once from
the run's config (data, model, caches) on its own device (`runtime.devices[i]`, cycled; else
`runtime.device`) with its share of the cores as torch threads (`runtime.threads`, else
cores // N), and then serves client tasks until it is closed. Client c is always served by
worker c % N, so its PRIVATE state lives there: in that worker's memory store, or in the run's
disk store, which the workers share (each writes only its own clients' files). The main process
keeps its own model for the global evaluation (GM), as with `InProcess`.

A round's clients go to their workers at once and train concurrently; the replies come back in
the order the clients were asked, as `InProcess` returns them, and injected faults are drawn by
the same `FaultPlan`. Training randomness is keyed by (seed, round, client), so which process
runs a client does not change what it computes: metrics equal `workers = 1` (tests/test_workers.py).

What crosses the pipes is JSON and safetensors, never pickle (docs/design.md §8): a message is a JSON
header followed by the byte blobs it announces. A worker that fails reports its error, which the
main process raises as one line (a FedspliceError as itself, anything else as WorkerError, the
worker's traceback attached as a note); a worker that dies is seen through its process sentinel.
Workers ignore Ctrl-C (the main process stops them: `close`, also on errors) and, on Linux, die
with the main process, so a killed run leaves no worker writing into its run directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import traceback
from multiprocessing import get_context
from multiprocessing.connection import wait
from pathlib import Path

import tomli_w
import torch

from fedsplice import errors
from fedsplice.errors import ConfigError, FedspliceError
from fedsplice.federation import (
    DiskStore,
    Observer,
    Reply,
    build,
    client_task,
    config_from_text,
    fit_client,
    make_store,
    wire,
)
from fedsplice.runtimes.inprocess import FaultPlan

STOP_S = 10.0  # after `close`, how long an idle worker gets to exit before it is terminated


class WorkerError(FedspliceError):
    """A worker process failed or died (one line; the worker's traceback, if any, as a note)."""


def check_workers(cfg, make_transport=None) -> None:
    """runtime.workers > 1 is the simulation's: a deployment (Flower, `make_transport`) runs its
    clients on its own nodes."""
    if cfg.runtime.workers > 1 and (cfg.runtime.kind != "simulation" or make_transport is not None):
        raise ConfigError(f"runtime.workers = {cfg.runtime.workers} runs clients in parallel processes in the "
                          f"simulation only; on Flower every SuperNode is a process of its own: set "
                          f"runtime.workers = 1 and runtime.num_supernodes (or `fedsplice flower up --supernodes N`)")


def worker_device(cfg, i: int) -> str:
    devs = cfg.runtime.devices
    return devs[i % len(devs)] if devs else cfg.runtime.device


def worker_threads(cfg) -> int:
    """torch threads per worker: runtime.threads, else this machine's cores shared out."""
    if cfg.runtime.threads:
        return cfg.runtime.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // cfg.runtime.workers)


def worker_config(cfg, i: int) -> str:
    """Worker i's config as TOML text: the run's, on the worker's device and threads."""
    d = dataclasses.asdict(cfg)
    d["runtime"].update(device=worker_device(cfg, i), devices=[], threads=worker_threads(cfg))
    return tomli_w.dumps(d)


# --------------------------------------------------------------------------- messages


def _plain(x):
    if hasattr(x, "tolist"):  # numpy scalars and arrays in a task's result
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def send(conn, head: dict, blobs: tuple[bytes, ...] = ()) -> None:
    conn.send_bytes(json.dumps({**head, "blobs": len(blobs)}, default=_plain).encode())
    for b in blobs:
        conn.send_bytes(b)


def recv(conn) -> tuple[dict, list[bytes]]:
    head = json.loads(conn.recv_bytes())
    return head, [conn.recv_bytes() for _ in range(head.pop("blobs"))]


# --------------------------------------------------------------------------- the worker side


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the main process dies (a killed run leaves no worker)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def handle(exp, store, head: dict, blobs: list[bytes], conn) -> None:
    """Serve one request: an "item" message per client (or per answer), then "end"."""
    op = head["op"]
    if op == "fit":
        for cid in head["cids"]:
            up, st = fit_client(exp, store, cid, head["round"], blobs[0])
            send(conn, {"op": "item", "cid": cid, "n": len(exp.clients[cid].train_idx), "stats": st}, (up,))
    elif op == "run":
        g = wire.decode(blobs[0])
        for cid in head["cids"]:
            send(conn, {"op": "item", "cid": cid, "result": client_task(head["task"], exp, store, cid, g)})
    elif op == "get":
        st = store.get(head["cid"])
        send(conn, {"op": "item", "cid": head["cid"]}, () if st is None else (wire.encode(st),))
    elif op == "put":
        store.put(head["cid"], wire.decode(blobs[0]))
    elif op == "clients":
        send(conn, {"op": "item", "cids": store.clients()})
    else:
        raise ValueError(f"unknown request {op!r}")
    send(conn, {"op": "end"})


def _report(conn, e: BaseException) -> None:
    with contextlib.suppress(OSError):  # the main process may be gone
        send(conn, {"op": "error", "type": type(e).__name__, "fedsplice": isinstance(e, FedspliceError),
                    "message": str(e), "traceback": traceback.format_exc()})


def serve(parent: int, cfg_text: str, threads: int, store_root: str, ledger: str, conn) -> None:
    """A worker process: build the experiment once, then serve requests until "close" (or the
    main process goes away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process stops us
    _die_with_parent(parent)
    try:
        torch.set_num_threads(threads)
        exp = build(config_from_text(cfg_text))
        exp.ledger = Path(ledger) if ledger else None  # the clients' side of the ledger is written here
        store = make_store("disk", Path(store_root)) if store_root else make_store("memory", Path())
        send(conn, {"op": "end"})
    except BaseException as e:  # noqa: BLE001 - reported to the main process, which raises it
        _report(conn, e)
        return
    while True:
        try:
            head, blobs = recv(conn)
        except (EOFError, OSError):
            return
        if head["op"] == "close":  # exit now: a model's teardown takes seconds, and nothing is left to save
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        try:
            handle(exp, store, head, blobs, conn)
        except Exception as e:  # noqa: BLE001 - the same
            _report(conn, e)


# --------------------------------------------------------------------------- the main side


class WorkerStore:
    """The clients' PRIVATE state in the workers' memory stores (client c on worker c % N), read
    and written from the main process: what the runner checkpoints and restores on resume."""

    def __init__(self, workers: Workers):
        self.workers = workers

    def get(self, cid: int) -> dict | None:
        (head, blobs), = self.workers.ask(cid % self.workers.n, {"op": "get", "cid": cid}, (),
                                          f"the state of client {cid}")
        return wire.decode(blobs[0]) if blobs else None

    def put(self, cid: int, state: dict) -> None:
        self.workers.ask(cid % self.workers.n, {"op": "put", "cid": cid}, (wire.encode(state),),
                         f"restoring client {cid}")

    def clients(self) -> list[int]:
        out: list[int] = []
        for i in range(self.workers.n):
            (head, _), = self.workers.ask(i, {"op": "clients"}, (), "listing its clients")
            out += head["cids"]
        return sorted(out)


class Workers:
    """The transport of `runtime.workers` processes (interface: `InProcess`). `store`: the run's
    store; a disk store is shared with the workers, a memory store's clients move into the
    workers' memory. Use `.store` from then on (the runner checkpoints it), and `close()` (or
    `with`) at the end. `observer.client_done(task)`, if an observer is given, as each client
    task's reply arrives."""

    def __init__(self, exp, store=None, observer: Observer | None = None):
        cfg = exp.cfg
        self.exp, self.observer, self.n = exp, observer, cfg.runtime.workers
        self.faults = FaultPlan(cfg)
        self._procs: list = []
        self._conns: list = []
        shared = store if isinstance(store, DiskStore) else None
        try:
            self._start(cfg, str(shared.root) if shared is not None else "", str(exp.ledger or ""))
            self.store = shared if shared is not None else WorkerStore(self)
            for cid in (store.clients() if store is not None and shared is None else ()):
                self.store.put(cid, store.get(cid))
        except BaseException:
            self.close(now=True)
            raise

    def _start(self, cfg, store_root: str, ledger: str) -> None:
        ctx = get_context("spawn")
        for i in range(self.n):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=serve, name=f"fedsplice-worker-{i}", daemon=True,
                            args=(os.getpid(), worker_config(cfg, i), worker_threads(cfg), store_root, ledger, theirs))
            p.start()
            theirs.close()
            self._procs.append(p)
            self._conns.append(mine)
        self._gather({i: "its start (building the experiment)" for i in range(self.n)}, lambda i, h, b: None)

    # ----------------------------------------------------------------------- transport

    def fit(self, rnd: int, cids: list[int], down: bytes) -> list[Reply]:
        failed = self.faults.failed(rnd, cids, down)
        got: dict[int, Reply] = {}

        def item(i: int, head: dict, blobs: list[bytes]) -> None:
            c, up = head["cid"], blobs[0]
            got[c] = Reply(c, up, head["n"], head["stats"], len(up), len(down))
            if self.observer is not None:
                self.observer.client_done("fit")

        self._dispatch({"op": "fit", "round": rnd}, [c for c in cids if c not in failed], down, item,
                       f"round {rnd} (fit)")
        return [failed[c] if c in failed else got[c] for c in cids]

    def run(self, task: str, cids: list[int], down: bytes) -> dict[int, dict]:
        out: dict[int, dict] = {}

        def item(i: int, head: dict, blobs: list[bytes]) -> None:
            out[head["cid"]] = head["result"]
            if self.observer is not None:
                self.observer.client_done(task)

        self._dispatch({"op": "run", "task": task}, cids, down, item, f"the {task} task")
        return {c: out[c] for c in cids}

    def ask(self, i: int, head: dict, blobs: tuple[bytes, ...], what: str) -> list[tuple[dict, list[bytes]]]:
        """One request to worker i; its items."""
        items = []
        self._send(i, head, blobs, what)
        self._gather({i: what}, lambda _, h, b: items.append((h, b)))
        return items

    # ----------------------------------------------------------------------- plumbing

    def _dispatch(self, head: dict, cids: list[int], down: bytes, on_item, what: str) -> None:
        """Each worker gets its clients (in the order given), all at once; then every reply is read."""
        parts: dict[int, list[int]] = {}
        for c in cids:
            parts.setdefault(c % self.n, []).append(c)
        for i, mine in parts.items():
            self._send(i, {**head, "cids": mine}, (down,), what)
        self._gather({i: what for i in parts}, on_item)

    def _send(self, i: int, head: dict, blobs: tuple[bytes, ...], what: str) -> None:
        try:
            send(self._conns[i], head, blobs)
        except OSError:
            raise self._died(i, what) from None

    def _gather(self, busy: dict[int, str], on_item) -> None:
        """Read the busy workers' messages as they come until each has said "end"; a worker's
        error or death raises (the caller closes the pool)."""
        while busy:
            wait([self._conns[i] for i in busy] + [self._procs[i].sentinel for i in busy])
            for i in list(busy):
                conn = self._conns[i]
                while i in busy and conn.poll():
                    try:
                        head, blobs = recv(conn)
                    except (EOFError, OSError):
                        raise self._died(i, busy[i]) from None
                    if head["op"] == "error":
                        raise self._error(i, head, busy[i])
                    if head["op"] == "end":
                        del busy[i]
                    else:
                        on_item(i, head, blobs)
                if i in busy and not self._procs[i].is_alive() and not conn.poll():
                    raise self._died(i, busy[i])

    def _error(self, i: int, head: dict, what: str) -> FedspliceError:
        if head["fedsplice"] and isinstance(getattr(errors, head["type"], None), type):
            e = getattr(errors, head["type"])(head["message"])  # ConfigError, AssetError, ...: as themselves
        else:
            e = WorkerError(f"worker {i} failed during {what}: {head['type']}: {head['message']}".replace("\n", " "))
        e.add_note(f"worker {i}'s traceback:\n{head['traceback']}")
        return e

    def _died(self, i: int, what: str) -> WorkerError:
        p = self._procs[i]
        p.join(1.0)
        code = p.exitcode
        why = (f"was killed by signal {-code}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
               if code is not None and code < 0 else f"exited with code {code}")
        return WorkerError(f"worker {i} (pid {p.pid}) {why} during {what}; its log is above, if it printed one")

    def close(self, now: bool = False) -> None:
        """Stop the workers: ask them to exit (at once when `now`: after an error or Ctrl-C,
        mid-task), then terminate, then kill whatever is left. Safe to call twice."""
        procs, conns = self._procs, self._conns
        self._procs, self._conns = [], []
        for p, c in zip(procs, conns):
            if not now and p.is_alive():
                with contextlib.suppress(OSError):
                    send(c, {"op": "close"})
        deadline = time.monotonic() + (0.0 if now else STOP_S)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.close(now=exc[0] is not None)

    def __del__(self):  # a pool dropped without close (a library user's): no orphans
        if getattr(self, "_procs", None):
            self.close(now=True)
