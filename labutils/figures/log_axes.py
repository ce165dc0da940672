"""Readable log axes: major ticks only, powers of two for counts, 1-2-5 per decade for everything else.

Left to itself, plotly labels a log axis that spans a decade or two with its minor digits ("2 3 4 ... 1000 2",
"8 9 1"), which reads as noise. Every log axis in the course goes through `log_axis`, so they all read alike:
- "pow2" for things counted in powers of two (tokens, batch sizes, buffer sizes): 1, 2, 4, 8, ..., 1k, 2k;
- "125" for measured quantities (times, bytes, rates, ratios): 1, 2, 5, 10, 20, 50, ...
"""
from __future__ import annotations

import math
from typing import Iterable

KINDS = ("pow2", "125")
MAX_TICKS = 12           # past this, every other tick is dropped so labels never collide


def _finite_positive(values: Iterable[float]) -> list[float]:
    out = []
    for v in values:
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f) and f > 0:
            out.append(f)
    return out


def log_ticks(lo: float, hi: float, kind: str = "125") -> list[float]:
    """Major tick values from just below `lo` to just above `hi` (both > 0)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not (lo > 0 and hi > 0 and math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"a log axis needs positive, finite ends, got {lo!r} and {hi!r}")
    lo, hi = min(lo, hi), max(lo, hi)
    if kind == "pow2":
        e0, e1 = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
        step = max(1, math.ceil((e1 - e0 + 1) / MAX_TICKS))       # every power, or every 2nd, 4th, ...
        return [2.0 ** e for e in range(e0, e1 + step, step)]
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    ticks = [m * 10.0 ** e for e in range(e0, e1 + 1) for m in (1, 2, 5)]
    while len(ticks) > 2 and ticks[1] <= lo:             # one tick below the data, not three
        ticks.pop(0)
    while len(ticks) > 2 and ticks[-2] >= hi:
        ticks.pop()
    if len(ticks) <= MAX_TICKS:
        return ticks
    step = max(1, math.ceil((e1 - e0 + 1) / MAX_TICKS))      # too many: decades only, or every 2nd decade ...
    return [10.0 ** e for e in range(e0, e1 + step, step)]


def tick_label(value: float) -> str:
    """1, 2, 0.5, 0.05, 1k, 20k, 5M, 1G: short enough for any axis."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def log_axis(values: Iterable[float], kind: str = "125", **axis) -> dict:
    """A plotly axis dict (for xaxis=..., yaxis=..., or fig.update_xaxes(**...)) of type log with major ticks
    covering `values` (non-positive and non-finite ones are ignored); `axis` adds or overrides keys (title=...)."""
    data = _finite_positive(values)
    out = dict(type="log")
    if data:
        ticks = log_ticks(min(data), max(data), kind)
        out.update(tickvals=ticks, ticktext=[tick_label(t) for t in ticks])
    out.update(axis)
    return out


def _axis_values(fig, name: str) -> list[float]:
    """Every value the figure's traces plot on layout axis `name` ("xaxis", "yaxis2", ...)."""
    letter, ref = name[0], name[0] + name[5:]               # "yaxis2" -> "y", "y2"
    out = []
    for trace in fig.data:
        if (getattr(trace, f"{letter}axis", None) or letter) == ref:
            out += list(getattr(trace, letter, None) or [])
    return out


def tidy_log_axes(fig, pow2: str = "") -> "go.Figure":
    """Give every log axis of `fig` major ticks from its traces' values; axes whose letter is in `pow2` ("x", "xy")
    get powers of two, the rest 1-2-5. Returns the figure, so a lesson can write tidy_log_axes(fig, "x").show()."""
    for name in [k for k in fig.layout.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]:
        axis = fig.layout[name]
        if axis.type == "log":
            values = _finite_positive(_axis_values(fig, name))
            if values:
                ticks = log_ticks(min(values), max(values), "pow2" if name[0] in pow2 else "125")
                axis.update(tickvals=ticks, ticktext=[tick_label(t) for t in ticks])
    return fig
