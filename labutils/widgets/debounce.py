"""Latest: run a widget's measurement once for a burst of control changes, with the settings of the last one.

A measurement blocks the kernel for seconds. Slider moves made meanwhile wait in the kernel's queue, and without
this each would then be measured in full, in order (two arrow presses on a batch slider: batch 2, then batch 4).
An observer that only schedules the measurement a moment later lets the kernel take every queued change first;
the measurement then runs once, for the settings the learner ended on.
"""
from __future__ import annotations

import asyncio
from typing import Callable

DELAY_S = 0.3        # long enough to gather a burst of key presses, short enough to feel immediate


class Latest:
    """`latest()` schedules `fn()` DELAY_S from now, cancelling any call still waiting; without a running event loop
    (a script, a test) it calls `fn()` at once."""

    def __init__(self, fn: Callable[[], object], delay_s: float = DELAY_S):
        self.fn, self.delay_s = fn, delay_s
        self._pending: asyncio.TimerHandle | None = None
        self.runs = 0

    def __call__(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:                  # no event loop here: nothing to gather, run now
            self._run()
            return
        if self._pending is not None:
            self._pending.cancel()
        self._pending = loop.call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        self.runs += 1
        self.fn()
