"""Workloads (seeded lengths and Poisson arrivals) and their summary: TTFT, TPOT, ITL, latency, throughput, goodput."""
import math

import numpy as np
import pytest

from labutils.perf import timing
from labutils.serving.workload import SLO, RequestResult, Stats, make_workload, summarize


def test_a_seed_gives_the_same_workload_and_lengths_stay_in_range():
    a = make_workload(50, vocab_size=100, prompt_len=(3, 9), output_len=(2, 5), rate=10.0, seed=4)
    b = make_workload(50, vocab_size=100, prompt_len=(3, 9), output_len=(2, 5), rate=10.0, seed=4)
    c = make_workload(50, vocab_size=100, prompt_len=(3, 9), output_len=(2, 5), rate=10.0, seed=5)
    assert a == b and a != c and len(a) == 50
    assert {len(r.prompt_ids) for r in a} <= set(range(3, 10)) and len({len(r.prompt_ids) for r in a}) > 3
    assert {r.max_new_tokens for r in a} <= {2, 3, 4, 5}
    assert all(0 <= t < 100 for r in a for t in r.prompt_ids)
    assert "50 requests" in a.description and "Poisson arrivals at 10/s" in a.description and "seed 4" in a.description


def test_poisson_arrivals_have_exponential_gaps_at_the_rate():
    wl = make_workload(4000, vocab_size=10, prompt_len=1, output_len=1, rate=20.0, seed=0)
    arrivals = np.array([r.arrival_s for r in wl])
    gaps = np.diff(arrivals)
    assert arrivals[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 20, rel=0.05)     # an exponential's std equals its mean


