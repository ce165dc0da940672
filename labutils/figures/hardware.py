"""Lesson 00's figures: bandwidth against buffer size, this machine against the datasheets, rooflines."""
from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labutils.perf import roofline
from labutils.core.devices import MiB
from labutils.perf.datasheets import SPECS, DeviceSpec
from labutils.figures.log_axes import log_axis
from labutils.figures.request import MEASURED_COLOR     # the course's one colour for "measured on this machine"
from labutils.core.validate import check_positive
from labutils.figures.hover import with_units

NO_FIGURE_TEXT = "no FLOP/s figure in the cited source"
# Why bars are missing: SPECS keeps None where the cited source gives no figure, and invents none.
NOTE = ("A missing bar is a figure the cited source does not give (datasheets.SPECS keeps None).<br>"
        "Apple quotes no fp16/bf16 matrix rate for its GPUs; x marks rows with no FLOP/s figure at all.")


def add_log_vline(fig: go.Figure, x: float, text: str, xanchor: str = "center") -> None:
    """A dotted vertical line with a label at the top, on a log x axis.

    Plotly reads a shape's x in data units but an annotation's x in log10 units on a log axis, so
    add_vline(annotation_text=...) would put the label (and stretch the axis) at 10**x.
    """
    x = check_positive("x", x)
    fig.add_vline(x=x, line_dash="dot")
    fig.add_annotation(x=math.log10(x), xref="x", y=1, yref="paper", yanchor="bottom", text=text,
                       xanchor=xanchor, showarrow=False)


def bandwidth_figure(sizes, bandwidths_Bps, cache_bytes: int | None = None,
                     cache_text: str = "last-level cache", title: str = "Copy bandwidth vs buffer size") -> go.Figure:
    """Copy bandwidth (GB/s) against buffer size (MiB, log axis), with a dotted line at the cache size.

    The x range (log10 units) is set from the data and the cache line, so the line shows even when the
    sweep stops short of it.
    """
    sizes, bandwidths_Bps = list(sizes), list(bandwidths_Bps)
    if not sizes or len(sizes) != len(bandwidths_Bps):
        raise ValueError(f"sizes and bandwidths_Bps must be equal, non-empty lists, got {len(sizes)} sizes and "
                         f"{len(bandwidths_Bps)} bandwidths; pass one bandwidth per buffer size")
    x = [check_positive("size", s) / MiB for s in sizes]
    fig = go.Figure(go.Scatter(x=x, y=[b / 1e9 for b in bandwidths_Bps], mode="lines+markers",
                               name="copy bandwidth"))
    ends = [min(x), max(x)]
    if cache_bytes:
        cache_mib = check_positive("cache_bytes", cache_bytes) / MiB
        ends += [cache_mib]
        # Hang a long label to the side with room, one clause a line, so it is not clipped.
        right_half = math.log10(cache_mib) > sum(math.log10(e) for e in (min(ends), max(ends))) / 2
        add_log_vline(fig, cache_mib, cache_text.replace("; ", ";<br>"), "right" if right_half else "left")
    pad = 0.15   # a little room (in decades) either side of the outermost point
    fig.update_layout(title=title, yaxis_title="GB/s (read + write)", margin=dict(t=90),
                      xaxis=log_axis(ends, "pow2", title="buffer size (MiB)",
                                     range=[math.log10(min(ends)) - pad, math.log10(max(ends)) + pad]))
    return with_units(fig)


def _has_flops(spec: DeviceSpec) -> bool:
    return spec.tflops_16 is not None or spec.tflops_32 is not None


