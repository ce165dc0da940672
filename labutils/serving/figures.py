"""Plotly figures of serving runs: a Gantt of requests in the batch, and throughput against batch size."""
from __future__ import annotations

import plotly.graph_objects as go

WAIT, RUN = "#c7c7c7", "#1f77b4"


def gantt_figure(results, title: str = "Requests over time") -> go.Figure:
    """One row per request: grey from arrival until it first joins the batch, blue while it is in the batch.

    A preempted request shows more than one blue span. Rejected requests have no row.
    """
    fig = go.Figure()
    rows = [r for r in results if r.spans]
    waits = [(r.id, r.arrival_s, r.spans[0][0]) for r in rows]
    spans = [(r.id, a, b) for r in rows for a, b in r.spans]
    for name, color, bars in (("waiting", WAIT, waits), ("in the batch", RUN, spans)):
        fig.add_bar(y=[f"#{i}" for i, _, _ in bars], x=[max(b - a, 0.0) for _, a, b in bars],
                    base=[a for _, a, _ in bars], orientation="h", marker_color=color, name=name,
                    hovertemplate="%{y}: %{base:.3f} s + %{x:.3f} s<extra>" + name + "</extra>")
    fig.update_layout(barmode="overlay", title=title, xaxis_title="seconds since the workload started",
                      yaxis=dict(autorange="reversed", title="request", showticklabels=len(rows) <= 40),
                      height=max(260, 14 * len(rows) + 120), legend=dict(orientation="h", y=1.02, yanchor="bottom"))
    return fig


def batch_figure(rows, predicted=None, title: str = "Decode throughput against batch size") -> go.Figure:
    """Measured tokens/s per batch size (rows of dicts with "batch", "tokens_per_s", "label"), and a predicted line.

    Both axes are logarithmic: a measured line many times below its roofline bound would otherwise sit flat at the
    bottom of the plot, and on a log scale equal ratios look equal, so the gap to the bound reads at every batch.
    """
    fig = go.Figure()
    labels = sorted({r["label"] for r in rows}, key=[r["label"] for r in rows].index)
    for label in labels:
        pts = [r for r in rows if r["label"] == label]
        fig.add_scatter(x=[r["batch"] for r in pts], y=[r["tokens_per_s"] for r in pts], mode="lines+markers",
                        name=label)
    if predicted:
        fig.add_scatter(x=[b for b, _ in predicted], y=[t for _, t in predicted], mode="lines", name="roofline bound",
                        line=dict(dash="dot", color="black"))
    fig.update_layout(title=title, xaxis=dict(type="log", title="batch size"),
                      yaxis=dict(type="log", title="tokens/s (log scale)"), height=380)
    return fig


__all__ = ["batch_figure", "gantt_figure"]
