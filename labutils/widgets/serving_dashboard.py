"""The lesson-09 load dashboard: workload and engine controls, a Run button, the meters and a Gantt of the run."""
from __future__ import annotations

import html

import ipywidgets as w

from labutils.perf import quiet
from labutils.serving.engine import Served, serve
from labutils.serving.scheduler import DEFAULT_BATCHED_TOKENS
from labutils.figures.serving import gantt_figure
from labutils.serving.workload import Workload, make_workload
from labutils.core.progress_bar import Pace
from labutils.core.validate import check_count
from labutils.model.gpt import GPT
from labutils.widgets.controls import IntSlider
from labutils.widgets.plot import Plot


STALE = "pdl-stale"          # the CSS class of results the controls no longer describe
BUSY = "pdl-busy"            # and of results timed while other processes held the CPU: both are dimmed


def dashboard_workload(context_length: int, vocab_size: int, *, n_requests: int, rate: float | None, prompt_len,
                       output_len, system_prompt_len: int = 0, seed: int = 0) -> Workload:
    """The dashboard's workload; refuses settings where not even the shortest request fits the context."""
    shortest = system_prompt_len + prompt_len[0] + output_len[0]
    if shortest > context_length:
        raise ValueError(f"the shortest request (shared prefix {system_prompt_len} + prompt {prompt_len[0]} + "
                         f"output {output_len[0]} = {shortest} tokens) exceeds the model's context of "
                         f"{context_length}; lower the shared prefix or the low ends of the length ranges")
    return make_workload(n_requests, vocab_size=vocab_size, prompt_len=prompt_len, output_len=output_len,
                         rate=rate, system_prompt_len=system_prompt_len, seed=seed)


