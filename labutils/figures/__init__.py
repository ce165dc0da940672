"""Plotly figures the lessons and widgets share, each a plain function of measured rows, and readable log axes.
May import: core, text, model, perf, decode, serving, measure; widget views above it draw them."""
from labutils.figures import request, roofline
from labutils.figures.hardware import add_log_vline, bandwidth_figure, datasheet_figure, legend_names, rooflines_figure
from labutils.figures.kv import cache_curve, cache_vs_context_figure, clear, fill_figure, fill_map
from labutils.figures.log_axes import tidy_log_axes
from labutils.figures.serving import batch_figure, budget_figure, gantt_figure, itl_figure
