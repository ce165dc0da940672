"""Plotly figures of serving runs: a Gantt of each request's queueing, prefill and decode, throughput against batch,
the streams' inter-token latency around a long prompt, and the token budget's TTFT/ITL trade-off."""
from __future__ import annotations

import plotly.graph_objects as go

from labutils.figures.log_axes import log_axis
from labutils.figures.hover import with_units

QUEUED, PREFILL, DECODE = "#c7c7c7", "#ff7f0e", "#1f77b4"
PHASES = (("queued", QUEUED), ("prefill", PREFILL), ("decode", DECODE))


def gantt_bars(result) -> list[tuple[str, float, float]]:
    """(phase, start, end) bars of one request: queued until it joins the batch (and again while preempted),
    then in each stay in the batch, prefill until its first token of that stay, decode after it.

    A stay that produced no token (preempted during its prefill) is all prefill.
    """
    bars, waited_from = [], result.arrival_s
    for start, end in result.spans:
        bars.append(("queued", waited_from, start))
        first = next((t for t in result.timestamps if start < t <= end), end)
        bars += [("prefill", start, first), ("decode", first, end)]
        waited_from = end
    return [(phase, a, b) for phase, a, b in bars if b > a]


def gantt_figure(results, title: str = "Requests over time") -> go.Figure:
    """One row per request: grey while queued, orange during its prefill, blue while it decodes (gantt_bars).

    A preempted request shows a second queued stretch and a second prefill (its recompute). Rejected requests
    have no row.
    """
    fig = go.Figure()
    rows = [r for r in results if r.spans]
    bars = [(r.id, *bar) for r in rows for bar in gantt_bars(r)]
    for name, color in PHASES:
        mine = [(i, a, b) for i, phase, a, b in bars if phase == name]
        fig.add_bar(y=[i for i, _, _ in mine], x=[b - a for _, a, b in mine],
                    base=[a for _, a, _ in mine], orientation="h", marker_color=color, name=name,
                    hovertemplate="request %{y}: from %{base:.3f} s for %{x:.3f} s<extra>" + name + "</extra>")
    # Request ids on a numeric axis, so plotly spaces its own tick labels at any count; rows of 14 px up to 40
    # requests, then the chart stops growing (128 rows of 14 px were taller than two screens).
    fig.update_layout(barmode="overlay", title=title, xaxis_title="seconds since the workload started",
                      yaxis=dict(autorange="reversed", title="request", zeroline=False),
                      height=min(max(260, 14 * len(rows) + 120), 14 * 40 + 120),
                      legend=dict(orientation="h", x=1, xanchor="right", y=1.02, yanchor="bottom"))
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
    ys = [y for t in fig.data for y in (t.y or [])]
    fig.update_layout(title=title, xaxis=log_axis([r["batch"] for r in rows], "pow2", title="batch size"),
                      yaxis=log_axis(ys, title="tokens/s (log scale)"), height=380)
    return with_units(fig)


def itl_figure(runs: dict, title: str = "Every stream token's gap to the one before") -> go.Figure:
    """One marker per stream token (x: when it came, y: its ITL in ms) for each labelled Interference run, and for
    each a dotted line in its colour where its long prompt arrived. The spike of a whole prefill stands out as a
    column of tall gaps."""
    fig = go.Figure()
    colors = list(fig.layout.template.layout.colorway or ("#636efa", "#EF553B"))     # the template's, in order
    top = max((g for run in runs.values() for g in run.gaps()[1]), default=0.0) * 1e3
    for (label, run), color in zip(runs.items(), colors * len(runs)):
        t, gap = run.gaps()
        fig.add_scatter(x=t, y=[g * 1e3 for g in gap], mode="markers", name=label, legendgroup=label,
                        marker=dict(size=5, color=color), hovertemplate="%{x:.3f} s: a gap of %{y:.2f} ms<extra>"
                        + label + "</extra>")
        fig.add_scatter(x=[run.arrival_s] * 2, y=[0, top], mode="lines", line=dict(dash="dot", color=color),
                        name=f"{label}: the long prompt arrives", legendgroup=label,
                        hovertemplate="the long prompt arrives at %{x:.3f} s<extra>" + label + "</extra>")
    fig.update_layout(title=title, xaxis_title="seconds since the streams started", yaxis_title="ITL (ms)",
                      height=380, legend=dict(orientation="h", y=1.02, yanchor="bottom", x=1, xanchor="right"))
    return fig


def budget_figure(points, title: str = "The token budget: p99 ITL against p50 TTFT") -> go.Figure:
    """One point per budget (interference.BudgetPoint): p50 TTFT across, p99 ITL up, labelled by the budget."""
    fig = go.Figure()
    fig.add_scatter(x=[p.summary.ttft_s.p50 * 1e3 for p in points], y=[p.summary.itl_s.p99 * 1e3 for p in points],
                    mode="lines+markers+text", text=[p.label for p in points],
                    textposition="top center", name="budget (tokens per step)",
                    hovertemplate="budget %{text}: TTFT p50 %{x:.1f} ms, ITL p99 %{y:.2f} ms<extra></extra>")
    fig.update_layout(title=title, xaxis_title="TTFT p50 (ms)", yaxis_title="ITL p99 (ms)", height=360)
    return fig


__all__ = ["batch_figure", "budget_figure", "gantt_bars", "gantt_figure", "itl_figure"]