def meters_html(served: Served) -> str:
    """The run's meters as a small HTML table: TTFT and TPOT p50/p99, throughput, cache hit rate."""
    s, st = served.summary, served.counts
    rows = [("TTFT p50 / p99", f"{s.ttft_s.p50 * 1e3:,.1f} / {s.ttft_s.p99 * 1e3:,.1f} ms"),
            ("TPOT p50 / p99", f"{s.tpot_s.p50 * 1e3:,.1f} / {s.tpot_s.p99 * 1e3:,.1f} ms"),
            ("throughput", f"{s.output_tok_s:,.0f} output tokens/s ({s.request_per_s:.1f} requests/s)"),
            ("prefix-cache hit rate", f"{st.hit_rate:.0%} of prompt tokens"),
            ("requests", f"{s.n_completed} of {s.n_requests} completed in {s.wall_s:.2f} s; "
                         f"{st.preemptions} preemptions")]
    cells = "".join(f"<tr><td style='padding-right:16px'>{k}</td><td><b>{v}</b></td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def budget_options(context_length: int) -> list[int]:
    """Token budgets the slider offers: powers of two from 16 to the larger of 2,048 and the context."""
    top, out = max(DEFAULT_BATCHED_TOKENS, context_length), [16]
    while out[-1] < top:
        out.append(out[-1] * 2)
    return out


class ServingDashboard(w.VBox):
    """Controls for a seeded workload and an Engine; Run serves it and shows the meters and a Gantt.

    A thin view over dashboard_workload and serving.engine.serve. Errors go to the status line,
    never out of a callback, and the last good results stay.
    """

    def __init__(self, model, *, n_requests: int = 24, seed: int = 0, serve_fn=serve):
        if not isinstance(model, GPT):
            raise TypeError(f"model must be a labutils GPT, got {type(model).__name__} {model!r:.60}; build or load "
                            "one first, such as load_pretrained('tiny')[0]")
        self.model, self.seed, self._serve = model, seed, serve_fn
        ctx = model.config.context_length
        style, wide = {"description_width": "110px"}, w.Layout(width="440px")
        self.rate = w.FloatLogSlider(value=50, base=10, min=0, max=3, step=0.05, description="arrivals / s",
                                     style=style, layout=wide)
        self.at_once = w.Checkbox(value=False, description="all at t=0", indent=False)
        self.slots = IntSlider(name="slots", value=8, min=1, max=64, description="batch slots", style=style,
                               layout=wide)
        self.prompt = w.IntRangeSlider(value=(8, min(64, ctx // 2)), min=1, max=ctx, description="prompt tokens",
                                       style=style, layout=wide)
        self.output = w.IntRangeSlider(value=(8, min(64, ctx // 4)), min=1, max=ctx, description="output tokens",
                                       style=style, layout=wide)
        self.prefix = IntSlider(name="prefix", value=0, min=0, max=ctx, step=16, description="shared prefix",
                                style=style, layout=wide)
        self.caching = w.Checkbox(value=True, description="prefix caching", indent=False)
        # The token budget per step (lesson 11). Without chunking the engine's own budget holds a whole prompt,
        # so the slider has nothing to say and is greyed out.
        self.chunked_prefill = w.Checkbox(value=True, description="chunked prefill", indent=False)
        self.budget = w.SelectionSlider(options=budget_options(ctx), value=DEFAULT_BATCHED_TOKENS,
                                        description="token budget", style=style, layout=wide)
        self.chunked_prefill.observe(lambda change: setattr(self.budget, "disabled", not change["new"]),
                                     names="value")
        self.requests = IntSlider(name="n_requests", value=check_count("n_requests", n_requests), min=1, max=128,
                                  description="requests", style=style, layout=wide)
        self.button = w.Button(description="Run workload", button_style="primary", icon="play",
                               layout=w.Layout(width="auto", flex="0 0 auto"))      # a fixed width cut the caption
        self.progress = w.IntProgress(value=0, min=0, max=1, layout=w.Layout(width="160px"))
        self.status, self.meters = w.HTML(), w.HTML()
        self.fig = Plot(gantt_figure([]))
        self.served: Served | None = None
        self.button.on_click(lambda _: self.run())
        controls = w.HBox([w.VBox([self.rate, self.slots, self.requests, self.budget, self.caching]),
                           w.VBox([self.prompt, self.output, self.prefix, self.at_once, self.chunked_prefill])])
        for control in (self.rate, self.at_once, self.slots, self.prompt, self.output, self.prefix, self.caching,
                        self.chunked_prefill, self.budget, self.requests):
            control.observe(lambda _: self._stale(), names="value")
        super().__init__([w.HTML(f"<style>.{STALE}, .{BUSY} {{opacity: 0.4}}</style>"), controls,
                          w.HBox([self.button, self.progress, self.status]), self.meters, self.fig])

    def _stale(self) -> None:
        """A control moved: the shown results no longer match the controls, so dim them and say so."""
        if self.served is None:
            return
        for view in (self.meters, self.fig):
            view.add_class(STALE)
        self.status.value = ("settings changed: the meters and the chart below are from the last run; "
                             "press <b>Run workload</b> for these settings")

    def workload(self) -> Workload:
        cfg = self.model.config
        return dashboard_workload(cfg.context_length, cfg.vocab_size, n_requests=self.requests.value,
                                  rate=None if self.at_once.value else self.rate.value,
                                  prompt_len=tuple(self.prompt.value), output_len=tuple(self.output.value),
                                  system_prompt_len=self.prefix.value, seed=self.seed)

    def engine_options(self) -> dict:
        """The Engine settings the controls give. Without chunking the budget must hold a whole context, so the
        engine's own default (vLLM's rule) stands in; a budget below the batch slots is the engine's error."""
        options = dict(prefix_caching=self.caching.value)
        if not self.chunked_prefill.value:
            return dict(options, chunked_prefill=False)
        return dict(options, max_num_batched_tokens=self.budget.value)

    def run(self) -> Served | None:
        """Serve the controls' workload; show its meters and Gantt, or say what went wrong.

        The button is disabled while a workload runs: the kernel is busy until it ends, so a second click would
        only queue a second run.
        """
        self.button.disabled = True
        try:
            return self._run()
        finally:
            self.button.disabled = False

    def _finished(self, done: int, total: int) -> None:
        # Called inside the served workload's clock: a message to the page at most every Pace's gap, and the last.
        if self._pace.ready(final=done >= total):
            self.progress.max, self.progress.value = total, done

    def _run(self) -> Served | None:
        try:
            self.status.value = "&#9203; serving ..."
            wl = self.workload()
            self.progress.max, self.progress.value, self.progress.bar_style = len(wl), 0, "info"
            self._pace = Pace()
            with quiet.watch(report=False) as window:
                served = self._serve(self.model, wl, self.slots.value, on_finished=self._finished,
                                     **self.engine_options())
            self.served = served
            self.meters.value = meters_html(served)
            self.fig.replace(gantt_figure(served.results, f"{len(wl)} requests, {self.slots.value} batch slots"))
            for view in (self.meters, self.fig):
                view.remove_class(STALE)
                view.remove_class(BUSY)
            self.progress.bar_style = "success"
        except Exception as err:               # the view must survive anything a setting can cause
            self.progress.bar_style = "danger"
            self.status.value = (f"<span style='color:#b00020'><b>Could not serve this workload:</b> "
                                 f"{html.escape(str(err))}</span> <i>(the results below are from the last good run)</i>")
            return None
        rejected = [r for r in served.results if r.finish_reason == "rejected"]
        note = (f"; {len(rejected)} rejected: {html.escape(rejected[0].error)}" if rejected else "")
        if window.busy:        # a reading taken beside other work: dimmed, with the way to a clean one
            for view in (self.meters, self.fig):
                view.add_class(BUSY)
            note += (f"<br><span style='color:#b00020'>&#9888; {html.escape(window.message)} with "
                     "<b>Run workload</b></span>")
        self.status.value = f"{html.escape(wl.description)}{note}"
        return served


def serving_dashboard(model, **kwargs) -> ServingDashboard:
    """The lesson-09 load dashboard over `model` (n_requests=, seed= set the workload's size and seed)."""
    return ServingDashboard(model, **kwargs)
