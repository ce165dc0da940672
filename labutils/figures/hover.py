"""Hover text that says what a point is: each axis by its title, units included, instead of plotly's bare pair."""
from __future__ import annotations

import plotly.graph_objects as go


def _axis(fig: go.Figure, axis: str, values) -> str | None:
    """The hover field for axis "x", "x2", "y", ... ("xaxis", "xaxis2", ... in the layout): its title and the
    value, as a number where the axis holds numbers and as it is where it holds labels; None without a title."""
    title = fig.layout[axis[0] + "axis" + axis[1:]].title.text
    if not title:
        return None
    labels = values is not None and any(isinstance(v, str) for v in values)
    return f"{title}: %{{{axis[0]}}}" if labels else f"{title}: %{{{axis[0]}:.4~g}}"


def with_units(fig: go.Figure) -> go.Figure:
    """Give every line, marker and bar trace that has no hover text of its own one that names both axes as their
    titles do, with the trace's name and text beside it: plotly's default reads "(0.3494163, 230.1476)". A trace
    on an axis without a title keeps plotly's default, which at least shows the value as the axis does."""
    for t in fig.data:
        if t.type not in ("scatter", "bar") or t.hovertemplate is not None or t.hoverinfo == "skip":
            continue
        x, y = _axis(fig, t.xaxis or "x", t.x), _axis(fig, t.yaxis or "y", t.y)
        if x is None or y is None:
            continue
        text = "<br>%{text}" if t.text is not None else ""          # labels update_* functions fill in later
        t.hovertemplate = f"{x}<br>{y}{text}<extra>{t.name or ''}</extra>"
    return fig
