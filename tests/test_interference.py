"""Lesson 11's measurements: a long prompt among running streams, the budget sweep, the handoff price, their figures."""
import pytest
import torch

from labutils.perf.roofline import kv_cache_bytes
from labutils.serving import Engine, interference
from labutils.figures.serving import budget_figure, itl_figure
from labutils.serving.workload import make_workload

from test_generate import CTX, VOCAB, make_model

MODEL = make_model()
SHAPE = dict(n_streams=3, stream_tokens=12, long_prompt=60, settle_tokens=4)


def test_whole_and_chunked_runs_give_the_streams_the_same_tokens():
    whole = interference.long_prompt_among_streams(MODEL, **SHAPE, chunked_prefill=False)
    chunked = interference.long_prompt_among_streams(MODEL, **SHAPE, max_num_batched_tokens=8)
    assert [r.tokens for r in whole.streams] == [r.tokens for r in chunked.streams]
    assert len(whole.streams) == 3 and whole.long.prompt_len == 60 and len(whole.long.tokens) == 2
    assert chunked.budget == 8 and not whole.chunked_prefill and whole.budget >= CTX
    assert all(r.timestamps[SHAPE["settle_tokens"] - 1] <= whole.arrival_s for r in whole.streams)
    t, gaps = chunked.gaps()
    assert len(t) == len(gaps) == 3 * 11 and t == sorted(t)
    fig = itl_figure({"whole": whole, "chunked": chunked})
    assert [tr.name for tr in fig.data] == ["whole", "whole: the long prompt arrives", "chunked",
                                            "chunked: the long prompt arrives"] and len(fig.data[0].x) == 33
    # Each run's arrival line is labelled and drawn in its run's colour (two unlabelled grey lines were not).
    assert fig.data[1].line.color == fig.data[0].marker.color != fig.data[3].line.color == fig.data[2].marker.color
    assert list(fig.data[1].x) == [whole.arrival_s] * 2 and max(fig.data[1].y) == max(max(fig.data[0].y),
                                                                                       max(fig.data[2].y))


def test_the_sweep_serves_every_budget_and_whole_prompts():
    wl = make_workload(6, vocab_size=VOCAB, prompt_len=(10, 60), output_len=(2, 8), seed=0)
    points = interference.budget_sweep(MODEL, wl, [8, 32], 4, repeats=2)
    assert [(p.chunked_prefill, p.label) for p in points] == [(True, "8"), (True, "32"), (False, "whole")]
    assert points[-1].budget >= CTX                # whole prompts: the budget holds one
    assert all(p.summary.n_completed == 6 for p in points)
    fig = budget_figure(points)
    assert list(fig.data[0].text) == ["8", "32", "whole"]
    # A smaller budget cuts the same prompts into more forwards; each point times its prompt-free forwards.
    assert points[0].forwards > points[1].forwards >= points[2].forwards > 0
    assert all(0 < p.decode_step_s < p.summary.wall_s for p in points)


def test_each_timeline_row_times_its_own_step_not_the_idle_wait_before_it():
    engine = Engine(MODEL, 2)
    engine.submit([1, 2, 3], 3, arrival_s=0.0)
    engine.submit([4, 5], 2, arrival_s=0.2)                 # the engine sleeps about 0.2 s before this one
    engine.run()
    rows = engine.timeline
    assert all(r["step_s"] > 0 for r in rows)
    assert sum(r["step_s"] for r in rows) < rows[-1]["t"] - 0.15              # the 0.2 s wait is in no step


def test_a_handoff_costs_the_prompts_kv_bytes_over_the_link():
    from labutils.model.presets import get_shape
    llama = get_shape("llama-3-8b")
    assert interference.handoff_s(llama, 4096, 50e9) == kv_cache_bytes(llama, 4096, 1, torch.bfloat16) / 50e9
    assert interference.handoff_s(llama, 4096, 50e9) == pytest.approx(0.010737, rel=1e-3)   # 128 KiB/token in bf16
    with pytest.raises(ValueError, match="link_Bps"):
        interference.handoff_s(llama, 10, 0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(settle_tokens=12), "settle_tokens must be <= 11"),
    (dict(long_prompt=CTX), f"long_prompt must be <= {CTX - 2}"),
    (dict(n_streams=0), "n_streams must be >= 1"),
])
def test_bad_shapes_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        interference.long_prompt_among_streams(MODEL, **{**SHAPE, **kwargs})
