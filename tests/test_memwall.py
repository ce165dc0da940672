"""Lesson 07's measurements and figures: one pass on the roofline, the batch knee, the batch slider (headless)."""
import math

import pytest

from labutils.measure import request as measure
from labutils.perf import roofline
from labutils.figures import roofline as figs
from labutils.perf.peaks import Peaks
from labutils.model.gpt import GPTConfig
from labutils.widgets import BatchRoofline

PEAKS = Peaks(bandwidth_Bps=20e9, flops=200e9, device_name="test CPU")     # ridge 10 FLOP/byte
TINY = GPTConfig.preset("tiny")


@pytest.mark.parametrize("phase, n", [("prefill", 32), ("decode", 1), ("decode", 4)])
def test_roofline_point_counts_the_pass_it_timed(phase, n):
    row = measure.roofline_point("tiny", phase, n, pos=16, repeats=2)
    assert row["seconds"] > 0 and row["phase"] == phase and row["n"] == n
    if phase == "prefill":
        assert row["flops"] == roofline.prefill_flops(TINY, n)
        assert row["bytes"] == roofline.prefill_bytes(TINY, n, 1, "fp32")
    else:
        assert row["flops"] == roofline.decode_flops(TINY, 16, n)
        assert row["bytes"] == roofline.decode_bytes(TINY, 16, n, "fp32")
    assert row["intensity"] == pytest.approx(row["flops"] / row["bytes"])
    assert row["achieved_flops"] == pytest.approx(row["flops"] / row["seconds"])
    assert row["tokens_per_s"] == pytest.approx(n / row["seconds"])


def test_time_pass_refuses_what_it_cannot_time():
    model = measure.get_model("tiny", "fp32", "cpu")
    with pytest.raises(ValueError, match=r"unknown phase 'train'; choose one of \['prefill', 'decode', 'verify'\]"):
        measure.time_pass(model, "train", 4)
    with pytest.raises(ValueError, match="context length 256"):
        measure.time_pass(model, "decode", 2, pos=256)


@pytest.mark.parametrize("phase,n,want", [("prefill", 5, ((1, 5), 0, True)), ("decode", 3, ((3, 1), 16, True)),
                                          ("verify", 5, ((1, 5), 16, False))])
def test_time_pass_times_the_pass_its_phase_names(phase, n, want, monkeypatch):
    """A verify pass (lesson 10) is one sequence of n tokens after pos cached ones, with logits at every token."""
    model, seen = measure.get_model("tiny", "fp32", "cpu"), []
    forward = type(model).forward

    def spy(self, ids, cache=None, **kw):
        seen.append((tuple(ids.shape), cache.pos, kw["last_only"]))
        return forward(self, ids, cache, **kw)

    monkeypatch.setattr(type(model), "forward", spy)
    assert measure.time_pass(model, phase, n, pos=16, repeats=2) > 0
    assert seen == [want] * 3                                     # one warm-up and two timed passes


def test_predicted_decode_grows_with_batch_then_flattens_past_the_knee():
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    tps = figs.predicted_decode(TINY, batches, 64, "fp32", PEAKS)
    assert all(b >= a for a, b in zip(tps, tps[1:]))
    assert tps[1] / tps[0] == pytest.approx(2, rel=0.05)          # memory-bound: a second sequence is free
    assert tps[-1] / tps[-2] < 1.2                                # compute-bound: no more to gain
    knee = roofline.knee_batch(TINY, 64, "fp32", bandwidth_Bps=PEAKS.bandwidth_Bps, peak_flops=PEAKS.flops)
    # Here the ridge is reached first (compute-bound): at the knee the step's intensity is about the ridge point.
    ai = roofline.arithmetic_intensity(roofline.decode_flops(TINY, 64, round(knee)),
                                       roofline.decode_bytes(TINY, 64, round(knee), "fp32"))
    assert 0.5 * PEAKS.ridge < ai < 2 * PEAKS.ridge
    # The knee is where the asymptotes meet: batch / t(1) on the left, the flat rate on the right.
    flat = 1 / (roofline.decode_flops(TINY, 64, 1) / PEAKS.flops)
    assert knee == pytest.approx(flat * roofline.decode_step_s(TINY, 64, 1, "fp32", bandwidth_Bps=PEAKS.bandwidth_Bps,
                                                               peak_flops=PEAKS.flops))


