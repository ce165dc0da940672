"""The batch slider of lesson 07: each batch size times a real decode step and moves its point on the roofline."""
from __future__ import annotations

import html

import ipywidgets as w

from labutils.measure import request as measure
from labutils.figures import roofline as figs
from labutils.core.dtypes import torch_dtype
from labutils.core.devices import pick_device
from labutils.perf.peaks import measured_peaks
from labutils.model.gpt import GPTConfig
from labutils.core.validate import check_row
from labutils.widgets.plot import Plot

BATCHES = (1, 2, 4, 8, 16, 32, 64)
# What the plots and the status line read from a measure.roofline_point row.
ROW_NUMBERS = ("n", "seconds", "intensity", "achieved_flops", "achieved_Bps", "tokens_per_s")


class BatchRoofline(w.VBox):
    """A batch slider, a status line and two Plots (the roofline and tokens/s against batch).

    A thin view over measure.roofline_point and labutils.figures.roofline. Each batch is measured once
    and cached; errors go to the status line and the last good plots stay.
    """

    def __init__(self, device=None, preset: str = "gpt2-small", dtype: str | None = None, pos: int = 128,
                 points=(), peaks=None, measure_fn=measure.roofline_point):
        self.device = str(pick_device(device))     # None: the best there is; anything else parsed by the device rule
        self.preset, self.pos = preset, pos
        self.dtype = dtype or measure.default_dtype_name(self.device)
        self._measure = measure_fn
        self.cfg = GPTConfig.preset(preset)
        self.peaks = measured_peaks(self.device, torch_dtype(self.dtype)) if peaks is None else peaks
        self.points = {(p["phase"], p["n"]): p for p in points}
        self.slider = w.SelectionSlider(options=list(BATCHES), value=1, description="batch",
                                        continuous_update=False, layout=w.Layout(width="420px"))
        self.status = w.HTML()
        self.fig_roof = Plot(figs.roofline_figure(self.peaks, list(self.points.values())))
        self.fig_batch = Plot(figs.batch_figure(self.cfg, BATCHES, pos, self.dtype, self.peaks,
                                                list(self.points.values())))
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        super().__init__([self.slider, self.status, self.fig_roof, self.fig_batch])
        self.show(self.slider.value)

    def show(self, batch) -> dict | None:
        """Measure a decode step at `batch` (unless cached) and redraw; on error say why and keep the plots."""
        try:
            if ("decode", batch) not in self.points:
                self.status.value = f"&#9203; timing a decode step at batch {html.escape(str(batch))} ..."
                row = self._measure(self.preset, "decode", batch, self.dtype, self.device, pos=self.pos)
                self.points[("decode", batch)] = check_row("the measurement", row, ROW_NUMBERS, ("phase",))
            row = self.points[("decode", batch)]
            rows = list(self.points.values())
            figs.update_points(self.fig_roof.figure, rows, row)
            figs.update_batch(self.fig_batch.figure, rows, row)
            self.fig_roof.redraw()
            self.fig_batch.redraw()
            side = "below" if row["intensity"] < self.peaks.ridge else "above"
            self.status.value = (f"batch <b>{batch}</b>: step {row['seconds'] * 1e3:.1f} ms, "
                                 f"<b>{row['tokens_per_s']:.0f} tokens/s</b>, {row['achieved_Bps'] / 1e9:.1f} GB/s, "
                                 f"{row['achieved_flops'] / 1e9:.0f} GFLOP/s; intensity {row['intensity']:.1f} "
                                 f"FLOP/byte, {side} the ridge ({self.peaks.ridge:.1f})")
        except Exception as err:                  # the view must survive anything a setting can cause
            self.status.value = (f"<span style='color:#b00020'><b>Could not measure batch {html.escape(str(batch))}:"
                                 f"</b> {html.escape(str(err))}</span> <i>(the plots keep the last good points)</i>")
            return None
        return row


def batch_roofline(device=None, **kwargs) -> BatchRoofline:
    """The lesson-07 batch slider on `device`; points= (rows already measured) start it, peaks= defaults to
    peaks.measured_peaks for the dtype."""
    return BatchRoofline(device, **kwargs)