def test_no_rate_sends_everything_at_once_and_a_system_prompt_is_shared():
    wl = make_workload(5, vocab_size=50, prompt_len=(2, 4), output_len=3, system_prompt_len=20, seed=1)
    assert all(r.arrival_s == 0 for r in wl) and "all at t=0" in wl.description
    heads = {r.prompt_ids[:20] for r in wl}
    assert len(heads) == 1 and all(22 <= len(r.prompt_ids) <= 24 for r in wl)
    assert "20-token system prompt" in wl.description


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(prompt_len=(5, 2)), ValueError, "low end must not exceed"),
    (dict(prompt_len=0), ValueError, r"prompt_len\[0\] must be >= 1"),
    (dict(prompt_len=2.5), TypeError, r"prompt_len\[0\] must be an int"),
    (dict(output_len=(1, 2, 3)), ValueError, "output_len must be a length or a"),
    (dict(output_len=(1, 2 ** 40)), ValueError, r"output_len\[1\] must be <= 1048576"),
    (dict(rate=0), ValueError, "rate must be a number > 0"),
    (dict(rate="fast"), TypeError, "rate must be a number"),
    (dict(eos_id=10), ValueError, "eos_id must be <= 9"),
    (dict(seed=-1), ValueError, "seed must be >= 0"),
])
def test_bad_workload_settings(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        make_workload(3, vocab_size=10, **kwargs)


def test_an_infinite_rate_sends_everything_at_once():
    wl = make_workload(4, vocab_size=10, rate=float("inf"))
    assert all(r.arrival_s == 0 for r in wl) and "all at t=0" in wl.description


def result(i, arrival, stamps, reason="length"):
    return RequestResult(i, arrival, list(range(len(stamps))), stamps, reason)


def test_per_request_metrics_are_timings_definitions_from_arrival():
    r = result(0, 0.5, [1.0, 2.0, 4.0])
    since = [0.5, 1.5, 3.5]
    assert r.ttft_s == timing.ttft_s(since) == 0.5
    assert r.tpot_s == timing.tpot_s(since) == 1.5
    assert r.itl_s == timing.itl_s(since) == [1.0, 2.0]
    assert r.latency_s == 3.5 and r.ok


def test_summary_matches_the_definitions():
    rs = [result(0, 0.0, [0.1, 0.2, 0.3]), result(1, 0.5, [1.0, 1.5]), result(2, 1.0, [1.2]),
          RequestResult(3, 0.2, [], [], "rejected", error="too long")]
    s = summarize(rs, wall_s=2.0)
    done = rs[:3]
    assert (s.n_requests, s.n_completed, s.output_tokens) == (4, 3, 6)
    assert s.output_tok_s == 3.0 and s.request_per_s == 1.5 and s.goodput_req_s == 1.5
    assert s.ttft_s == Stats.of([r.ttft_s for r in done])
    assert s.ttft_s.mean == pytest.approx(np.mean([0.1, 0.5, 0.2]))
    assert s.ttft_s.p99 == pytest.approx(np.percentile([0.1, 0.5, 0.2], 99))
    assert s.tpot_s.mean == pytest.approx(np.mean([0.1, 0.5]))            # a one-token answer has no TPOT
    assert s.itl_s.p50 == pytest.approx(np.median([0.1, 0.1, 0.5]))      # every gap of every request
    assert s.latency_s.mean == pytest.approx(np.mean([0.3, 1.0, 0.2]))
    text = s.table()
    assert "3 of 4 completed" in text and "TTFT" in text and "p99" in text


def test_goodput_counts_requests_meeting_every_slo():
    rs = [result(0, 0.0, [0.1, 0.2, 0.3]), result(1, 0.0, [0.9, 1.0]), result(2, 0.0, [0.1, 1.1])]
    assert summarize(rs, 1.0, slo=SLO(ttft_s=0.5)).goodput_req_s == 2          # request 1 starts too late
    assert summarize(rs, 1.0, slo={"ttft_s": 0.5, "tpot_s": 0.5}).goodput_req_s == 1   # request 2 decodes too slowly
    assert summarize(rs, 2.0, slo=SLO(latency_s=5)).goodput_req_s == 1.5


def test_no_completed_request_gives_nan_stats_not_an_error():
    s = summarize([RequestResult(0, 0.0, [], [], "failed", error="server error")], 1.0)
    assert s.n_completed == 0 and s.output_tok_s == 0 and math.isnan(s.ttft_s.p99)


@pytest.mark.parametrize("wall, exc", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                       ("1s", TypeError)])
def test_bad_wall_time(wall, exc):
    with pytest.raises(exc, match="wall_s must be a"):
        summarize([], wall)


def test_bad_slo():
    with pytest.raises(ValueError, match="unknown SLO field"):
        summarize([], 1.0, slo={"ttft": 1})
    with pytest.raises(ValueError, match=r"SLO.tpot_s must be a finite number > 0"):
        SLO(tpot_s=0)
    with pytest.raises(TypeError, match="slo must be an SLO"):
        summarize([], 1.0, slo=0.5)


def test_an_itl_slo_catches_the_stall_a_tpot_slo_averages_away():
    # 40 gaps of 10 ms and one of 300 ms (a whole prefill among the streams): TPOT 17 ms; the p99 of 41 gaps
    # interpolates between the two largest, 184 ms: the stall still stands out.
    stalled = result(0, 0.0, [0.01 * i for i in range(41)] + [0.7])
    steady = result(1, 0.0, [0.01 * i for i in range(42)])
    assert stalled.itl_p99_s == pytest.approx(np.percentile(stalled.itl_s, 99)) and stalled.itl_p99_s > 0.1
    assert summarize([stalled, steady], 1.0, slo=SLO(tpot_s=0.02)).goodput_req_s == 2      # the mean hides it
    assert summarize([stalled, steady], 1.0, slo=SLO(itl_p99_s=0.05)).goodput_req_s == 1   # the p99 gap does not
    assert math.isnan(result(2, 0.0, [0.1]).itl_p99_s)                   # one token: no gap, nothing to miss
    assert SLO(itl_p99_s=0.05).met_by(result(2, 0.0, [0.1]))
