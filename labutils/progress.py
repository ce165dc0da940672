"""A progress bar for long measurements: an ipywidgets bar in a notebook, nothing elsewhere."""
from __future__ import annotations

from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def progress(items: Iterable[T], desc: str = "", total: int | None = None) -> Iterator[T]:
    """Yield from items while a bar fills. The bar is a widget, so nbval skips its random model id."""
    if total is None:
        total = len(items) if hasattr(items, "__len__") else None
    if not _in_notebook() or not total:
        yield from items
        return
    import ipywidgets as w
    from IPython.display import display

    bar = w.IntProgress(value=0, min=0, max=total, description=desc,
                        style={"description_width": "initial"}, layout=w.Layout(width="60%"))
    display(bar)
    for item in items:
        yield item
        bar.value += 1
    bar.bar_style = "success"
