"""The in-process runtime: every client task runs in this process, one after another, on one
backbone. It only moves tasks and results (`fedsplice.federation`): no math here.

Injected failures (`[faults]`) are drawn per (seed, round, attempt, client) from their own
stream, so a resumed run fails the same clients. A dropped or late client does not run at all:
its PRIVATE state does not advance (the server cancels a late client's task at the deadline,
so its work is discarded whole).
"""

from __future__ import annotations

from collections.abc import Callable

from fedsplice.federation import (
    FAULTS,
    Observer,
    Reply,
    client_task,
    evaluate_batched,
    fit_client,
    fit_together,
    rng,
    wire,
)
from fedsplice.federation import run_rounds as federation_run_rounds


def injected_fault(cfg, rnd: int, attempt: int, cid: int) -> str:
    """The fault `[faults]` injects into client `cid`'s fit in this attempt of round `rnd`:
    "dropout", "late" or "" (none). Every runtime that simulates faults draws them here."""
    f, deadline = cfg.faults, cfg.server.round_deadline_s
    if f.dropout <= 0 and f.straggler <= 0:
        return ""
    u_drop, u_slow = rng(cfg, FAULTS, rnd, attempt, cid).random(2)
    if u_drop < f.dropout:
        return "dropout"
    if u_slow < f.straggler and 0 < deadline < f.straggler_delay_s:
        return "late"
    return ""


class FaultPlan:
    """Which of a fit call's clients fail, as replies that stand in for them: the attempt count
    per round (a retry draws anew) and the replies of dropped and late clients."""

    def __init__(self, cfg):
        self.cfg = cfg
        self._attempts: dict[int, int] = {}  # round -> fit calls so far

    def failed(self, rnd: int, cids: list[int], down: bytes) -> dict[int, Reply]:
        attempt = self._attempts.get(rnd, 0)
        self._attempts[rnd] = attempt + 1
        out = {}
        for cid in cids:
            fault = injected_fault(self.cfg, rnd, attempt, cid)
            if fault:
                out[cid] = Reply(cid, b"", 0, {}, 0, len(down), error="" if fault == "late" else
                                 "dropout (simulated)", late=fault == "late")
        return out


class InProcess:
    """`observer.client_done(task)`, if an observer is given, as each client task ends."""

    def __init__(self, exp, store, observer: Observer | None = None):
        self.exp, self.store, self.observer = exp, store, observer
        self.faults = FaultPlan(exp.cfg)

    def fit(self, rnd: int, cids: list[int], down: bytes) -> list[Reply]:
        failed = self.faults.failed(rnd, cids, down)
        ok = [c for c in cids if c not in failed]
        # runtime.batch_train: the round's clients trained together, their replies in the same order
        obs = self.observer
        tick = None if obs is None else lambda: obs.client_done("fit")  # a progress tick as each client ends
        together = {}
        if self.exp.batch_train and ok:  # every client failed: nothing to train
            together = dict(zip(ok, fit_together(self.exp, self.store, ok, rnd, down, tick)))
        out = []
        for cid in cids:
            if cid in failed:
                out.append(failed[cid])
                continue
            up, st = together[cid] if cid in together else fit_client(self.exp, self.store, cid, rnd, down)
            out.append(Reply(cid, up, len(self.exp.clients[cid].train_idx), st, len(up), len(down)))
            if self.observer is not None and cid not in together:  # (together: ticked as each finished)
                self.observer.client_done("fit")
        return out

    def run(self, task: str, cids: list[int], down: bytes) -> dict[int, dict]:
        g = wire.decode(down)
        if task == "evaluate" and self.exp.batch_eval and cids:  # every PM in one pass (runtime.batch_eval)
            got = evaluate_batched(self.exp, self.store, cids, g)
            for _ in cids:
                if self.observer is not None:
                    self.observer.client_done(task)
            return got
        out = {}
        for c in cids:
            out[c] = client_task(task, self.exp, self.store, c, g)
            if self.observer is not None:
                self.observer.client_done(task)
        return out


def run_rounds(exp, store, on_round: Callable[[dict], None], **kwargs) -> dict:
    """`fedsplice.federation.run_rounds` on this runtime (a notebook's or a test's shortcut)."""
    if kwargs.get("transport") is None:
        kwargs["transport"] = InProcess(exp, store, kwargs.pop("observer", None))
    return federation_run_rounds(exp, on_round, **kwargs)
