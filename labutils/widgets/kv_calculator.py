"""KV-cache calculator: cache bytes against weight bytes for real model shapes, context, batch and dtype."""
from __future__ import annotations

import html

import ipywidgets as w
import plotly.graph_objects as go

from labutils.perf.roofline import (kv_bytes_per_token, kv_cache_bytes, kv_positions, sliding_window,
                                    tokens_where_cache_exceeds_weights, weight_bytes)
from labutils.model.presets import PRESETS, get_shape
from labutils.core.validate import check_choice, check_count, check_dtype
from labutils.widgets.controls import IntSlider
from labutils.widgets.plot import Plot
from labutils.figures.kv import GB, cache_curve


CACHE_DTYPES = ("fp16", "bf16", "fp8", "int8")


def kv_summary(preset: str, context: int, batch: int = 1, dtype: str = "fp16", weight_dtype: str = "fp16") -> dict:
    """Everything the calculator shows, as plain numbers; raises ValueError for impossible settings."""
    shape = get_shape(preset)
    context = check_count("context", context, 1)
    if context > shape.context_length:
        raise ValueError(f"{preset} reads at most {shape.context_length:,} tokens of context, not {context:,}; "
                         f"lower the context, or pick a model with a longer context")
    batch = check_count("batch", batch, 1)
    dtype, weight_dtype = check_dtype("dtype", dtype), check_dtype("weight_dtype", weight_dtype)
    cache, weights = kv_cache_bytes(shape, context, batch, dtype), weight_bytes(shape, weight_dtype)
    crossover = tokens_where_cache_exceeds_weights(shape, batch, dtype, weight_dtype)    # None: never
    s = dict(preset=preset, context=context, batch=batch, dtype=dtype, weight_dtype=weight_dtype,
             context_length=shape.context_length, n_layer=shape.n_layer, n_kv_head=shape.n_kv_head,
             head_dim=shape.head_dim, bytes_per_token=kv_bytes_per_token(shape, dtype), cache_bytes=cache,
             sliding_window=sliding_window(shape), cached_positions=kv_positions(shape, context),
             weight_bytes=weights, cache_to_weights=cache / weights, crossover_tokens=crossover,
             crossover_in_context=crossover is not None and crossover <= shape.context_length,
             # the smallest batch whose cache, at this context, holds more bytes than the weights
             batch_to_exceed=weights // kv_cache_bytes(shape, context, 1, dtype) + 1)
    s["text"] = summary_text(s)
    return s


def summary_text(s: dict) -> str:
    """One paragraph in words for a kv_summary dict."""
    seqs = "sequence" if s["batch"] == 1 else "sequences"
    lines = [
        f"{s['preset']}: {s['n_layer']} layers x {s['n_kv_head']} KV heads x {s['head_dim']} dims x K and V "
        f"= {s['bytes_per_token']:,} bytes ({s['bytes_per_token'] / 2**20:.3g} MiB) per token in {s['dtype']}.",
        f"{s['batch']} {seqs} x {s['context']:,} tokens: {s['cache_bytes'] / GB:.2f} GB of KV cache vs "
        f"{s['weight_bytes'] / GB:.2f} GB of {s['weight_dtype']} weights "
        f"({100 * s['cache_to_weights']:.0f}% of the weights).",
    ]
    window = s["sliding_window"]
    if window is not None and s["context"] > window:
        lines.append(f"Its {window:,}-token sliding window keeps only the last {window:,} positions: "
                     "past that the cache stops growing.")
    if s["crossover_in_context"]:
        lines.append(f"The cache overtakes the weights at {s['crossover_tokens']:,} tokens per sequence.")
    elif s["crossover_tokens"] is None:
        lines.append(f"At this batch the cache never overtakes the weights: the sliding window stops it at "
                     f"{window:,} tokens per sequence.")
    else:
        lines.append(f"The cache would overtake the weights at {s['crossover_tokens']:,} tokens per sequence, "
                     f"beyond this model's {s['context_length']:,}-token context.")
    lines.append(f"At {s['context']:,} tokens, a batch of {s['batch_to_exceed']:,} makes the cache bigger "
                 "than the weights.")
    return " ".join(lines)


class KVCalculator(w.VBox):
    """Preset dropdown, context and batch sliders, cache dtype toggle; a Plot and a summary.

    Traces, each named for the legend: 0 the cache (GB) against context, 1 the weights as a horizontal line,
    2 the crossover point (empty when it lies beyond the context or never comes), 3 the chosen context,
    4 the sliding window as a vertical line (empty for full attention).
    """

    def __init__(self, preset: str = "llama-2-7b", context: int = 4096, batch: int = 1, dtype: str = "fp16"):
        shape = get_shape(preset)      # an unknown name fails here, loudly, before any widget exists
        style, wide = {"description_width": "90px"}, w.Layout(width="420px")
        self.preset = w.Dropdown(options=list(PRESETS), value=preset, description="model", style=style, layout=wide)
        # The slider ends at the model's own context: past it, every setting only said "not possible".
        self.context = IntSlider(name="context", value=check_count("context", context), min=1,
                                 max=shape.context_length, step=1, description="context", continuous_update=False,
                                 style=style, layout=wide)
        self.batch = IntSlider(name="batch", value=check_count("batch", batch), min=1, max=256, description="batch",
                               continuous_update=False, style=style, layout=wide)
        self.dtype = w.ToggleButtons(options=list(CACHE_DTYPES), value=check_choice("dtype", dtype, CACHE_DTYPES),
                                     description="cache dtype",
                                     style={"description_width": "90px", "button_width": "60px"})
        self.summary = w.HTML()
        self.fig = Plot(_empty_figure())
        # First, so a shorter model's context has moved the slider before the redraw reads it.
        self.preset.observe(self._fit_context, names="value")
        for control in (self.preset, self.context, self.batch, self.dtype):
            control.observe(lambda change: self.refresh(), names="value")
        super().__init__([w.HBox([w.VBox([self.preset, self.context, self.batch]), self.dtype]),
                          self.summary, self.fig])
        self.refresh()

    def _fit_context(self, change) -> None:
        if change["new"] in PRESETS:          # a Dropdown may also hold None (no choice); refresh says so
            self.context.max = get_shape(change["new"]).context_length

    def refresh(self) -> dict | None:
        """Redraw for the current controls; an impossible setting becomes a message, never an exception.

        Everything is computed before the figure is touched, so a bad setting leaves the last good plot.
        """
        preset, batch, dtype = self.preset.value, self.batch.value, self.dtype.value
        try:
            xs, ys = cache_curve(preset, batch, dtype)
            shape = get_shape(preset)
            weights = weight_bytes(shape) / GB
            crossover = tokens_where_cache_exceeds_weights(shape, batch, dtype)
            window = sliding_window(shape)
        except Exception as err:              # an observer must never raise: say why, keep the plot
            self.summary.value = _error_html(err)
            return None
        try:
            s = kv_summary(preset, self.context.value, batch, dtype)
        except (TypeError, ValueError) as err:
            s = None
            self.summary.value = _error_html(err)
        fig = self.fig.figure
        with fig.batch_update():
            fig.data[0].update(x=xs, y=ys, name=f"KV cache, batch {batch}, {dtype}")
            fig.data[1].update(x=[0, shape.context_length], y=[weights, weights],
                                    name=f"weights ({shape.n_params / 1e9:.2f}B params, fp16)")
            inside = crossover is not None and crossover <= shape.context_length
            # An empty trace leaves the legend too, so the legend lists exactly what is drawn.
            # Every update restates the name: JupyterLab's plotly drew "trace 2" / "trace 3" for traces that
            # started empty and were named only in the initial figure.
            fig.data[2].update(x=[crossover] if inside else [], showlegend=inside, name="crossover",
                                    y=[kv_cache_bytes(shape, crossover, batch, dtype) / GB] if inside else [])
            if s is None:
                fig.data[3].update(x=[], y=[], showlegend=False, name="chosen context")
            else:
                fig.data[3].update(x=[s["context"]], y=[s["cache_bytes"] / GB], showlegend=True,
                                        name=f"chosen context ({s['context']:,} tokens)")
            top = max(weights, ys[-1])
            fig.data[4].update(x=[window, window] if window else [], y=[0, top] if window else [],
                                    showlegend=window is not None,
                                    name=f"sliding window ({window:,} tokens)" if window else "sliding window")
            where = (f"cache passes the weights at {crossover:,} tokens" if inside else
                     "the sliding window keeps the cache below the weights" if crossover is None else
                     f"the cache passes the weights only at {crossover:,} tokens, beyond the context")
            fig.layout.title.text = f"{preset}: {where}"
            # A little room past the context, so the chosen-context dot at the maximum is drawn whole.
            fig.layout.xaxis.range = [0, 1.02 * shape.context_length]
        self.fig.redraw()
        if s is not None:
            self.summary.value = html.escape(s["text"])
        return s


def _error_html(err: Exception) -> str:
    return f"<span style='color:#b00020'><b>Not possible:</b> {html.escape(str(err))}</span>"


def _empty_figure() -> go.Figure:
    fig = go.Figure([
        go.Scatter(mode="lines", line=dict(width=3, color="#1f77b4"), name="KV cache"),
        go.Scatter(mode="lines", line=dict(dash="dash", color="#444"), name="weights"),
        go.Scatter(mode="markers", marker=dict(size=12, color="#d62728", symbol="x"), name="crossover"),
        go.Scatter(mode="markers", marker=dict(size=10, color="#2ca02c"), name="chosen context"),
        go.Scatter(mode="lines", line=dict(dash="dot", color="#9467bd"), name="sliding window"),
    ])
    # The legend sits below the plot: inside it, it covered the crossover and the window's bend.
    fig.update_layout(xaxis_title="context (tokens per sequence)", yaxis_title="GB", height=420,
                      margin=dict(t=50, b=40, l=60, r=20),
                      legend=dict(orientation="h", x=0, y=-0.18, yanchor="top"))
    return fig


def kv_calculator(preset: str = "llama-2-7b", context: int = 4096, batch: int = 1, dtype: str = "fp16") -> KVCalculator:
    """The KV-cache calculator widget; every number it shows comes from kv_summary()."""
    return KVCalculator(preset, context, batch, dtype)


__all__ = ['CACHE_DTYPES', 'KVCalculator', 'kv_calculator', 'kv_summary', 'summary_text']
