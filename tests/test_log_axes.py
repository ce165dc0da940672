"""log_axis: major ticks only, powers of two or 1-2-5, labels short, bad input refused."""
import math

import pytest
from hypothesis import given, strategies as st

from labutils.figures.log_axes import MAX_TICKS, log_axis, log_ticks, tick_label


def test_powers_of_two_cover_token_counts():
    assert log_ticks(1, 128, "pow2") == [1, 2, 4, 8, 16, 32, 64, 128]
    assert log_ticks(3, 100, "pow2") == [2, 4, 8, 16, 32, 64, 128]


def test_one_two_five_per_decade():
    assert log_ticks(1, 1000, "125") == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    assert log_ticks(0.3, 7, "125") == [0.2, 0.5, 1, 2, 5, 10]


def test_labels_are_short():
    assert [tick_label(v) for v in (0.05, 0.5, 1, 20, 1000, 2048, 5e6, 1e9, 3e12)] == \
        ["0.05", "0.5", "1", "20", "1k", "2.048k", "5M", "1G", "3T"]


def test_axis_dict_takes_extra_keys_and_ignores_unplottable_values():
    ax = log_axis([0, -1, float("nan"), 4, 64], "pow2", title="batch")
    assert ax["type"] == "log" and ax["title"] == "batch" and ax["tickvals"] == [4, 8, 16, 32, 64]
    assert log_axis([0, None], title="x") == dict(type="log", title="x")       # nothing plottable: plotly decides


@given(st.floats(1e-6, 1e12), st.floats(1.0, 1e6), st.sampled_from(["pow2", "125"]))
def test_ticks_always_cover_the_data_and_stay_few(lo, span, kind):
    hi = lo * span
    ticks = log_ticks(lo, hi, kind)
    assert ticks == sorted(ticks) and len(ticks) <= MAX_TICKS + 1
    assert ticks[0] <= lo * 1.0000001 and ticks[-1] >= hi / 1.0000001
    if kind == "pow2":
        assert all(math.log2(t) == int(math.log2(t)) for t in ticks)


@pytest.mark.parametrize("args, match", [((0, 10), "positive"), ((1, math.inf), "positive"),
                                          ((1, 10, "log"), "kind must be")])
def test_bad_ends_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        log_ticks(*args)


def test_tidy_log_axes_ticks_every_log_axis_from_its_own_traces():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots
    from labutils.figures.log_axes import tidy_log_axes
    fig = make_subplots(rows=1, cols=2)
    fig.add_scatter(x=[128, 256, 4096], y=[0.2, 3, 40], row=1, col=1)
    fig.add_scatter(x=[128, 4096], y=[1e6, 5e8], row=1, col=2)
    fig.update_xaxes(type="log")
    fig.update_yaxes(type="log", row=1, col=2)                     # the first panel's y stays linear
    tidy_log_axes(fig, pow2="x")
    assert list(fig.layout.xaxis.tickvals) == [2 ** k for k in range(7, 13)]
    assert list(fig.layout.xaxis2.tickvals) == list(fig.layout.xaxis.tickvals)
    assert fig.layout.yaxis.tickvals is None
    assert fig.layout.yaxis2.ticktext[0] == "1M" and fig.layout.yaxis2.ticktext[-1] == "500M"
