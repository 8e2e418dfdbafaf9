"""One round's replies: ask the sampled clients through the transport, validate every reply
(`fedsplice.core.robust`), and retry the missing ones while too few were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from fedsplice.core import wire
from fedsplice.core.robust import check_stats, check_update, check_weight
from fedsplice.core.server import Params
from fedsplice.federation.calls import ask

if TYPE_CHECKING:
    from fedsplice.federation.ledger import Row

Event = dict[str, object]  # {"client", "event": dropped|late|rejected, "reason", "attempt"}


class Upload(Protocol):
    """What gather reads of a reply (federation.rounds.Reply, which imports this module)."""

    cid: int
    payload: bytes
    num_examples: int
    stats: dict[str, float]
    up_bytes: int
    down_bytes: int
    error: str
    late: bool


@dataclass
class Gathered:
    """What the server kept from one round: the accepted uploads (decoded, in client-id order,
    so the aggregate does not depend on arrival order) and an event per client that failed."""

    accepted: list[tuple[Upload, Params]]  # (reply, decoded GLOBAL tensors)
    events: list[Event]
    up_bytes: int
    down_bytes: int
    attempts: int

    def count(self, event: str) -> int:
        return sum(e["event"] == event for e in self.events)


# transport: a rounds.Transport (rounds imports this module); `ask` calls it
def gather(transport: object, rnd: int, cids: list[int], down: bytes, reference: Params, private: set[str], *,
           min_replies: int, max_retries: int, norm_bound: float) -> Gathered:
    """Ask `cids` for updates, validate every reply, and ask again (at most `max_retries` times)
    the clients without a valid one while fewer than `min_replies` were accepted.

    Transport-agnostic: a reply may be missing (dropped), carry an `error` (dropped, with the
    reason), be `late` (after the deadline), or fail validation (rejected: never asked again
    this round). Nothing here raises on a client's behalf.
    """
    accepted: dict[int, tuple[Upload, Params]] = {}
    refused: set[int] = set()
    events: list[Event] = []
    up = dn = 0
    pending = list(cids)
    attempt = 0
    for attempt in range(max_retries + 1):
        replies = ask(transport, "fit", pending, down, rnd)
        seen: set[int] = set()

        def event(cid: object, kind: str, reason: str) -> None:
            # called within this iteration only, so `attempt` is this attempt's number
            events.append({"client": cid, "event": kind, "reason": reason, "attempt": attempt})  # noqa: B023

        for r in replies:
            cid = getattr(r, "cid", None)
            if cid not in pending or cid in seen:
                event(cid, "rejected", "reply from a client that was not asked (or a duplicate)")
                continue
            seen.add(cid)
            up += int(getattr(r, "up_bytes", 0) or 0)
            dn += int(getattr(r, "down_bytes", len(down)) or 0)
            if getattr(r, "error", ""):
                event(cid, "dropped", str(r.error))
                continue
            if getattr(r, "late", False):
                event(cid, "late", "replied after the round deadline")
                continue
            reason: str | None
            try:
                tensors = wire.decode_update(r.payload, reference)
            except Exception as e:  # a hostile payload must not stop the round
                reason = f"undecodable payload ({type(e).__name__})"
            else:
                reason = (check_weight(r.num_examples) or check_stats(r.stats)
                          or check_update(tensors, reference, private, norm_bound))
            if reason:
                event(cid, "rejected", reason)
                refused.add(cid)
            else:
                accepted[cid] = (r, tensors)
        for cid in pending:
            if cid not in seen:
                event(cid, "dropped", "no reply")
                dn += len(down)  # it was sent
        pending = [c for c in pending if c not in accepted and c not in refused]
        if len(accepted) >= min_replies or not pending:
            break
    return Gathered([accepted[c] for c in sorted(accepted)], events, up, dn, attempt + 1)


@dataclass
class Secured:
    """A secure-aggregation round as a transport returns it (`fit_secure`): the server holds the
    sum of the uploads, never one of them."""

    # a Reply per asked client: in the sum (payload b"", its stats and weight), or error / late
    replies: Sequence[Upload]
    mean: dict[str, torch.Tensor] | None  # the decoded weighted mean of the summed GLOBAL deltas; None: failed
    ledger: list[Row]  # the server's view: the rows of the masked vectors it received
    reason: str = ""  # why there is no mean


def secure_gather(transport: object, rnd: int, cids: list[int], down: bytes,
                  reference: Params) -> tuple[Gathered, dict[str, torch.Tensor] | None, list[Row]]:
    """One secure-aggregation round (`transport.fit_secure`): what it summed, the mean delta, and the
    server's ledger rows. Nothing is retried (a new round of the protocol would be needed), and a
    client cannot be taken out of the sum: stats that fail validation, or a mean with other names,
    shapes or non-finite values, refuse the whole round (skipped)."""
    s: Secured = ask(transport, "fit_secure", cids, down, rnd)
    events: list[Event] = []
    accepted: list[tuple[Upload, Params]] = []
    up = dn = 0
    for r in s.replies:
        up, dn = up + r.up_bytes, dn + r.down_bytes
        if r.error or r.late:
            events.append({"client": r.cid, "event": "late" if r.late else "dropped",
                           "reason": "replied after the round deadline" if r.late else r.error, "attempt": 0})
        else:
            accepted.append((r, {}))
    reason = s.reason or next((f"client {r.cid}: {why}" for r, _ in accepted
                               if (why := check_weight(r.num_examples) or check_stats(r.stats))), "")
    mean = s.mean
    if not reason and mean is not None:
        if set(mean) != set(reference) or any(mean[n].shape != reference[n].shape for n in reference):
            reason = "the secure aggregate's tensors differ from the GLOBAL tensors sent"
        elif not all(bool(torch.isfinite(t).all()) for t in mean.values()):
            reason = "the secure aggregate is not finite (a client sent non-finite values)"
    if reason or mean is None:
        events.append({"client": None, "event": "rejected", "attempt": 0,
                       "reason": f"secure aggregation: {reason or 'no aggregate'}; the round is skipped"})
        accepted, mean = [], None
    return Gathered(sorted(accepted, key=lambda a: a[0].cid), events, up, dn, 1), mean, s.ledger
