"""time_fn and the request metrics TTFT, TPOT and ITL on synthetic timestamps."""
import math

import pytest
from hypothesis import given, strategies as st

from labutils.perf import timing
from labutils.perf.timing import Timing, itl_s, synchronize, time_fn, tpot_s, ttft_s


def test_metrics_on_a_known_request():
    ts = [0.5, 0.6, 0.75, 0.9]
    assert ttft_s(ts) == 0.5
    assert tpot_s(ts) == pytest.approx(0.4 / 3)
    assert itl_s(ts) == pytest.approx([0.1, 0.15, 0.15])


def test_single_token_has_no_tpot():
    assert ttft_s([0.2]) == 0.2
    assert math.isnan(tpot_s([0.2]))
    assert itl_s([0.2]) == []


@pytest.mark.parametrize("fn", [ttft_s, tpot_s, itl_s])
def test_empty_and_decreasing_timestamps_are_errors(fn):
    with pytest.raises(ValueError, match="at least one token"):
        fn([])
    with pytest.raises(ValueError, match="must not decrease"):
        fn([0.1, 0.3, 0.2])


timestamps = st.lists(st.floats(min_value=0.0, max_value=1e4, allow_nan=False), min_size=2, max_size=200).map(sorted)


@given(timestamps)
def test_tpot_and_ttft_rebuild_the_last_timestamp(ts):
    n = len(ts)
    assert tpot_s(ts) * (n - 1) + ttft_s(ts) == pytest.approx(ts[-1], rel=1e-9, abs=1e-9)


@given(timestamps)
def test_itl_sum_and_mean(ts):
    gaps = itl_s(ts)
    assert len(gaps) == len(ts) - 1 and all(g >= 0 for g in gaps)
    assert math.fsum(gaps) == pytest.approx(ts[-1] - ts[0], rel=1e-9, abs=1e-6)
    assert math.fsum(gaps) / len(gaps) == pytest.approx(tpot_s(ts), rel=1e-9, abs=1e-6)


def test_time_fn_warmup_repeats_and_median(monkeypatch):
    # A fake clock: each timed call takes the next duration, so the median is known exactly.
    durations = iter([3.0, 1.0, 7.0, 2.0, 5.0])
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls = []

    def fn():
        calls.append(1)
        if len(calls) > 2:          # the two warm-up calls are not timed
            clock[0] += next(durations)

    t = time_fn(fn, device="cpu", warmup=2, repeats=5)
    assert len(calls) == 7
    assert t.samples_s == (3.0, 1.0, 7.0, 2.0, 5.0)
    assert t.median_s == 3.0 and t.min_s == 1.0


def test_time_fn_real_clock_gives_nonnegative_samples():
    t = time_fn(lambda: sum(range(100)), repeats=3, warmup=0)
    assert isinstance(t, Timing) and len(t.samples_s) == 3 and all(s >= 0 for s in t.samples_s)


@pytest.mark.parametrize("kw, message", [({"repeats": 0}, "repeats must be >= 1"),
                                         ({"warmup": -1}, "warmup must be >= 0")])
def test_time_fn_rejects_bad_counts(kw, message):
    with pytest.raises(ValueError, match=message):
        time_fn(lambda: None, **kw)


def test_synchronize_on_cpu_is_a_no_op():
    synchronize("cpu")
    synchronize(None)
