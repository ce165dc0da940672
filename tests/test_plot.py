"""Plot: what the browser is sent is the whole current figure, in the plain plotly mime type, after every change."""
import base64
import json

import numpy as np
import plotly.graph_objects as go
import pytest

from labutils.widgets.plot import MIME, Plot


def shown(p: Plot) -> go.Figure:
    """The figure the widget's output holds, as the page receives it (numpy arrays travel base64-encoded)."""
    (out,) = p.outputs
    assert out["output_type"] == "display_data" and MIME in out["data"]
    return go.Figure(decoded(out["data"][MIME]), skip_invalid=True)


def decoded(spec):
    """plotly's base64 typed arrays ({"dtype", "bdata"}) back into lists, the way plotly.js reads them."""
    if isinstance(spec, dict):
        if set(spec) >= {"dtype", "bdata"}:
            return np.frombuffer(base64.b64decode(spec["bdata"]), dtype=spec["dtype"]).tolist()
        return {k: decoded(v) for k, v in spec.items() if k != "config"}
    return [decoded(v) for v in spec] if isinstance(spec, list) else spec


def test_the_output_holds_the_figure_and_follows_a_redraw():
    p = Plot(go.Figure(go.Scatter(x=np.arange(3), y=np.array([1.0, 2.0, 4.0]), name="a"),
                       layout=dict(title="first")))
    assert list(shown(p).data[0].y) == [1.0, 2.0, 4.0] and shown(p).layout.title.text == "first"
    p.figure.data[0].update(y=[3, 2, 1])
    p.figure.layout.title.text = "second"
    assert list(shown(p).data[0].y) == [1.0, 2.0, 4.0], "nothing is sent before redraw()"
    p.redraw()
    assert list(shown(p).data[0].y) == [3, 2, 1] and shown(p).layout.title.text == "second"


def test_replace_swaps_the_whole_figure():
    p = Plot(go.Figure(go.Bar(x=[1], y=[1])))
    p.replace(go.Figure([go.Scatter(x=[1], y=[2]), go.Scatter(x=[2], y=[3])]))
    assert [t.type for t in shown(p).data] == ["scatter", "scatter"] and len(p.figure.data) == 2


def test_only_a_figure_is_accepted():
    with pytest.raises(TypeError, match="needs a plotly go.Figure"):
        Plot({"data": []})


@pytest.mark.parametrize("make", ["kv", "explorer", "batch", "dashboard"])
def test_every_widget_shows_what_its_figure_holds(make, monkeypatch):
    """No widget may keep a figure the page never receives: each redraws after its updates."""
    from labutils.perf.peaks import Peaks
    from labutils.widgets import ServingDashboard, batch_roofline, explorer, kv_calculator
    peaks = Peaks(10e12, 100e12, "test CPU")
    if make == "kv":
        view = kv_calculator()
        view.batch.value = 8
        plots = [view.fig]
    elif make == "explorer":
        import importlib
        mod = importlib.import_module("labutils.widgets.explorer")
        monkeypatch.setattr(mod, "measured_peaks", lambda *a, **k: peaks)
        from labutils.measure import request as measure
        monkeypatch.setattr(measure, "measured_peaks", lambda *a, **k: peaks)
        view = explorer("cpu", preset="tiny", prompt_len=16, new_tokens=4)
        view.new_tokens.value = 6
        plots = [view.fig_timeline, view.fig_sweep, view.fig_util]
    elif make == "batch":
        rows = iter(dict(phase="decode", n=b, seconds=0.01 * b, intensity=float(b), achieved_flops=1e9,
                         achieved_Bps=1e9, tokens_per_s=100.0 * b) for b in range(1, 100))
        view = batch_roofline("cpu", preset="tiny", peaks=peaks, measure_fn=lambda *a, **k: next(rows))
        view.slider.value = 8
        plots = [view.fig_roof, view.fig_batch]
    else:
        from test_generate import make_model
        view = ServingDashboard(make_model(seed=3), n_requests=4)
        view.run()
        plots = [view.fig]
    for p in plots:
        got = shown(p)
        assert [list(t.x or []) for t in got.data] == [list(t.x or []) for t in p.figure.data]
        assert [list(t.y or []) for t in got.data] == [list(t.y or []) for t in p.figure.data]
        assert any(len(t.x or []) for t in got.data), "a widget's plot shows no points"


def test_a_live_curve_grows_and_shows_every_point_when_finished(monkeypatch):
    from labutils.widgets import live_curve
    curve = live_curve("loss", "step", "nats")
    monkeypatch.setattr(type(curve), "MIN_GAP_S", 3600.0)       # no redraw mid-run after the first
    for step in range(50):
        curve.add(step, 5.0 - step / 25)
    assert len(shown(curve).data[0].x) == 1, "redrawn once, at the first point, then throttled"
    curve.finish()
    assert list(shown(curve).data[0].x) == list(range(50)) and shown(curve).data[0].y[-1] == pytest.approx(3.04)


def test_hover_text_names_each_axis_with_its_units_and_leaves_label_axes_as_they_are():
    import plotly.graph_objects as go
    from labutils.figures.hover import with_units
    fig = go.Figure([go.Scatter(x=[1.5, 2.0], y=[3.0, 4.0], name="measured", text=["a", "b"]),
                     go.Bar(x=["fp32", "bf16"], y=[1.0, 2.0], name="bars"),
                     go.Scatter(x=[1], y=[1], hovertemplate="mine<extra></extra>")])
    fig.update_layout(xaxis_title="batch", yaxis_title="tokens/s")
    with_units(fig)
    assert fig.data[0].hovertemplate == "batch: %{x:.4~g}<br>tokens/s: %{y:.4~g}<br>%{text}<extra>measured</extra>"
    # Labels are shown as they are: a number format would print "NaN" for "fp32".
    assert fig.data[1].hovertemplate.startswith("batch: %{x}<br>tokens/s: %{y:.4~g}")
    assert fig.data[2].hovertemplate == "mine<extra></extra>"                 # a trace's own hover text stays
    untitled = with_units(go.Figure(go.Bar(x=["a"], y=[1])))
    assert untitled.data[0].hovertemplate is None                              # no title: plotly's default
