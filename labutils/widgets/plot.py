"""Plot: a plotly figure shown in an Output widget and redrawn whole after each change, for every widget here.

Why not plotly's FigureWidget. A FigureWidget's view draws the state the browser holds when the view is created,
and every later change travels as a separate message that the view's script applies. That state is synced only
when the figure is displayed on its own; inside a VBox it stays as the figure was built (the KV calculator's: empty
traces), and a change message that arrives before the 5 MB script has loaded in the page has no listener and is
lost. JupyterLab's default windowing also renders the outputs of cells that are off screen into detached elements.
A learner's Restart Kernel and Run All was seen to leave such plots with default axes and no traces, and a slider
then changed nothing. An Output widget holding a plain plotly figure has no script of its own and no deltas:
JupyterLab's plotly renderer draws the whole figure each time the output is shown, the way it draws the lessons'
static figures. The cost is resending a few kilobytes of JSON per change; none of these figures is large.
"""
from __future__ import annotations

import math

import json
import time

import ipywidgets as w
import plotly.graph_objects as go
from plotly.utils import PlotlyJSONEncoder

MIME = "application/vnd.plotly.v1+json"


def mime_bundle(figure: go.Figure) -> dict:
    """The display_data output a notebook stores for a plotly figure (what the plotly_mimetype renderer emits)."""
    # JSON as the lessons' stored figures hold it (numpy arrays as plotly's base64 typed arrays).
    spec = json.loads(json.dumps(figure.to_plotly_json(), cls=PlotlyJSONEncoder))
    return {"output_type": "display_data", "metadata": {},
            "data": {MIME: {"data": spec.get("data", []), "layout": spec.get("layout", {}), "config": {}},
                     "text/plain": f"<plotly figure: {len(figure.data)} traces>"}}


class Plot(w.Output):
    """`plot.figure` is an ordinary go.Figure: change it (the labutils figure updaters do), then `plot.redraw()`."""

    def __init__(self, figure: go.Figure, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(figure, go.Figure):
            raise TypeError(f"Plot needs a plotly go.Figure, got {type(figure).__name__}")
        self.figure = figure
        self.redraw()

    def redraw(self) -> None:
        # Assigning `outputs` replaces the shown figure in one message, from any callback, with no capture context.
        self.outputs = (mime_bundle(self.figure),)

    def replace(self, figure: go.Figure) -> None:
        """Show another figure (a new Gantt, say), keeping the widget in its place."""
        self.figure = figure
        self.redraw()


class LiveCurve(Plot):
    """A line that grows while something runs: `curve.add(x, y)` fits train(progress=...), for a loss per step.

    Redraws at most a few times a second (each redraw resends the line) and always once more at `finish()`.
    """

    MIN_GAP_S = 0.25

    def __init__(self, title: str, xaxis_title: str, yaxis_title: str, name: str = "", height: int = 350):
        super().__init__(go.Figure(go.Scatter(x=[], y=[], mode="lines", name=name),
                                   layout=dict(title=title, xaxis_title=xaxis_title, yaxis_title=yaxis_title,
                                               height=height)))
        # -inf, not 0: perf_counter counts from an arbitrary start (boot, on Linux), so the first point always draws
        self.xs, self.ys, self._drawn_at = [], [], -math.inf

    def add(self, x: float, y: float) -> None:
        self.xs.append(x)
        self.ys.append(y)
        now = time.perf_counter()
        if now - self._drawn_at > self.MIN_GAP_S:
            self._drawn_at = now
            self.finish()

    def finish(self) -> None:
        self.figure.data[0].update(x=list(self.xs), y=list(self.ys))
        self.redraw()


def live_curve(title: str, xaxis_title: str, yaxis_title: str, **kwargs) -> LiveCurve:
    """A LiveCurve to display, then feed with curve.add(x, y) and end with curve.finish()."""
    return LiveCurve(title, xaxis_title, yaxis_title, **kwargs)
