"""Per-test timeouts that fail the test, never the run (a pytest plugin; tests/conftest.py uses it).

pytest-timeout's `signal` method raises `Failed` from its SIGALRM handler wherever the main
thread happens to be. Two places are fatal there:
- inside a gc callback (hypothesis registers one): CPython reports the exception as unraisable
  and drops it, and on 3.11.7 an allocation inside the AST constructor that ran the collection
  then fails with `SystemError: AST constructor recursion depth mismatch`, which ended the whole
  run with INTERNALERROR (issue 46);
- inside a property test: hypothesis catches `Failed` as a test failure and shrinks, running the
  overrun test again and again.
So this timer waits until the main thread is out of every gc callback, and raises `TestTimeout`,
a BaseException that hypothesis does not catch (it stops at once) and pytest records as that
test's failure. Were it still swallowed (a `__del__`, a weakref callback), it fires again.
"""

from __future__ import annotations

import gc
import signal
import threading

import pytest

RETRY_S = 0.05  # a gc callback returns within microseconds; look again soon after
REFIRE_S = 5.0  # the raise was swallowed: raise again


class TestTimeout(BaseException):
    """A test ran past its timeout (not an Exception: see the module docstring)."""

    __test__ = False  # not a test class, despite its name


def in_gc_callback(frame) -> bool:
    """Whether `frame` or one of its callers is a function registered in gc.callbacks."""
    codes = {getattr(getattr(cb, "__func__", cb), "__code__", None) for cb in gc.callbacks}
    codes.discard(None)
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item, settings):
    """Replaces pytest-timeout's `signal` timer (the default on Linux); other methods stay its own."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        if in_gc_callback(frame):
            signal.setitimer(signal.ITIMER_REAL, RETRY_S)
            return
        signal.setitimer(signal.ITIMER_REAL, REFIRE_S)
        import pytest_timeout

        pytest_timeout.dump_stacks(item.config.get_terminal_writer())  # the other threads, if any
        raise TestTimeout(f"Timeout (>{settings.timeout}s): the test ran past its limit "
                          "(tests/timeouts.py; raise it with @pytest.mark.timeout(N) if the test needs longer)")

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel  # pytest-timeout's pytest_timeout_cancel_timer calls it
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True
