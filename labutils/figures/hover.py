"""Hover text that says what a point is: each axis by its title, units included, instead of plotly's bare pair."""
from __future__ import annotations

import plotly.graph_objects as go


def _title(fig: go.Figure, axis: str) -> str:
    """The title of axis "x", "x2", "y", ... ("xaxis", "xaxis2", ... in the layout), or the axis's letter."""
    text = fig.layout[axis[0] + "axis" + axis[1:]].title.text
    return text or axis[0]


def with_units(fig: go.Figure) -> go.Figure:
    """Give every line, marker and bar trace that has no hover text of its own one that names both axes as their
    titles do, with the trace's name beside it: plotly's default reads "(0.3494163, 230.1476)"."""
    for t in fig.data:
        if t.type not in ("scatter", "bar") or t.hovertemplate is not None or t.hoverinfo == "skip":
            continue
        x, y = _title(fig, t.xaxis or "x"), _title(fig, t.yaxis or "y")
        t.hovertemplate = f"{x}: %{{x:.4~g}}<br>{y}: %{{y:.4~g}}<extra>{t.name or ''}</extra>"
    return fig
