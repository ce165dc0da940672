"""TTFT/TPOT explorer: every control change runs a real request and redraws three plots."""
from __future__ import annotations

import html
from contextlib import contextmanager

import ipywidgets as w
import torch

from labutils.measure import request as measure
from labutils.perf import quiet
from labutils.figures import request as rf
from labutils.core.dtypes import torch_dtype
from labutils.core.progress_bar import Pace
from labutils.core.devices import pick_device
from labutils.perf.peaks import measured_peaks
from labutils.model.gpt import GPTConfig
from labutils.core.validate import check_choice, check_count, check_row
from labutils.widgets.controls import IntSlider
from labutils.widgets.debounce import Latest
from labutils.widgets.plot import Plot

MAX_PROMPT = 4096                 # longer prompts take minutes on a CPU; the slider stops here
MAX_NEW = 256
BATCHES = (1, 2, 4, 8, 16, 32)
# What the plots and the status line read from a measurement row (measure.measure_request's keys).
ROW_NUMBERS = ("ttft_s", "tpot_s", "latency_s", "decode_tok_s", "achieved_Bps", "achieved_flops", "mbu",
               "mfu_prefill", "mfu_decode", "peak_bandwidth_Bps", "peak_flops", "prompt_len", "new_tokens", "batch")
ROW_OTHERS = ("timestamps", "preset", "dtype", "device")


STAGE = 25          # progress steps per stage of a measurement


