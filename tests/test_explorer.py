"""The request measurement, its figure data, and the explorer widget driven headlessly (tiny preset)."""
import html
import importlib
import math

import pytest
import torch

from labutils.measure import request as measure
from labutils.figures import request as rf
from labutils.perf.peaks import Peaks
from labutils.widgets import explorer

# The package exports the function `explorer`, which shadows the module of the same name.
explorer_mod = importlib.import_module("labutils.widgets.explorer")

# Far above any machine, so a real tiny-model request never comes out above 100% (which re-measures).
FAKE_PEAKS = Peaks(bandwidth_Bps=10e12, flops=100e12, device_name="test CPU")
TINY = dict(preset="tiny", prompt_len=32, new_tokens=8)


@pytest.fixture(autouse=True)
def fixed_peaks(monkeypatch):
    """Requests are real; the peaks are fixed so the tests do not spend seconds probing the machine."""
    fake = lambda device=None, dtype=None, refresh=False: FAKE_PEAKS    # noqa: E731
    monkeypatch.setattr(measure, "measured_peaks", fake)
    monkeypatch.setattr(explorer_mod, "measured_peaks", fake)


# --- measure_request ------------------------------------------------------------------------------

def test_measure_request_returns_consistent_metrics():
    row = measure.measure_request("tiny", 16, 6, batch=2)
    assert len(row["timestamps"]) == 6
    assert row["ttft_s"] == row["timestamps"][0] > 0
    assert row["tpot_s"] == pytest.approx((row["timestamps"][-1] - row["timestamps"][0]) / 5)
    assert row["decode_pos"] == 16 + 3
    assert row["decode_bytes"] == measure.roofline.decode_bytes(measure.GPTConfig.preset("tiny"), 19, 2, "fp32")
    assert row["mbu"] == pytest.approx(row["decode_bytes"] / row["tpot_s"] / 10e12)
    # MFU uses the same FLOPs as the prefill floor (roofline.prefill_flops, attention included).
    flops = measure.roofline.prefill_flops(measure.GPTConfig.preset("tiny"), 16, 2)
    assert row["prefill_flops"] == flops
    assert row["mfu_prefill"] == pytest.approx(flops / row["ttft_s"] / 100e12)
    assert row["achieved_flops"] == pytest.approx(row["mfu_prefill"] * 100e12)
    assert row["throughput_tok_s"] == pytest.approx(2 * 6 / row["latency_s"])
    assert row["device_name"] == "test CPU"


def test_memory_needed_counts_logits_for_the_last_position_only():
    # 1,000 prompt tokens of gpt2-small: full fp32 logits alone would be 1000 x 50257 x 4 = 201 MB.
    short = measure.memory_needed("gpt2-small", 10, 2, context_length=2048)
    long = measure.memory_needed("gpt2-small", 1000, 2, context_length=2048)
    assert long - short < 1000 * 50257 * 4


def test_models_are_built_once_per_preset_dtype_device():
    assert measure.get_model("tiny", "fp32", "cpu") is measure.get_model("tiny", "fp32", "cpu")
    bf16 = measure.get_model("tiny", "bf16", "cpu")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert len(measure._MODELS) <= measure.MAX_CACHED_MODELS


@pytest.mark.parametrize("settings, message", [
    (dict(prompt_len=250, new_tokens=8), "exceed tiny's context length 256"),
    (dict(prompt_len=0, new_tokens=8), "prompt_len must be"),
    (dict(prompt_len=8, new_tokens=1), "TPOT needs at least two output tokens"),
    (dict(prompt_len=8, new_tokens=4, dtype="fp8"), "dtype 'fp8' is not offered here .a storage format"),
    (dict(prompt_len=8, new_tokens=4, batch=0), "batch must be"),
])
def test_bad_requests_are_refused_before_anything_runs(settings, message):
    with pytest.raises(ValueError, match=message):
        measure.measure_request("tiny", **settings)


def test_a_request_that_does_not_fit_memory_says_how_to_shrink_it(monkeypatch):
    monkeypatch.setattr(measure, "free_bytes", lambda device: 1e6)
    with pytest.raises(ValueError, match="GB is free.*smaller preset"):
        measure.check_preset_request("gpt2-xl", 128, 32, 1, "fp32", "cpu")


def test_out_of_memory_during_a_request_frees_models_and_says_what_to_do(monkeypatch):
    measure.get_model("tiny", "fp32", "cpu")
    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(measure, "generate", oom)
    with pytest.raises(RuntimeError, match="ran out of memory.*cached models were freed.*smaller setting"):
        measure.measure_request("tiny", 16, 4)
    assert not measure._MODELS