def test_a_long_cache_pulls_the_knee_in_and_keeps_decode_memory_bound():
    # An A100 in fp16 with gpt2-small: each sequence's cache of 4,096 positions takes longer to read than its
    # FLOPs take to compute, so throughput flattens at bandwidth / cache bytes long before the ridge.
    from labutils.perf.datasheets import SPECS
    a100 = SPECS["A100 80GB SXM"]
    cfg = GPTConfig.preset("gpt2-small", context_length=8192)
    knees = [roofline.knee_batch(cfg, pos, "fp16", bandwidth_Bps=a100.bandwidth_Bps, peak_flops=a100.flops_16)
             for pos in (128, 4096)]
    assert knees[1] < knees[0] / 10
    per_seq_kv_s = roofline.kv_cache_bytes(cfg, 4096, 1, "fp16") / a100.bandwidth_Bps
    assert per_seq_kv_s > roofline.decode_flops(cfg, 4096, 1) / a100.flops_16


def test_measured_knee_is_where_the_flat_time_meets_the_compute_line():
    rows = [dict(phase="decode", n=b, seconds=max(1.0, b / 8)) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert figs.measured_knee(rows) == pytest.approx(8.0)
    assert figs.measured_knee(rows[:1]) is None


def test_measured_knee_places_a_knee_past_the_largest_batch():
    """Before the knee each extra sequence costs its cache reads: a GPU's 7B shape at batch 64, whose knee is past 180.
    The step's growth per sequence over batches 16 to 64 places it where knee_batch's construction does."""
    rows = [dict(phase="decode", n=b, seconds=1.0 + 0.01 * (b - 1)) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert figs.measured_knee(rows) == pytest.approx(100.0)
    flat = [dict(phase="decode", n=b, seconds=1.0) for b in (1, 32, 64)]
    assert figs.measured_knee(flat) == float("inf")            # no growth: no knee this sweep can place


def test_one_stalled_step_does_not_take_the_measured_knee_away():
    """A CI run stalled lesson 07's batch-32 step past batch 64's: a difference of the two largest gave no slope (inf).
    The line through batches 16-64 still places the knee, within lesson 07's factor of four of the true one."""
    rows = [dict(phase="decode", n=b, seconds=max(1.0, b / 8)) for b in (1, 2, 4, 8, 16, 32, 64)]
    rows[5]["seconds"] = rows[6]["seconds"] * 1.05                                  # batch 32 ran slower than 64
    assert 8.0 / 4 < figs.measured_knee(rows) < 8.0 * 4
    two = [dict(phase="decode", n=b, seconds=1.0 + 0.01 * (b - 1)) for b in (1, 2)]
    assert figs.measured_knee(two) == pytest.approx(100.0)                         # two batches: their difference


def test_roofline_figure_traces_and_points():
    rows = [dict(phase="prefill", n=64, intensity=30.0, achieved_flops=1e11),
            dict(phase="decode", n=2, intensity=1.0, achieved_flops=1e10),
            dict(phase="decode", n=1, intensity=0.5, achieved_flops=5e9)]
    fig = figs.roofline_figure(PEAKS, rows)
    prefill, decode, selected = fig.data[-3:]
    assert list(decode.x) == [0.5, 1.0] and list(decode.text) == ["b=1", "b=2"]  # sorted by batch, named as one
    assert list(prefill.text) == ["T=64"] and prefill.textposition != decode.textposition   # never on top
    assert list(prefill.y) == [1e11] and len(selected.x) == 0
    ticks = fig.layout.yaxis.tickvals                 # major ticks only, 1-2-5 per decade, covering the points
    assert ticks and min(ticks) <= 5e9 and max(ticks) >= 1e11
    assert all(str(v)[0] in "125" for v in ticks)
    roof = fig.data[0]
    assert max(roof.y) == PEAKS.flops and roof.y[0] == pytest.approx(roof.x[0] * PEAKS.bandwidth_Bps)
    # On a log axis plotly places an annotation at log10 units: the ridge label must sit at log10(ridge).
    (label,) = [a for a in fig.layout.annotations if a.text.startswith("ridge")]
    assert label.x == pytest.approx(math.log10(PEAKS.ridge))
    assert label.text == f"ridge {PEAKS.ridge:.1f} FLOP/byte"         # as lesson 07 prints it, not rounded to 13


def test_batch_figure_knee_label_sits_at_the_knee_on_the_log_axis():
    cfg = GPTConfig.preset("tiny")
    fig = figs.batch_figure(cfg, [1, 2, 4, 8], 128, "fp32", PEAKS)
    knee = roofline.knee_batch(cfg, 128, "fp32", bandwidth_Bps=PEAKS.bandwidth_Bps, peak_flops=PEAKS.flops)
    (label,) = [a for a in fig.layout.annotations if a.text.startswith("predicted knee")]
    assert label.x == pytest.approx(math.log10(knee))
    assert list(fig.layout.xaxis.tickvals) == [1, 2, 4, 8]                     # powers of two for a batch
    # Steps of 10 ms at batch 1 and 2, 20 ms at batch 4: the knee, batch-1 time x batch 4's rate, sits at 2.
    steps = {1: 0.01, 2: 0.01, 4: 0.02}
    figs.update_batch(fig, [dict(phase="decode", n=b, tokens_per_s=b / s, seconds=s) for b, s in steps.items()],
                      selected=dict(n=2, tokens_per_s=200.0))
    assert list(fig.data[2].x) == [2] and fig.data[2].marker.symbol == "star"   # the selected batch is marked
    assert fig.data[3].name == "measured knee" and list(fig.data[3].x) == [2.0, 2.0]
    # A sweep that stops before throughput flattens (every step as fast as batch 1's) has no knee to show.
    figs.update_batch(fig, [dict(phase="decode", n=b, tokens_per_s=b / 0.01, seconds=0.01) for b in (1, 2, 4)])
    assert list(fig.data[3].x) == []
    # Hover text names both axes with their units, not plotly's bare "(2, 200)".
    assert "batch (sequences decoded together): %{x" in fig.data[1].hovertemplate
    assert "output tokens/s: %{y" in fig.data[1].hovertemplate


def fake_point(preset, phase, n, dtype, device, pos=128):
    if n == 16:
        raise RuntimeError("cpu ran out of memory (pretend)")
    seconds = max(0.01, 0.01 * n / 8)
    return dict(phase=phase, n=n, seconds=seconds, intensity=0.5 * n, achieved_flops=n * 1e9 / seconds,
                achieved_Bps=5e8 / seconds, tokens_per_s=n / seconds)


def test_batch_slider_measures_each_batch_once_and_survives_errors():
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[2])
        return fake_point(*args, **kwargs)

    view = BatchRoofline("cpu", preset="tiny", dtype="fp32", peaks=PEAKS, measure_fn=counting)
    view.slider.value = 8
    view.slider.value = 1
    assert calls == [1, 8] and "tokens/s" in view.status.value
    assert list(view.fig_batch.figure.data[1].x) == [1, 8]
    view.slider.value = 16                                         # the measurement fails
    assert "Could not measure batch 16" in view.status.value and "ran out of memory" in view.status.value
    assert list(view.fig_batch.figure.data[1].x) == [1, 8]                # the last good points stay
    view.slider.value = 32                                         # and the next good value recovers
    assert list(view.fig_batch.figure.data[1].x) == [1, 8, 32] and "batch <b>32</b>" in view.status.value
