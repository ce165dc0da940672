"""Lesson 06's pictures: which slots of a real KVCache hold keys and values, and cache bytes against context."""
from __future__ import annotations

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from labutils.core.validate import check_count, describe
from labutils.figures.log_axes import tidy_log_axes
from labutils.model.presets import ModelShape, get_shape
from labutils.perf.roofline import kv_cache_bytes, sliding_window, weight_bytes
from labutils.figures.hover import with_units

EMPTY, PROMPT, DECODED = 0, 1, 2          # what a slot holds, as the heatmap colours it
GB = 1e9                                  # decimal gigabytes, as GPU memory and the essay's "14 GB" are quoted


def clear(cache) -> None:
    """Fill both buffers with NaN, so a slot that was never written can be told from one that was.

    KVCache allocates with torch.empty (attention never reads past pos, so zeroing would be wasted work);
    its unwritten slots hold whatever memory held before, which can look like numbers.
    """
    if not cache.dtype.is_floating_point:
        raise TypeError(f"cache must hold floating-point keys and values to mark slots with NaN, got {cache.dtype}")
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))


def fill_map(cache, prompt_len: int, row: int = 0) -> tuple[torch.Tensor, list[str]]:
    """What each slot of one sequence's cache holds, read from the buffers themselves.

    Returns z [n_layer x 2 x n_kv_head, max_len] with EMPTY (still NaN: see clear), PROMPT (written, position
    < prompt_len) or DECODED, and one label per row, "L0 K h0" ... : the buffers' real order, layer by layer,
    keys then values, head by head.
    """
    if not hasattr(cache, "k") or cache.k.dim() != 5:
        raise TypeError(f"cache must be a KVCache (k and v of 5 dims), got {describe(cache)}")
    n_layer, batch, n_kv, max_len, _ = cache.k.shape
    prompt_len = check_count("prompt_len", prompt_len, 0, max_len)
    row = check_count("row", row, 0, batch - 1, hint=f"the cache holds {batch} sequence(s)")
    both = torch.stack([cache.k[:, row], cache.v[:, row]], dim=1)      # [n_layer, 2, n_kv, max_len, head_dim]
    written = ~torch.isnan(both).all(dim=-1)                 # a slot is written once any number is
    where = torch.where(torch.arange(max_len, device=both.device) < prompt_len, PROMPT, DECODED)
    z = torch.where(written, where, EMPTY).reshape(n_layer * 2 * n_kv, max_len).cpu()
    labels = [f"L{layer} {kv} h{head}" for layer in range(n_layer) for kv in "KV" for head in range(n_kv)]
    return z, labels


def fill_figure(snapshots: dict[str, torch.Tensor], labels: list[str]) -> go.Figure:
    """Heatmaps of fill_map snapshots side by side: rows (layer, K/V, head), columns positions."""
    if not snapshots:
        raise ValueError("snapshots must name at least one fill_map, e.g. {'after prefill': z}")
    fig = make_subplots(1, len(snapshots), shared_yaxes=True, subplot_titles=list(snapshots),
                        horizontal_spacing=0.03)
    scale = [[0, "#f2f2f2"], [0.33, "#f2f2f2"], [0.34, "#1f77b4"], [0.66, "#1f77b4"], [0.67, "#ff7f0e"],
             [1, "#ff7f0e"]]
    for i, z in enumerate(snapshots.values(), start=1):
        fig.add_trace(go.Heatmap(z=z.tolist(), y=labels, zmin=EMPTY, zmax=DECODED, colorscale=scale,
                                 showscale=i == 1, xgap=1, ygap=1, name="slots",
                                 colorbar=dict(tickvals=[0, 1, 2], ticktext=["empty", "prompt", "decoded"]),
                                 hovertemplate="%{y}, position %{x}<extra></extra>"), 1, i)
        fig.update_xaxes(title_text="position", row=1, col=i)
    fig.update_yaxes(autorange="reversed", tickfont=dict(size=8))
    fig.update_layout(height=520, margin=dict(t=60, b=40, l=70, r=20),
                      title="KVCache slots [layer, K/V, head] x positions, one sequence")
    return fig


def cache_vs_context_figure(shapes, points: int = 65, weights_of: int = 2) -> go.Figure:
    """One sequence's fp16 cache (GB) against context for each shape, drawn up to that model's own context
    (a sliding window shows as a flat line), with the fp16 weights of the first `weights_of` as dotted lines.

    The y axis is logarithmic: on a linear one the 13-16 GB weight lines pressed every cache curve into the bottom
    strip of the plot. The weights are traces with a label at their end, not shapes, so they sit at their value
    on the log axis too.
    """
    points, weights_of = check_count("points", points, 2), check_count("weights_of", weights_of, 0)
    fig = go.Figure()
    longest = 0
    for m in shapes:
        ctx, gb = cache_curve(m, 1, "fp16", points)
        longest = max(longest, ctx[-1])
        fig.add_scatter(x=ctx, y=gb, mode="lines", name=m.name)
    # The heaviest weights' label sits above its line and the others' below theirs: llama-3-8b's 16 GB and
    # llama-2-7b's 13.5 GB are close on a log axis, and two labels above their lines printed over each other.
    heaviest = max((weight_bytes(m) for m in list(shapes)[:weights_of]), default=0)
    for m in list(shapes)[:weights_of]:
        w = weight_bytes(m) / GB
        fig.add_scatter(x=[0, longest], y=[w, w], mode="lines+text", line=dict(dash="dot", color="gray"),
                        text=["", f"{m.name} weights (fp16)"], name=f"{m.name} weights", showlegend=False,
                        textposition="top left" if weight_bytes(m) == heaviest else "bottom left")
    fig.update_layout(title="KV cache of one sequence (fp16) against context, each model to its own context",
                      xaxis_title="tokens", yaxis=dict(title="GB (log scale)", type="log"), height=420)
    return with_units(tidy_log_axes(fig))


def cache_curve(preset, batch: int = 1, dtype: str = "fp16", points: int = 129) -> tuple[list[int], list[float]]:
    """Context lengths from 0 to the model's context and the cache GB at each: a straight line, flat past a
    sliding window (the window itself is one of the points, so the bend is drawn where it is).

    `preset` is a preset name or a ModelShape (a variant such as shape.with_kv_heads(1)).
    """
    shape = preset if isinstance(preset, ModelShape) else get_shape(preset)
    batch, points = check_count("batch", batch, 1), check_count("points", points, 2)
    xs = {round(i * shape.context_length / (points - 1)) for i in range(points)}
    window = sliding_window(shape)
    xs = sorted(xs | ({window} if window is not None and window < shape.context_length else set()))
    return xs, [kv_cache_bytes(shape, x, batch, dtype) / GB for x in xs]


__all__ = ["DECODED", "EMPTY", "GB", "PROMPT", "cache_curve", "cache_vs_context_figure", "clear", "fill_figure", "fill_map"]
