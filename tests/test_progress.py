"""Progress bars: nothing outside a notebook; in one, a count and the current item, and few updates."""

import pytest

from labutils.core import progress_bar as pm

def test_outside_a_notebook_nothing_is_shown_and_items_pass_through():
    assert list(pm.progress(range(5), desc="x")) == [0, 1, 2, 3, 4]
    bar = pm.Steps(10, "x")
    bar.show("a")
    bar.step("a")
    bar.done()
    assert bar._bar is None and bar.count == 1

@pytest.fixture
def notebook(monkeypatch):
    shown = []
    monkeypatch.setattr(pm, "in_notebook", lambda: True)
    import IPython.display
    monkeypatch.setattr(IPython.display, "display", lambda w: shown.append(w))
    return shown

def test_in_a_notebook_the_bar_counts_and_names_the_item(notebook):
    items = list(pm.progress(["256 tokens", "512 tokens"], desc="requests"))
    assert items == ["256 tokens", "512 tokens"] and len(notebook) == 1
    bar, label = notebook[0].children
    assert bar.value == 2 and bar.bar_style == "success"
    assert "requests" in label.value and "2 / 2: 512 tokens" in label.value

def test_a_long_run_sends_few_updates(notebook, monkeypatch):
    bar = pm.Steps(10_000, "tokens")
    sent = []
    widget = notebook[0].children[0]
    widget.observe(lambda change: sent.append(change["new"]), names="value")
    for i in range(10_000):
        bar.step()
    assert len(sent) <= 101 and widget.value == 10_000       # the last step always lands
