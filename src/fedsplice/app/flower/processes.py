"""The processes of a local Flower deployment: started ones, their descendants, and teardown.

Process trees, liveness and pid-reuse checks come from psutil: a `psutil.Process` remembers
its start time, so a signal never reaches a process that merely inherited a recorded pid.

Teardown (`stop_procs`): every process started, its process group, every descendant seen
while it ran, and any process whose environment carries the run's FEDSPLICE_FLOWER_TAG get
SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

TAG_VAR = "FEDSPLICE_FLOWER_TAG"
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def handle(pid: int) -> psutil.Process | None:
    """A psutil handle on `pid` (it records the start time), or None if it is gone."""
    try:
        return psutil.Process(pid)
    except _GONE:
        return None


def alive(p: psutil.Process | None) -> bool:
    """Running (the same process, not a reused pid) and not a zombie."""
    try:
        return p is not None and p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except _GONE:
        return False


def send(p: psutil.Process | None, sig: int) -> None:
    """Signal `p` unless it is gone (psutil refuses a pid that was reused meanwhile)."""
    if p is None:
        return
    with contextlib.suppress(*_GONE):
        p.send_signal(sig)


def tagged(tag: str) -> list[psutil.Process]:
    """Live processes whose environment holds FEDSPLICE_FLOWER_TAG=tag (zombies excluded)."""
    me, out = os.getpid(), []
    for p in psutil.process_iter():
        if p.pid == me:
            continue
        try:
            if p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (*_GONE, OSError):
            continue
    return out


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    seen: dict[int, psutil.Process] = field(default_factory=dict)  # descendants ever seen
    handle: psutil.Process | None = None  # the process itself, taken at start

    def __post_init__(self) -> None:
        if self.handle is None:
            self.handle = handle(self.popen.pid)  # our unreaped child: it cannot be gone yet

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def remember(self) -> None:
        """Record its descendants now, to signal them later even if they leave its tree."""
        try:  # is_running: not a reaped pid that another process took meanwhile
            kids = self.handle.children(recursive=True) if self.handle and self.handle.is_running() else []
        except _GONE:
            return
        for k in kids:
            self.seen.setdefault(k.pid, k)

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def killpg(self, sig: int) -> None:
        """`sig` to its process group (each was started in its own session = group)."""
        with contextlib.suppress(OSError):
            os.killpg(self.pid, sig)

    def kill_tree(self, sig: int) -> None:
        """`sig` to its group and to every descendant seen, also those that left the group."""
        self.remember()
        self.killpg(sig)
        for p in self.seen.values():
            send(p, sig)


def stop_procs(procs: list[Proc], tag: str | None, grace: float = 8.0) -> list[int]:
    """SIGTERM everything started (groups, descendants, tagged), SIGKILL what is left; returns
    the pids still alive afterwards (should be [])."""
    for p in procs:
        if p.alive():
            p.remember()

    def everyone() -> list[psutil.Process]:
        out = [q for p in procs for q in (p.handle, *p.seen.values()) if q is not None]
        return out + (tagged(tag) if tag else [])

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.alive():
                p.killpg(sig)
        for q in everyone():
            send(q, sig)
        t0 = time.monotonic()
        while time.monotonic() - t0 < (grace if sig == signal.SIGTERM else 3.0):
            for p in procs:
                p.popen.poll()  # reap our own children
            if not any(alive(q) for q in everyone()):
                break
            time.sleep(0.1)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=1)
    return [q.pid for q in everyone() if alive(q)]