def datasheet_figure(bandwidth_Bps: float, flops: float, dtype: str = "float32",
                     specs: dict[str, DeviceSpec] = SPECS) -> go.Figure:
    """Bars: this machine's measured bandwidth and FLOP/s next to each datasheet row (log scale).

    The measured machine is one legend entry (its two bars share a legend group). A row without any
    published FLOP/s figure (Apple's M-series GPUs: no fp16 matrix figure, and most give no TFLOP/s
    at all) gets an open marker and a legend entry saying so, instead of a silent gap.
    """
    bandwidth_Bps, flops = check_positive("bandwidth_Bps", bandwidth_Bps), check_positive("flops", flops)
    me, rows = "this machine", list(specs.values())
    names = [me] + [s.name for s in rows]
    measured = dict(legendgroup="measured", marker_color=MEASURED_COLOR, name=f"this machine (measured, {dtype})")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("memory bandwidth (GB/s)", "matmul throughput (TFLOP/s)"))
    fig.add_bar(x=[me], y=[bandwidth_Bps / 1e9], row=1, col=1, **measured)
    fig.add_bar(x=[me], y=[flops / 1e12], row=1, col=2, showlegend=False, **measured)
    fig.add_bar(x=[s.name for s in rows], y=[s.bandwidth_GBps for s in rows], name="spec: memory bandwidth",
                marker_color="slategray", row=1, col=1)
    fig.add_bar(x=[s.name for s in rows], y=[s.tflops_16 for s in rows], name="spec: fp16/bf16 tensor",
                marker_color="steelblue", row=1, col=2)
    fig.add_bar(x=[s.name for s in rows], y=[s.tflops_32 for s in rows], name="spec: fp32",
                marker_color="lightsteelblue", row=1, col=2)
    bare = [s.name for s in rows if not _has_flops(s)]
    if bare:
        # The bottom of the drawn bars, so the marker sits on the axis floor of the log scale.
        floor = min([flops / 1e12] + [v for s in rows for v in (s.tflops_16, s.tflops_32) if v is not None])
        fig.add_scatter(x=bare, y=[floor] * len(bare), mode="markers", name=NO_FIGURE_TEXT,
                        marker=dict(symbol="x-open", size=11, color="gray"), row=1, col=2)
    fig.update_xaxes(categoryorder="array", categoryarray=names)
    bandwidths = [bandwidth_Bps / 1e9] + [s.bandwidth_GBps for s in rows]
    tflops = [flops / 1e12] + [v for s in rows for v in (s.tflops_16, s.tflops_32) if v is not None]
    fig.update_yaxes(**log_axis(bandwidths), row=1, col=1)
    fig.update_yaxes(**log_axis(tflops), row=1, col=2)
    # The note rides under the title: placed under the rotated device names it floated far below the bars.
    fig.update_layout(title=dict(text="This machine against the datasheets (log scale)",
                                 subtitle=dict(text=NOTE, font=dict(size=11))),
                      barmode="group", height=520, margin=dict(t=110))
    return with_units(fig)


def rooflines_figure(roofs, marks=(), intensities=None) -> go.Figure:
    """One roofline per (label, peak FLOP/s, bandwidth B/s) in `roofs`, and a labelled line per (x, label) in `marks`.

    Each roof is roofline.attainable_flops over `intensities` (default 1/16 ... 16,384 FLOP/byte), in TFLOP/s.
    """
    intensities = [2 ** (k / 4) for k in range(-16, 57)] if intensities is None else list(intensities)
    fig = go.Figure()
    for label, peak, bw in roofs:
        fig.add_scatter(x=intensities, y=[roofline.attainable_flops(i, peak, bw) / 1e12 for i in intensities],
                        name=label, mode="lines")
    for x, label in marks:
        add_log_vline(fig, x, label)
    tflops = [y for t in fig.data for y in (t.y or [])]
    fig.update_layout(title="Rooflines: attainable TFLOP/s vs arithmetic intensity", margin=dict(t=90),
                      xaxis=log_axis(intensities, title="arithmetic intensity (FLOP/byte)"),
                      yaxis=log_axis(tflops, title="TFLOP/s"))
    return with_units(fig)


def legend_names(fig: go.Figure) -> list[str]:
    """The names the legend shows: traces with a name whose showlegend is not False."""
    return [t.name for t in fig.data if t.name and t.showlegend is not False]
