"""Plotly figures of measured requests (rows from measure.measure_request): timeline, sweeps, MBU/MFU."""
from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labutils.figures.hover import with_units

# The illustrative request of seed 001 ("Two Phases, Two Personalities"): 1,000 prompt tokens in one
# 400 ms prefill pass, then 200 output tokens taking 6,000 ms. Quoted from the text, not measured here.
SEED_PROMPT_TOKENS, SEED_OUTPUT_TOKENS = 1000, 200
SEED_PREFILL_MS, SEED_DECODE_MS = 400.0, 6000.0

PREFILL_COLOR, DECODE_COLOR, SEED_COLOR, MEASURED_COLOR = "#1f77b4", "#ff7f0e", "#9e9e9e", "crimson"

# Settings that must match for two rows to sit on the same TTFT/TPOT-vs-prompt-length curve.
SWEEP_KEYS = ("preset", "new_tokens", "batch", "dtype", "device")


def describe(row: dict) -> str:
    """One line naming a row's settings: 'gpt2-small, fp32, cpu, batch 1, 128 + 32 tokens'."""
    return (f"{row['preset']}, {row['dtype']}, {row['device']}, batch {row['batch']}, "
            f"{row['prompt_len']} + {row['new_tokens']} tokens")


# --- (a) one request on a time axis ---------------------------------------------------------------

def timeline_data(row: dict) -> dict:
    """Milliseconds since the request began: the prefill span, the decode span and each token's arrival."""
    stamps_ms = [t * 1e3 for t in row["timestamps"]]
    return dict(prefill_ms=stamps_ms[0], decode_ms=stamps_ms[-1] - stamps_ms[0], token_ms=stamps_ms)


def timeline_figure(row: dict | None = None) -> go.Figure:
    """Traces: 0 prefill bar, 1 decode bar, 2 one tick per output token. Empty until a row fills it."""
    fig = go.Figure([
        go.Bar(name="prefill (sets TTFT)", orientation="h", y=[], x=[], base=[], marker_color=PREFILL_COLOR),
        go.Bar(name="decode (TPOT per token)", orientation="h", y=[], x=[], base=[], marker_color=DECODE_COLOR),
        go.Scatter(name="token on the host", mode="markers", y=[], x=[],
                   marker=dict(symbol="line-ns-open", size=14, color="black")),
    ])
    fig.update_layout(barmode="overlay", height=230, margin=dict(l=10, r=10, t=40, b=40),
                      xaxis_title="time since the request began (ms)", legend=dict(orientation="h", y=-0.45),
                      title="One request: prefill, then one decode step per token")
    if row is not None:
        update_timeline(fig, row)
    return fig


def update_timeline(fig: go.Figure, row: dict) -> None:
    d = timeline_data(row)
    n = len(d["token_ms"])
    with fig.batch_update():
        fig.data[0].update(y=["request"], x=[d["prefill_ms"]], base=[0.0],
                           hovertemplate=f"prefill of {row['prompt_len']} tokens: %{{x:.1f}} ms<extra></extra>")
        fig.data[1].update(y=["request"], x=[d["decode_ms"]], base=[d["prefill_ms"]],
                           hovertemplate=f"decode of {n - 1} tokens: %{{x:.1f}} ms<extra></extra>")
        fig.data[2].update(y=["tokens"] * n, x=d["token_ms"], hovertemplate="token at %{x:.1f} ms<extra></extra>")
        fig.layout.title.text = (f"{describe(row)}: TTFT {row['ttft_s'] * 1e3:.0f} ms, "
                                 f"TPOT {row['tpot_s'] * 1e3:.1f} ms")


# --- (b) TTFT and TPOT against prompt length ------------------------------------------------------

def sweep_points(rows: list[dict], like: dict) -> dict:
    """The rows measured at `like`'s other settings, sorted by prompt length, latest measurement per length."""
    same = {}
    for row in rows:
        if all(row[k] == like[k] for k in SWEEP_KEYS):
            same[row["prompt_len"]] = row
    lens = sorted(same)
    return dict(prompt_len=lens, ttft_ms=[same[n]["ttft_s"] * 1e3 for n in lens],
                tpot_ms=[same[n]["tpot_s"] * 1e3 for n in lens])


