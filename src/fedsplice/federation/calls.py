"""A transport's calls as the round loop makes them, seen by the run's observer (the progress
display): `ask` tells it when a call begins and ends; a runtime that can tell also reports each
client task as it ends (`Observer.client_done`, through its `observer` attribute). Observing
changes nothing: the same call with or without an observer returns the same."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Observer(Protocol):
    def begin(self, task: str, rnd: int, cids: list[int]) -> None:
        """A call of `task` ("fit": round `rnd`'s training; else a client task) for `cids` begins."""

    def client_done(self, task: str) -> None:
        """One client task has ended (where the runtime can tell: InProcess, Workers)."""

    def end(self, task: str, cids: list[int]) -> None:
        """The call has returned (the tasks the runtime did not report count now)."""


# transport: a rounds.Transport (which imports this module), SecAgg+ ones with fit_secure; the result is what
# the call returns: [Reply] for "fit", a gather.Secured for "fit_secure", else {cid: the task's result}
def ask(transport: Any, task: str, cids: list[int], down: bytes, rnd: int = 0) -> Any:
    """`transport.fit(rnd, cids, down)` for task "fit" (`fit_secure` for "fit_secure": a SecAgg+
    round), else `transport.run(task, cids, down)`, told to the transport's observer (its
    `observer` attribute, None: no one watches; it sees a SecAgg+ round as a "fit")."""
    observer = getattr(transport, "observer", None)
    seen = "fit" if task == "fit_secure" else task
    if observer is not None:
        observer.begin(seen, rnd, cids)
    try:
        if task == "fit_secure":
            return transport.fit_secure(rnd, cids, down)
        return transport.fit(rnd, cids, down) if task == "fit" else transport.run(task, cids, down)
    finally:
        if observer is not None:
            observer.end(seen, cids)