class Explorer(w.VBox):
    """Controls, a status line with a progress bar, and three Plots.

    A thin view: measurement is `measure` (measure.measure_request by default), figures come from
    labutils.figures.request. Results are cached by settings, so returning to a setting redraws
    without measuring again. Errors go to the status line and the last good plots stay.
    """

    def __init__(self, device=None, preset: str | None = None, prompt_len: int = 128, new_tokens: int = 32,
                 batch: int = 1, dtype: str | None = None, measure_fn=measure.measure_request):
        device = str(pick_device(device))          # None: the best there is; anything else parsed by the device rule
        self._measure = measure_fn
        self.results: dict[tuple, dict] = {}      # settings -> row
        self.busy: dict[tuple, str] = {}          # settings -> labutils.perf.quiet's warning, when others were busy
        self.rows: list[dict] = []                # every measurement, for the sweep plot
        self.measurements = 0
        self._hold = False

        presets, notes = measure.preset_choices(device)
        if preset is None:
            preset = "gpt2-small" if "gpt2-small" in presets else presets[0]
        if preset not in presets:
            raise ValueError(f"preset {preset!r} is not offered on {device}; choose one of {presets}")
        dtype = dtype or measure.default_dtype_name(device)
        style = {"description_width": "110px"}
        wide = w.Layout(width="360px")
        self.device = w.Dropdown(options=measure.available_devices(), value=torch.device(device).type,
                                 description="device", style=style, layout=wide)
        self.preset = w.Dropdown(options=presets, value=preset, description="model shape", style=style, layout=wide)
        self.dtype = w.Dropdown(options=measure.dtype_choices(device), value=dtype, description="dtype",
                                style=style, layout=wide)
        self.batch = w.SelectionSlider(options=list(BATCHES), value=check_choice("batch", batch, BATCHES),
                                       description="batch",
                                       continuous_update=False, style=style, layout=wide)
        self.prompt_len = IntSlider(name="prompt_len", value=check_count("prompt_len", prompt_len), min=8,
                                    max=MAX_PROMPT, step=8, description="prompt tokens", continuous_update=False,
                                    style=style, layout=wide)
        self.new_tokens = IntSlider(name="new_tokens", value=check_count("new_tokens", new_tokens), min=2,
                                    max=MAX_NEW, step=2, description="output tokens", continuous_update=False,
                                    style=style, layout=wide)
        self.again = w.Button(description="measure again", icon="refresh",
                              layout=w.Layout(width="auto", flex="0 0 auto"),    # a fixed width cut the caption
                              tooltip="forget the cached result of this setting and measure it again")
        self.again.on_click(lambda _: self.remeasure())
        # Four stages of STAGE steps each; the request's own stage fills as its tokens arrive (a 15 s request once
        # left the bar frozen at stage 2 of 4).
        self.progress = w.IntProgress(value=0, min=0, max=4 * STAGE, bar_style="info", layout=w.Layout(width="160px"))
        self.status = w.HTML()
        self.notes = w.HTML(_notes_html(device, notes))
        self.fig_timeline = Plot(rf.timeline_figure())
        self.fig_sweep = Plot(rf.sweep_figure())
        self.fig_util = Plot(rf.utilization_figure())
        self._latest = Latest(self.refresh)
        self._pace = Pace()
        context = GPTConfig.preset(preset).context_length
        if self.prompt_len.value + self.new_tokens.value > context:     # _clamp would move new_tokens quietly
            raise ValueError(f"prompt_len ({self.prompt_len.value}) + new_tokens ({self.new_tokens.value}) = "
                             f"{self.prompt_len.value + self.new_tokens.value} tokens exceed {preset}'s context "
                             f"length {context}; shorten one of them")
        self._clamp()
        for control in (self.device, self.preset, self.dtype, self.batch, self.prompt_len, self.new_tokens):
            control.observe(self._changed, names="value")
        super().__init__([
            w.HBox([w.VBox([self.preset, self.prompt_len, self.new_tokens]),
                    w.VBox([self.batch, self.dtype, self.device])]),
            w.HBox([self.again, self.progress, self.status]), self.notes,
            # Stacked, each as wide as the output column: side by side they need about 880 px, and JupyterLab's
            # default window with its file browser open gives a notebook about 845.
            self.fig_timeline, self.fig_sweep, self.fig_util,
        ])
        self.refresh()

    # -- settings ---------------------------------------------------------------------------------

    @property
    def settings(self) -> dict:
        return dict(preset=self.preset.value, prompt_len=self.prompt_len.value, new_tokens=self.new_tokens.value,
                    batch=self.batch.value, dtype=self.dtype.value, device=self.device.value)

    def _clamp(self) -> None:
        """Keep prompt + output within the shape's context: a switch to a shorter shape clamps both sliders."""
        context = GPTConfig.preset(self.preset.value).context_length
        self.prompt_len.max = min(context - self.new_tokens.min, MAX_PROMPT)
        self.new_tokens.max = max(self.new_tokens.min, min(MAX_NEW, context - self.prompt_len.value))

    @contextmanager
    def _holding(self):
        """Change several controls and measure once, not once per control."""
        self._hold = True
        try:
            yield
        finally:
            self._hold = False

    def _changed(self, change) -> None:
        if self._hold:
            return
        try:
            with self._holding():
                if change["owner"] is self.device:
                    self._device_changed()
                self._clamp()
        except Exception as err:              # an observer must never raise (e.g. a control set to None)
            self._show_error(err)
            return
        self._stage(0, "waiting for the controls to settle ...")
        self._latest()                        # one measurement for a burst of changes, with the last settings

    def _device_changed(self) -> None:
        device = self.device.value
        presets, notes = measure.preset_choices(device)
        self.preset.options = presets
        if self.preset.value not in presets:
            self.preset.value = presets[0]
        dtypes = measure.dtype_choices(device)
        self.dtype.options = dtypes
        self.dtype.value = measure.default_dtype_name(device)
        self.notes.value = _notes_html(device, notes)

    # -- measuring --------------------------------------------------------------------------------

    def refresh(self) -> dict | None:
        """Measure the current settings (unless cached) and redraw; on error say why and keep the plots."""
        s = self.settings
        key = tuple(s.values())
        try:
            if key in self.results:
                row = self.results[key]
            else:
                measure.check_preset_request(**s)            # quick: context length, memory, dtype
                # Checked before it is kept or drawn: a row missing a key must not half-draw the plots.
                with quiet.watch(report=False) as window:
                    row = check_row("the measurement", self._run(s), ROW_NUMBERS, ROW_OTHERS)
                self.busy[key] = window.message if window.busy else ""
                self.results[key] = row
                self.rows.append(row)
            self._draw(row, s)
        except Exception as err:                      # the view must survive anything a setting can cause
            self._show_error(err)
            return None
        return row

    def _show_error(self, err: Exception) -> None:
        self.progress.value, self.progress.bar_style = 0, "danger"
        self.status.value = (f"<span style='color:#b00020'><b>Could not measure this setting:</b> "
                             f"{html.escape(str(err))}</span> <i>(the plots still show the last good "
                             f"measurement)</i>")

    def remeasure(self) -> dict | None:
        """Measure the current setting again (timings on a busy machine vary); the new row replaces the old."""
        self.results.pop(tuple(self.settings.values()), None)
        return self.refresh()

    def _stage(self, step: int, text: str) -> None:
        self.progress.value, self.progress.bar_style = step * STAGE, "info"
        self.status.value = f"&#9203; {html.escape(text)}"

    def _token(self, done: int, total: int) -> None:
        # Called inside the timed decode loop: a message to the page at most every Pace's gap, and the last one.
        if self._pace.ready(final=done >= total):
            self.progress.value = 2 * STAGE + STAGE * done // max(total, 1)     # stage 2, filled by the tokens

    def _run(self, s: dict) -> dict:
        self._stage(0, f"measuring this machine's peak bandwidth and FLOP/s ({s['device']}, {s['dtype']})")
        measured_peaks(s["device"], torch_dtype(s["dtype"]))          # cached after the first call
        self._stage(1, f"building a random-weight {s['preset']} ({s['dtype']}, {s['device']})")
        measure.get_model(s["preset"], s["dtype"], s["device"])          # cached after the first call
        self._stage(2, f"running: prefill {s['prompt_len']} tokens x batch {s['batch']}, "
                       f"then {s['new_tokens']} decode steps")
        row = self._measure(**s, on_token=self._token)
        if max(row.get(k, 0) for k in ("mbu", "mfu_prefill", "mfu_decode")) > 1:   # check_row names a missing key
            # Above 100% of a peak means the peak probe ran while something else held the machine (the
            # request itself was quicker than the "ceiling"). Probe once more and time the request again.
            self._stage(2, "a utilization came out above 100%: measuring the peaks and the request again")
            measured_peaks(s["device"], torch_dtype(s["dtype"]), refresh=True)
            row = self._measure(**s, on_token=self._token)
        self.measurements += 1
        return row

    def _draw(self, row: dict, s: dict) -> None:
        rf.update_timeline(self.fig_timeline.figure, row)
        rf.update_sweep(self.fig_sweep.figure, self.rows, s)
        rf.update_utilization(self.fig_util.figure, row)
        for plot in (self.fig_timeline, self.fig_sweep, self.fig_util):
            plot.redraw()
        self.progress.value, self.progress.bar_style = self.progress.max, "success"
        busy = self.busy.get(tuple(s.values()), "")
        above = rf.utilization_data(row)["above_peak"]
        warn = [busy] if busy else []
        if above:
            warn.append(f"above 100% of the measured {', '.join(above)} even after measuring the peaks again: the "
                        "peak looks wrong for this request, so its bar stops at 100%")
        reading = (f"TTFT <b>{row['ttft_s'] * 1e3:.1f} ms</b> &middot; TPOT <b>{row['tpot_s'] * 1e3:.2f} "
                   f"ms</b> ({row['decode_tok_s']:.1f} tokens/s, {row['achieved_Bps'] / 1e9:.2f} GB/s) "
                   f"&middot; decode {100 * min(row['mbu'], 1):.0f}% of measured copy bandwidth &middot; "
                   f"prefill {100 * min(row['mfu_prefill'], 1):.0f}% of the measured matmul peak")
        if busy:       # a reading taken beside other work: dimmed, with the way to a clean one
            reading = f"<span style='opacity:0.5'>{reading}</span>"
            warn[0] += " with the 'measure again' button"
        self.status.value = reading + "".join(f"<br><span style='color:#b00020'>&#9888; {html.escape(x)}</span>"
                                              for x in warn)


def _notes_html(device: str, notes: list[str]) -> str:
    free = measure.free_bytes(device)
    text = f"{free / 1e9:.1f} GB free on {torch.device(device).type}" if free != float("inf") else ""
    if notes:
        text += ("; " if text else "") + "not offered here: " + "; ".join(notes)
    return f"<small>{html.escape(text)}</small>"


def explorer(device=None, **settings) -> Explorer:
    """The TTFT/TPOT explorer on `device` (default: the best available). Settings: preset, prompt_len,
    new_tokens, batch, dtype. The default setting answers in about two seconds on a laptop CPU."""
    return Explorer(device, **settings)


__all__ = ["Explorer", "explorer"]