def sweep_figure(rows: list[dict] | None = None, like: dict | None = None) -> go.Figure:
    """Traces: 0 TTFT (left panel), 1 TPOT (right panel), both against prompt length."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("prefill: TTFT", "decode: TPOT"))
    fig.add_trace(go.Scatter(name="TTFT", mode="lines+markers", x=[], y=[], marker_color=PREFILL_COLOR), 1, 1)
    fig.add_trace(go.Scatter(name="TPOT", mode="lines+markers", x=[], y=[], marker_color=DECODE_COLOR), 1, 2)
    fig.update_xaxes(title_text="prompt length (tokens)", rangemode="tozero")
    fig.update_yaxes(title_text="TTFT (ms)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="TPOT (ms)", rangemode="tozero", row=1, col=2)
    fig.update_layout(height=300, showlegend=False, margin=dict(l=10, r=10, t=60, b=40))
    if rows and like:
        update_sweep(fig, rows, like)
    return with_units(fig)


def update_sweep(fig: go.Figure, rows: list[dict], like: dict) -> None:
    p = sweep_points(rows, like)
    with fig.batch_update():
        fig.data[0].update(x=p["prompt_len"], y=p["ttft_ms"])
        fig.data[1].update(x=p["prompt_len"], y=p["tpot_ms"])
        fig.layout.title = dict(text=f"Measured points at {like['preset']}, {like['dtype']}, {like['device']}, "
                                     f"batch {like['batch']}, {like['new_tokens']} output tokens", font_size=13)


# --- (c) MBU and MFU against the measured peaks ---------------------------------------------------

def utilization_data(row: dict) -> dict:
    """Percent of the measured peaks, with what was achieved and what the peak is.

    `shown` caps each bar at 100: a share above the peak means the peak is wrong for this request (measured while
    the machine was busy, or a small model running from a cache faster than a copy through main memory), not that
    the hardware beat its ceiling, so the bar stops at the ceiling and its label says so.
    """
    gbs, peak_gbs = row["achieved_Bps"] / 1e9, row["peak_bandwidth_Bps"] / 1e9
    decode_flops = row["mfu_decode"] * row["peak_flops"]
    percent = [100 * row["mbu"], 100 * row["mfu_prefill"], 100 * row["mfu_decode"]]
    text = [f"{gbs:.1f} of {peak_gbs:.1f} GB/s", f"{row['achieved_flops'] / 1e9:.0f} of "
            f"{row['peak_flops'] / 1e9:.0f} GFLOP/s", f"{decode_flops / 1e9:.1f} of "
            f"{row['peak_flops'] / 1e9:.0f} GFLOP/s"]
    return dict(labels=["decode: copy bandwidth", "prefill: matmul peak", "decode: matmul peak"], percent=percent,
                shown=[min(p, 100.0) for p in percent],
                text=[t + (f" ({p:.0f}%: the peak looks wrong)" if p > 100 else "") for t, p in zip(text, percent)],
                above_peak=[lab for lab, p in zip(["copy bandwidth", "prefill matmul peak", "decode matmul peak"],
                                                   percent) if p > 100])


def utilization_figure(row: dict | None = None) -> go.Figure:
    """Trace 0: bars of decode's share of measured copy bandwidth and prefill's and decode's share of the measured
    matmul peak, in percent (the measured-peak cousins of MBU and MFU, which divide by datasheet peaks)."""
    fig = go.Figure([go.Bar(x=[], y=[], text=[], textposition="outside",
                            marker_color=[DECODE_COLOR, PREFILL_COLOR, DECODE_COLOR])])
    fig.update_layout(height=300, yaxis_title="% of measured peak", margin=dict(l=10, r=10, t=60, b=40),
                      title=dict(text="Utilization vs this machine's measured peaks", font_size=13))
    fig.update_yaxes(rangemode="tozero")
    if row is not None:
        update_utilization(fig, row)
    return with_units(fig)


def update_utilization(fig: go.Figure, row: dict) -> None:
    d = utilization_data(row)
    with fig.batch_update():
        fig.data[0].update(x=d["labels"], y=d["shown"], text=d["text"])
        fig.layout.yaxis.range = [0, 125]             # room for the labels above a full bar; never above 100%


# --- the seed's bar chart, redrawn ----------------------------------------------------------------

def seed_comparison_figure(row: dict) -> go.Figure:
    """Seed 001's illustrative 400 ms / 6,000 ms beside this machine's prefill and decode times."""
    labels = [f"prefill ({row['prompt_len']:,} prompt tokens)", f"decode ({row['new_tokens']:,} output tokens)"]
    measured = [row["ttft_s"] * 1e3, (row["latency_s"] - row["ttft_s"]) * 1e3]
    fig = go.Figure([
        go.Bar(name="seed text (illustrative GPU)", x=labels, y=[SEED_PREFILL_MS, SEED_DECODE_MS],
               marker_color=SEED_COLOR, text=[f"{v:,.0f} ms" for v in (SEED_PREFILL_MS, SEED_DECODE_MS)]),
        go.Bar(name=f"this machine ({row['preset']}, {row['dtype']}, {row['device']})", x=labels, y=measured,
               marker_color=MEASURED_COLOR, text=[f"{v:,.0f} ms" for v in measured]),
    ])
    fig.update_layout(barmode="group", yaxis_title="time (ms)", height=380,
                      title="Where the time of one request goes")
    return fig


__all__ = ["SEED_DECODE_MS", "SEED_OUTPUT_TOKENS", "SEED_PREFILL_MS", "SEED_PROMPT_TOKENS", "describe",
           "seed_comparison_figure", "sweep_figure", "sweep_points", "timeline_data", "timeline_figure",
           "update_sweep", "update_timeline", "update_utilization", "utilization_data", "utilization_figure"]
