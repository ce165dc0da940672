"""Plotly figures of the roofline (lesson 07): measured ceilings, measured passes, and decode against batch."""
from __future__ import annotations

import math
import statistics

import plotly.graph_objects as go

from labutils.perf import roofline
from labutils.perf.peaks import check_peaks
from labutils.figures.hardware import add_log_vline
from labutils.figures.log_axes import log_axis
from labutils.figures.request import DECODE_COLOR, MEASURED_COLOR, PREFILL_COLOR
from labutils.figures.hover import with_units

INTENSITIES = [2 ** (k / 4) for k in range(-12, 57)]      # 1/8 ... 16,384 FLOP/byte, for drawing the roofs


def roofline_figure(peaks, points=(), specs=()) -> go.Figure:
    """Roofs for this machine's measured peaks (and optional datasheet rows), measured passes as points.

    Traces: 0 the measured roof, then one dashed roof per spec, then prefill points, decode points and the
    highlighted point (update_points refills the last three).
    """
    check_peaks(peaks)
    fig = go.Figure()
    fig.add_scatter(x=INTENSITIES, y=[roofline.attainable_flops(i, peaks.flops, peaks.bandwidth_Bps) for i in
                                      INTENSITIES], mode="lines", line=dict(color=MEASURED_COLOR, width=3),
                    name=f"this machine, measured ({peaks.dtype})")
    for spec in specs:
        fig.add_scatter(x=INTENSITIES, y=[roofline.attainable_flops(i, spec.flops_16, spec.bandwidth_Bps) for i in
                                          INTENSITIES], mode="lines", line=dict(dash="dash", color="gray"),
                        name=f"{spec.name} (datasheet, 16-bit)")
    for name, color, symbol in [("prefill (prompt tokens)", PREFILL_COLOR, "circle"),
                                ("decode (batch)", DECODE_COLOR, "diamond"), ("selected", "black", "star")]:
        fig.add_scatter(x=[], y=[], text=[], mode="markers+text", textposition="top center", name=name,
                        marker=dict(color=color, symbol=symbol, size=14 if name == "selected" else 10))
    add_log_vline(fig, peaks.ridge, f"ridge {peaks.ridge:.1f} FLOP/byte")      # as the lessons print it
    fig.update_layout(title="Roofline: measured passes under this machine's measured ceilings", height=440,
                      xaxis=log_axis(INTENSITIES, title="arithmetic intensity (FLOP/byte)"),
                      margin=dict(l=10, r=10, t=50, b=40))
    update_points(fig, points)
    return with_units(fig)


def update_points(fig, points, selected=None) -> None:
    """Refill the prefill, decode and selected traces from rows of measure.roofline_point.

    Labels say what the number counts ("T=32" prompt tokens, "b=32" sequences), and prefill labels sit below
    their markers and decode labels above, so a prefill and a decode point at the same number never overlap.
    """
    prefill, decode, sel = fig.data[-3:]
    for trace, phase, tag, where in ((prefill, "prefill", "T", "bottom center"), (decode, "decode", "b", "top center")):
        rows = sorted((p for p in points if p["phase"] == phase), key=lambda p: p["n"])
        trace.x = [p["intensity"] for p in rows]
        trace.y = [p["achieved_flops"] for p in rows]
        trace.text = [f"{tag}={p['n']}" for p in rows]
        trace.textposition = where
    sel.x = [] if selected is None else [selected["intensity"]]
    sel.y = [] if selected is None else [selected["achieved_flops"]]
    flops = [y for t in fig.data for y in (t.y or [])]
    fig.update_yaxes(**log_axis(flops, title="FLOP/s"))


def predicted_decode(cfg, batches, pos: int, dtype, peaks) -> list[float]:
    """Tokens/s the roofline predicts for a decode step at each batch size."""
    return [b / roofline.decode_step_s(cfg, pos, b, dtype, bandwidth_Bps=peaks.bandwidth_Bps,
                                       peak_flops=peaks.flops) for b in batches]


