"""Disaggregated prefill and decode, simulated: handed-over KV gives the solo tokens, and the clocks keep causality."""
import pytest
import torch

from labutils.decode.loop import generate
from labutils.serving import disagg
from labutils.serving.engine import Engine
from labutils.serving.workload import SLO, make_workload

from test_generate import VOCAB, make_model

MODEL = make_model(2, False, seed=1)


def workload(n=6, rate=200.0, seed=0):
    return make_workload(n, vocab_size=VOCAB, prompt_len=(4, 40), output_len=(2, 20), rate=rate, seed=seed)


def solo(req):
    return generate(MODEL, list(req.prompt_ids), req.max_new_tokens).tokens[0].tolist()


def test_the_decode_worker_continues_from_the_handed_over_cache():
    wl = workload()
    served = disagg.serve_disaggregated(MODEL, wl, prefill_batch=2, decode_batch=4, link_Bps=1e9)
    assert [r.tokens for r in served.results] == [solo(r) for r in wl]
    assert len(served.handoff_s) == sum(r.max_new_tokens > 1 for r in wl)
    assert len(served.busy) == 2 and all(0 < b <= 1 for b in served.busy)
    for r in served.results:                       # the second token comes after the first has crossed the link
        if len(r.timestamps) > 1:
            assert r.timestamps[1] > r.timestamps[0]
        assert r.timestamps[0] > r.arrival_s


def test_a_slow_link_delays_the_second_token_by_its_cost():
    wl = workload(3, rate=None)
    fast = disagg.serve_disaggregated(MODEL, wl, prefill_batch=1, decode_batch=4, link_Bps=1e12)
    slow = disagg.serve_disaggregated(MODEL, wl, prefill_batch=1, decode_batch=4, link_Bps=1e3)
    for r, cost in zip(slow.results, slow.handoff_s):
        assert cost > 0.5 and r.timestamps[1] - r.timestamps[0] >= cost     # bytes / 1 kB/s: seconds
    assert slow.summary.tpot_s.p50 > fast.summary.tpot_s.p50
    assert [r.tokens for r in slow.results] == [r.tokens for r in fast.results]


def test_mixed_machines_give_the_solo_tokens_and_split_the_requests():
    wl = workload()
    one = disagg.serve_mixed(MODEL, wl, 4)
    two = disagg.serve_mixed(MODEL, wl, 4, machines=2, slo=SLO(ttft_s=10.0))
    assert [r.tokens for r in one.results] == [r.tokens for r in two.results] == [solo(r) for r in wl]
    assert two.summary.goodput_req_s > 0 and [r.id for r in two.results] == list(range(len(wl)))
    assert len(two.busy) == 2 and len(one.busy) == 1 and 0 < one.busy[0] <= 1


def test_a_step_clock_moves_only_while_a_step_runs_or_when_told():
    clock = disagg.StepClock()
    assert clock() == 0.0
    clock.wait_until(2.5)
    engine = Engine(MODEL, 1, clock=clock)
    engine.submit([1, 2, 3], 2, arrival_s=2.5)
    clock.step(engine)
    after = clock()
    assert after > 2.5 and clock() == after          # idle: it does not move
    clock.wait_until(1.0)
    assert clock() == after                          # never backwards


def test_handed_over_kv_from_another_model_is_refused():
    engine = Engine(MODEL, 1)
    other = make_model(4, False, seed=0)
    src = Engine(other, 1, export_kv=True)
    src.submit([1, 2, 3, 4], 1)
    (r,) = src.run()
    engine.submit_prefilled([1, 2, 3, 4], r.tokens[0], 0.0, r.kv, 3, arrival_s=0.0, ready_s=0.0)
    with pytest.raises(ValueError, match="another model"):
        engine.run()
    with pytest.raises(ValueError, match="one position per prompt token"):
        Engine(MODEL, 1).submit_prefilled([1, 2], 5, 0.0, r.kv, 3, arrival_s=0.0, ready_s=0.0)
    assert torch.equal(r.kv.keys, r.kv[0]) and r.kv.values.shape == r.kv.keys.shape      # a named pair
    with pytest.raises(ValueError, match="the PromptKV a prefill worker's result carries"):
        Engine(MODEL, 1).submit_prefilled([1, 2, 3, 4], 5, 0.0, tuple(r.kv), 3, arrival_s=0.0, ready_s=0.0)


def test_bad_links_are_refused():
    with pytest.raises(ValueError, match="link_Bps"):
        disagg.serve_disaggregated(MODEL, workload(), prefill_batch=1, decode_batch=1, link_Bps=0)
    with pytest.raises(TypeError, match="clock must be a function"):
        Engine(MODEL, 1, clock=3.0)
