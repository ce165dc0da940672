"""Progress bars for long measurements: an ipywidgets bar with a count and the current item in a notebook,
nothing elsewhere (scripts, tests, the bench).

A bar is a widget, so nbval skips its random model id; every cell that shows one is a timing cell marked
NBVAL_IGNORE_OUTPUT anyway. Measuring functions take a `progress_desc` and show a bar only when given one, so a
cell whose output nbval compares never grows a bar.
"""
from __future__ import annotations

import html
import math
import time
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")
MIN_GAP_S = 0.2


def in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class Pace:
    """`ready()` is true at most once every MIN_GAP_S seconds (and always for the final update): a progress message
    sent from inside a timed loop (a request's tokens, a served workload's requests) must cost it almost nothing."""

    def __init__(self):
        self._at = -math.inf        # perf_counter counts from an arbitrary start: the first update always goes

    def ready(self, final: bool = False) -> bool:
        now = time.perf_counter()
        if final or now - self._at > MIN_GAP_S:
            self._at = now
            return True
        return False


class Steps:
    """A bar of `total` steps: `step(text)` advances it and shows "i / total: text"; `done()` turns it green.

    Outside a notebook (or with total 0) every method does nothing, so callers never need to ask.
    """

    def __init__(self, total: int, desc: str = ""):
        self.total, self.count, self._bar = int(total), 0, None
        self._every = max(1, self.total // 100)     # at most ~100 updates: each one is a message to the page
        self._pace = Pace()                          # and at most a few a second
        if not (in_notebook() and self.total > 0):
            return
        import ipywidgets as w
        from IPython.display import display
        self._bar = w.IntProgress(value=0, min=0, max=self.total, layout=w.Layout(width="40%"))
        self._desc = desc
        self._label = w.HTML(self._text(""))
        display(w.HBox([self._bar, self._label]))

    def _text(self, item: str) -> str:
        now = f"{self.count:,} / {self.total:,}" + (f": {item}" if item else "")
        return f"<small>{html.escape(self._desc)} &middot; {html.escape(now)}</small>"

    def show(self, item: str) -> None:
        """Name what runs now, without advancing."""
        if self._bar is not None and self._every == 1:
            self._label.value = self._text(item)

    def step(self, item: str = "") -> None:
        self.count += 1
        if self._bar is not None and (self.count % self._every == 0 or self.count >= self.total) \
                and self._pace.ready(final=self.count >= self.total):
            self._bar.value = min(self.count, self.total)
            self._label.value = self._text(item)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.value, self._bar.bar_style = self.total, "success"


def progress(items: Iterable[T], desc: str = "", total: int | None = None,
             label: Callable[[T], str] = str) -> Iterator[T]:
    """Yield from items while a bar fills, naming the item being measured (`label(item)`)."""
    items = list(items) if total is None and not hasattr(items, "__len__") else items
    total = len(items) if total is None else total
    bar = Steps(total, desc)
    if bar._bar is None:
        yield from items
        return
    for item in items:
        bar.show(f"now {label(item)}")          # the item being measured, before it takes its time
        yield item
        bar.step(label(item))
    bar.done()
