"""A per-call time limit for tests: a hang must fail the run, never block it.

Two layers, because a hang can sit in Python or in native code that holds the interpreter:
- SIGALRM raises TimeoutError in Python code after `seconds` (the test fails and names the input);
- faulthandler's watchdog thread, which needs no Python to run, dumps every thread's stack and ends
  the process after `seconds + grace`: that catches a loop inside a C or Rust extension (tiktoken's
  encoder looping on an empty special token ignored Ctrl-C), which SIGALRM cannot interrupt.
"""
from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading


@contextlib.contextmanager
def time_limit(seconds: float, what: str = "the call", grace: float = 20.0):
    """Fail (TimeoutError) if the body runs past `seconds`; end the process if it cannot be interrupted."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield                       # signals only reach the main thread (and not on Windows)
        return

    def expired(signum, frame):
        raise TimeoutError(f"{what} ran past its {seconds:g} s limit")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    faulthandler.dump_traceback_later(seconds + grace, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
