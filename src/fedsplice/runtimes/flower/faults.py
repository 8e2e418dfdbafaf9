"""Which client errors end a Flower run and which count as a dropout.

A fault is something a retry or another node may not repeat: the node is unreachable, the
ClientApp process crashed or ran out of memory, a disk or network call failed. The round loop
counts those as dropouts. Everything else a client task raises (a configuration error, a node
asked for a client it does not serve, a bug) happens again on every retry and every round;
counted as a dropout it would skip the rounds silently and the run would "complete". So the
ClientApp re-raises such errors as `ClientTaskError`; Flower carries the class name in its error
reason, and the server's transport raises `ClientError`, which stops the run with the node's
error text (rounds already checkpointed stay: the run can be resumed once it is fixed).
"""

from __future__ import annotations

import errno
import functools
import re

import torch
from flwr.common.constant import ErrorCode

from fedsplice.errors import FedspliceError

# I/O errors that come from the host, not from the config or the code
_HOST_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EDQUOT, errno.ENOMEM, errno.EAGAIN}
_REASON = re.compile(r"^<class '[^']*'>:<'(.*)'>$", re.S)  # Flower's "<class 'X'>:<'message'>"


class ClientTaskError(RuntimeError):
    """Raised by the ClientApp for an error that a retry repeats (see the module docstring)."""


class ClientError(FedspliceError):
    """A client task failed on its node with an error a retry repeats: the run stops."""


def is_fault(e: BaseException) -> bool:
    """True for an error of the host (memory, network, disk), which counts as a dropout."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError, ConnectionError, TimeoutError, InterruptedError)):
        return True
    return isinstance(e, OSError) and e.errno in _HOST_ERRNOS


def classified(handler):
    """A ClientApp handler whose non-fault errors become `ClientTaskError` ("Type: message")."""
    @functools.wraps(handler)
    def run(*args, **kwargs):
        try:
            return handler(*args, **kwargs)
        except Exception as e:
            if is_fault(e) or isinstance(e, ClientTaskError):
                raise
            raise ClientTaskError(f"{type(e).__name__}: {e}") from e
    return run


def fatal_reason(code: int, reason: str) -> str | None:
    """The error text of a Flower error reply that must end the run; None for a fault (a dropout)."""
    if code == ErrorCode.LOAD_CLIENT_APP_EXCEPTION:
        return f"the SuperNode could not load fedsplice's ClientApp ({reason}); check its install"
    if code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION and f".{ClientTaskError.__name__}'>" in reason:
        m = _REASON.match(reason)
        return m.group(1) if m else reason
    return None