def test_other_runtime_errors_are_not_reported_as_out_of_memory(monkeypatch):
    monkeypatch.setattr(measure, "generate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        measure.measure_request("tiny", 16, 4)


def test_preset_choices_leave_out_what_does_not_fit(monkeypatch):
    monkeypatch.setattr(measure, "free_bytes", lambda device: 1e9)      # room for gpt2-small in fp32 only
    offered, notes = measure.preset_choices("cpu")
    assert offered == ["tiny", "gpt2-small"]
    assert any(n.startswith("gpt2-xl: needs about") for n in notes)


# --- figure data ----------------------------------------------------------------------------------

ROW = dict(preset="tiny", dtype="fp32", device="cpu", batch=1, prompt_len=32, new_tokens=4,
           timestamps=[0.010, 0.012, 0.014, 0.016], ttft_s=0.010, tpot_s=0.002, latency_s=0.016,
           achieved_Bps=5e9, peak_bandwidth_Bps=10e9, mbu=0.5, mfu_prefill=0.25, mfu_decode=0.01,
           achieved_flops=25e9, peak_flops=100e9, decode_tok_s=500.0)


def test_timeline_has_one_tick_per_output_token():
    d = rf.timeline_data(ROW)
    assert d["prefill_ms"] == pytest.approx(10.0) and d["decode_ms"] == pytest.approx(6.0)
    fig = rf.timeline_figure(ROW)
    assert len(fig.data[2].x) == 4 and fig.data[1].base[0] == pytest.approx(10.0)


def test_sweep_keeps_only_rows_at_the_same_other_settings():
    rows = [dict(ROW, prompt_len=64, ttft_s=0.02), dict(ROW), dict(ROW, batch=2, prompt_len=128),
            dict(ROW, prompt_len=64, ttft_s=0.03)]          # a re-measurement replaces the older point
    p = rf.sweep_points(rows, ROW)
    assert p["prompt_len"] == [32, 64] and p["ttft_ms"] == pytest.approx([10.0, 30.0])


def test_utilization_is_percent_of_measured_peaks():
    d = rf.utilization_data(ROW)
    assert d["percent"] == pytest.approx([50.0, 25.0, 1.0])
    assert d["text"][0] == "5.0 of 10.0 GB/s"


def test_seed_comparison_puts_the_seed_beside_the_measurement():
    fig = rf.seed_comparison_figure(dict(ROW, prompt_len=1000, new_tokens=200))
    assert list(fig.data[0].y) == [400.0, 6000.0]
    assert list(fig.data[1].y) == pytest.approx([10.0, 6.0])


# --- the widget -----------------------------------------------------------------------------------

class Counting:
    """measure_request, counting the calls, so a test can see the cache at work."""

    def __init__(self):
        self.calls = 0

    def __call__(self, **settings):
        self.calls += 1
        return measure.measure_request(**settings)


def test_a_utilization_above_100_percent_measures_the_peaks_and_the_request_again(monkeypatch):
    refreshed, rows = [], iter([dict(mbu=1.4, mfu_prefill=0.5, mfu_decode=0.1), dict(mbu=0.7, mfu_prefill=0.5,
                                                                                  mfu_decode=0.1)])
    monkeypatch.setattr(explorer_mod, "measured_peaks",
                        lambda device=None, dtype=None, refresh=False: refreshed.append(refresh) or FAKE_PEAKS)
    ex = explorer_mod.Explorer.__new__(explorer_mod.Explorer)       # only _run's logic, no widgets drawn
    ex.progress, ex.status, ex.measurements = type("P", (), {})(), type("S", (), {})(), 0
    ex._measure = lambda **s: dict(next(rows))
    row = ex._run(dict(device="cpu", dtype="fp32", batch=1, **TINY))
    assert row["mbu"] == 0.7 and refreshed == [False, True] and ex.measurements == 1


def test_explorer_measures_redraws_and_reuses_cached_settings():
    counting = Counting()
    ex = explorer_mod.Explorer("cpu", measure_fn=counting, **TINY)
    assert counting.calls == 1
    assert len(ex.fig_timeline.figure.data[2].x) == 8
    ex.new_tokens.value = 12
    assert counting.calls == 2 and len(ex.fig_timeline.figure.data[2].x) == 12
    assert list(ex.fig_sweep.figure.data[0].x) == [32]          # the new_tokens=12 curve has one point so far
    ex.prompt_len.value = 64
    assert counting.calls == 3 and list(ex.fig_sweep.figure.data[0].x) == [32, 64]
    ex.new_tokens.value = 8
    assert counting.calls == 4 and list(ex.fig_sweep.figure.data[0].x) == [32, 64]
    ex.prompt_len.value = 32                             # measured before: redrawn from the cache
    assert counting.calls == 4 and len(ex.fig_timeline.figure.data[2].x) == 8
    assert "TTFT" in ex.status.value and ex.progress.bar_style == "success"
    assert "GB free on cpu" in ex.notes.value and "7B+ shapes: GPU only" in ex.notes.value
    ex.again.click()                                     # "measure again": a fresh row replaces the cached one
    assert counting.calls == 5 and list(ex.fig_sweep.figure.data[0].x) == [32, 64]
    assert ex.fig_util.figure.data[0].y[0] > 0


def test_impossible_setting_shows_a_message_and_keeps_the_last_plot(monkeypatch):
    ex = explorer(device="cpu", **TINY)
    before = list(ex.fig_timeline.figure.data[2].x)
    kept = ex.prompt_len.value
    with pytest.raises(ValueError, match=r"prompt_len=256 is outside the slider's range 8 to \d+"):
        ex.prompt_len.value = 256                        # 256 + new tokens > tiny's context: refused, by name
    assert ex.prompt_len.value == kept and ex.prompt_len.value + ex.new_tokens.value <= 256
    assert "TTFT" in ex.status.value
    real = measure.check_preset_request

    def too_big(**s):
        raise ValueError("tiny in fp32 needs about 99.0 GB, but only 1.0 GB is free on cpu; choose a smaller preset")
    monkeypatch.setattr(measure, "check_preset_request", too_big)
    before = list(ex.fig_timeline.figure.data[2].x)
    ex.batch.value = 32
    assert "needs about 99.0 GB" in ex.status.value and list(ex.fig_timeline.figure.data[2].x) == before
    monkeypatch.setattr(measure, "check_preset_request", real)
    ex.batch.value = 2                                   # a good setting works again
    assert "TTFT" in ex.status.value


def test_a_failing_measurement_does_not_take_the_widget_down():
    def out_of_memory(**settings):
        if settings["batch"] > 1:
            raise RuntimeError("CUDA ran out of memory for tiny; choose a smaller setting")
        return measure.measure_request(**settings)

    ex = explorer_mod.Explorer("cpu", measure_fn=out_of_memory, **TINY)
    before = list(ex.fig_timeline.figure.data[2].x)
    ex.batch.value = 4
    assert "ran out of memory" in ex.status.value and ex.progress.bar_style == "danger"
    assert list(ex.fig_timeline.figure.data[2].x) == before


def test_changing_preset_adapts_the_prompt_slider(monkeypatch):
    ex = explorer(device="cpu", **TINY)
    assert ex.prompt_len.max == 256 - ex.new_tokens.min      # room for the fewest output tokens
    monkeypatch.setattr(ex, "_measure", lambda **s: pytest.fail("must not measure gpt2-small here"))
    monkeypatch.setattr(measure, "check_preset_request", lambda **s: (_ for _ in ()).throw(ValueError("too big")))
    ex.preset.value = "gpt2-small"
    assert ex.prompt_len.max == 1024 - ex.new_tokens.min and "too big" in ex.status.value


def test_explorer_refuses_a_preset_not_offered():
    with pytest.raises(ValueError, match="not offered"):
        explorer(device="cpu", preset="llama-2-70b")
    assert math.isfinite(measure.free_bytes("cpu"))


def test_a_measurement_on_a_busy_machine_says_so_in_the_status(monkeypatch):
    from test_quiet import fake_counters
    fake_counters(monkeypatch, others_per_reading=0)            # a quiet machine first, whatever runs beside us
    ex = explorer_mod.Explorer("cpu", measure_fn=Counting(), **TINY)
    assert "busy machine" not in ex.status.value
    fake_counters(monkeypatch, others_per_reading=150)          # others hold 1.5 of 2 cores from now on
    ex.new_tokens.value = 12
    assert "busy machine" in ex.status.value and "close other notebooks" in ex.status.value
    # The busy reading is dimmed and offers the way to a clean one; measuring again on a quiet machine clears both.
    assert "opacity:0.5" in ex.status.value and "with the 'measure again' button" in html.unescape(ex.status.value)
    fake_counters(monkeypatch, others_per_reading=0)
    ex.again.click()
    assert "opacity" not in ex.status.value and "busy machine" not in ex.status.value


def test_a_share_above_the_peak_is_never_drawn_above_100_percent(monkeypatch):
    """The bf16-on-CPU case: 501% of a wrong peak. The peaks are measured once more, then the bar stops at 100%."""
    refreshed = []
    monkeypatch.setattr(explorer_mod, "measured_peaks",
                        lambda device=None, dtype=None, refresh=False: refreshed.append(refresh) or FAKE_PEAKS)
    wrong = lambda **s: dict(measure.measure_request(**s), mfu_prefill=5.016, mfu_decode=0.1)   # noqa: E731
    ex = explorer_mod.Explorer("cpu", measure_fn=wrong, dtype="bf16", **TINY)
    assert refreshed.count(True) == 1, "a share above 100% re-probes the peaks once"
    bars = list(ex.fig_util.figure.data[0].y)
    assert max(bars) <= 100 and bars[1] == 100
    assert "(502%: the peak looks wrong)" in ex.fig_util.figure.data[0].text[1]
    assert "peak looks wrong" in ex.status.value and "prefill matmul peak" in ex.status.value


def test_the_real_bf16_explorer_on_cpu_never_shows_a_bar_above_100_percent(monkeypatch):
    monkeypatch.undo()                            # real peaks for bf16 on this CPU, measured and shared
    ex = explorer_mod.Explorer("cpu", dtype="bf16", **TINY)
    assert "TTFT" in ex.status.value
    assert max(ex.fig_util.figure.data[0].y) <= 100


def test_switching_to_a_shorter_shape_clamps_prompt_and_output_together(monkeypatch):
    ex = explorer_mod.Explorer("cpu", preset="gpt2-small", prompt_len=392, new_tokens=64,
                               measure_fn=lambda **s: Counting()(**dict(s, preset="tiny", prompt_len=32,
                                                                         new_tokens=8)))
    ex.preset.value = "tiny"                      # context 256
    assert ex.prompt_len.value + ex.new_tokens.value <= 256 and ex.prompt_len.max <= 254
    assert "Could not" not in ex.status.value, ex.status.value
    assert ex.new_tokens.max == 256 - ex.prompt_len.value or ex.new_tokens.max == 256


def test_a_burst_of_changes_is_measured_once_with_the_last_settings():
    import asyncio
    from labutils.widgets.debounce import Latest
    seen = []
    calls = {"n": 0}

    async def learner_presses_three_times():
        latest = Latest(lambda: seen.append(calls["n"]), delay_s=0.05)
        for n in (2, 4, 8):
            calls["n"] = n
            latest()
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        return latest.runs

    assert asyncio.run(learner_presses_three_times()) == 1 and seen == [8]
    runs = []
    Latest(lambda: runs.append(1))()              # no event loop: runs at once
    assert runs == [1]


def test_several_settings_are_measured_in_turn_and_give_measure_requests_rows(monkeypatch):
    """measure_requests interleaves its settings round by round (A B A B), so drifting load hits both alike."""
    import labutils.measure.request as m
    calls = []
    real = m.generate
    monkeypatch.setattr(m, "generate", lambda model, ids, n, **kw: calls.append((ids.shape[1], n)) or real(model, ids, n, **kw))
    rows = measure.measure_requests("tiny", [(16, 4), (8, 3)], rounds=3)
    assert calls[1:] == [(16, 4), (8, 3)] * 3                       # after one warm-up: in turn, three rounds
    assert [(r["prompt_len"], r["new_tokens"]) for r in rows] == [(16, 4), (8, 3)]
    one = measure.measure_request("tiny", 8, 3)
    assert set(one) == set(rows[1]) and len(rows[1]["timestamps"]) == 3
    with pytest.raises(ValueError, match=r"\(prompt_len, new_tokens\) pairs"):
        measure.measure_requests("tiny", [(16,)])


def test_the_progress_bar_fills_while_the_request_decodes():
    # A 15 s request once left the bar at stage 2 of 4 until it ended: its tokens now fill stage 2.
    seen = []

    def measuring(on_token, **s):
        bar = on_token.__self__.progress                  # the explorer's own bar, as each token arrives
        return measure.measure_request(**s, on_token=lambda done, total: (on_token(done, total),
                                                                          seen.append(bar.value)))

    ex = explorer_mod.Explorer("cpu", measure_fn=measuring, **TINY)
    stage = explorer_mod.STAGE
    assert seen == sorted(seen) and 2 * stage < seen[len(seen) // 2] < 3 * stage and seen[-1] == 3 * stage
    assert ex.progress.value == ex.progress.max == 4 * stage