def batch_figure(cfg, batches, pos: int, dtype, peaks, points=()) -> go.Figure:
    """Decode tokens/s against batch: the roofline's prediction (trace 0), the measured steps (trace 1), the
    selected batch (trace 2) and the measured knee (trace 3), beside the predicted knee's line."""
    fig = go.Figure([
        go.Scatter(x=list(batches), y=predicted_decode(cfg, batches, pos, dtype, peaks), mode="lines",
                   name="predicted: batch / max(bytes / bandwidth, FLOPs / peak)", line=dict(color="gray", dash="dash")),
        go.Scatter(x=[], y=[], mode="lines+markers", name="measured", line=dict(color=DECODE_COLOR)),
    ])
    knee = roofline.knee_batch(cfg, pos, dtype, bandwidth_Bps=peaks.bandwidth_Bps, peak_flops=peaks.flops)
    add_log_vline(fig, knee, f"predicted knee {knee:.0f}")
    fig.update_layout(title="Decode throughput against batch", height=380, margin=dict(l=10, r=10, t=50, b=40),
                      xaxis=log_axis(batches, "pow2", title="batch (sequences decoded together)"))
    fig.add_scatter(x=[], y=[], mode="markers", name="selected batch",
                    marker=dict(symbol="star", size=16, color="black"))
    fig.add_scatter(x=[], y=[], mode="lines", name="measured knee", line=dict(dash="dot", color=DECODE_COLOR))
    update_batch(fig, points)
    return with_units(fig)


def update_batch(fig, points, selected=None) -> None:
    """Refill the measured line (trace 1), the selected batch's star (trace 2) and the measured knee's dotted line
    (trace 3, measured_knee), and re-tick the y axis."""
    rows = sorted((p for p in points if p["phase"] == "decode"), key=lambda p: p["n"])
    fig.data[1].x = [p["n"] for p in rows]
    fig.data[1].y = [p["tokens_per_s"] for p in rows]
    fig.data[2].x = [] if selected is None else [selected["n"]]
    fig.data[2].y = [] if selected is None else [selected["tokens_per_s"]]
    ys = [y for t in fig.data[:2] for y in (t.y or [])]
    # Drawn where it falls inside the batches measured: a GPU's 7B knee lies past batch 64, and the claims print it.
    knee = measured_knee(points)
    shown = knee is not None and knee <= max(p["n"] for p in rows)
    fig.data[3].x = [knee, knee] if shown else []
    fig.data[3].y = [min(ys), max(ys)] if shown else []
    fig.update_yaxes(**log_axis(ys, title="output tokens/s"))


def measured_knee(points) -> float | None:
    """The knee as roofline.knee_batch constructs it, from measured decode steps: the batch-1 step time over the time
    one more sequence costs: the slope of a least-squares line through the step times of the batches from a quarter of
    the largest up, past batch 1 (16 to 64 in lesson 07's sweep; at least the two largest).

    It needs no batch past the knee: there the slope is an extra sequence's FLOPs or cache reads, and before it
    (a GPU's 7B shape at batch 64) its cache reads, which on a GPU set the knee too. A line through three batches,
    not a difference of two, is what keeps one stalled step from flattening the slope to nothing. A slope that is not
    above zero gives inf: no knee this sweep can place. None for fewer than two batches."""
    rows = {p["n"]: p["seconds"] for p in points if p["phase"] == "decode"}
    if 1 not in rows or len(rows) < 2:
        return None
    fit = [n for n in sorted(rows) if n > 1 and n >= max(rows) / 4]
    fit = fit if len(fit) >= 2 else sorted(rows)[-2:]
    per_sequence = statistics.linear_regression(fit, [rows[n] for n in fit]).slope
    return rows[1] / per_sequence if per_sequence > 0 else math.inf


__all__ = ["batch_figure", "measured_knee", "predicted_decode", "roofline_figure", "update_batch", "update_points"]
