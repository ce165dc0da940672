"""The serving engine: batched greedy tokens equal solo generate(), the prefix cache is really used, scheduling, bad input."""
import dataclasses
import math
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labutils.decode.loop import generate
from labutils.serving import blocks as blocks_mod
from labutils.serving import engine as engine_mod
from labutils.serving.engine import Engine, run_workload, serve
from labutils.serving.workload import Request, SamplingParams, Workload, make_workload

from test_generate import CTX, VOCAB, count_forwards, make_model

MODELS = {}


def model(n_kv_head=4, gated=False, seed=0):
    key = (n_kv_head, gated, seed)
    if key not in MODELS:
        MODELS[key] = make_model(n_kv_head, gated, seed=seed)
    return MODELS[key]


def solo(m, prompt, n, eos_id=None):
    """The request run alone through generate(), cut at the first EOS as the engine stops there."""
    tokens = generate(m, prompt, n).tokens[0].tolist()
    if eos_id is not None and eos_id in tokens:
        tokens = tokens[:tokens.index(eos_id) + 1]
    return tokens


def max_batch_seen(engine):
    return max(row["running"] for row in engine.timeline)


# --- batched == solo ---------------------------------------------------------------------------------

@settings(max_examples=16)
@given(data=st.data(), max_batch=st.integers(1, 5), block_size=st.sampled_from([1, 4, 16]),
       batching=st.sampled_from(["continuous", "static"]), caching=st.booleans(), kind=st.sampled_from([0, 1, 2]),
       budget=st.sampled_from([None, 5, 7, 64]), chunked=st.booleans())
def test_every_request_gets_its_solo_greedy_tokens(data, max_batch, block_size, batching, caching, kind, budget, chunked):
    """Random prompt lengths (some sharing a prefix), output lengths, arrival times, batch limits and token budgets."""
    m = model(*[(4, False, 0), (2, False, 1), (1, True, 2)][kind])
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    shared = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
    budget = budget if chunked else None          # without chunking the budget must hold a whole context
    engine = Engine(m, max_batch, block_size=block_size, prefix_caching=caching, batching=batching,
                    max_num_batched_tokens=budget, chunked_prefill=chunked)
    requests = []
    for _ in range(rng.randint(2, 7)):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        n = rng.randint(1, min(30, CTX - len(prompt)))
        requests.append((prompt, n))
        engine.submit(prompt, n, arrival_s=rng.choice([0.0, 0.0, rng.uniform(0, 0.02)]))
    results = engine.run()
    assert [r.id for r in results] == list(range(len(requests)))
    for r, (prompt, n) in zip(results, requests):
        assert r.finish_reason == "length" and r.tokens == solo(m, prompt, n), r.id
        assert len(r.timestamps) == n and r.prompt_len == len(prompt)
    assert max_batch_seen(engine) <= max_batch
    assert engine.blocks.used == 0                        # every block came back


def test_requests_really_decode_side_by_side_at_their_own_positions():
    """Equality above means little if every batch held one request: check that rows at different
    positions shared one forward, and that the model wandered (varied tokens)."""
    m = model()
    with count_forwards(m) as shapes:
        engine = Engine(m, 4)
        prompts = [list(range(5)), list(range(10, 30)), list(range(40, 43)), list(range(50, 61))]
        for p in prompts:
            engine.submit(p, 40)
        results = engine.run()
    assert shapes[0] == (1, sum(map(len, prompts)))       # one prefill for all four, packed end to end ...
    assert set(shapes[1:]) == {(1, 4)}                    # ... then decode steps of 4 tokens, one per request
    for r, p in zip(results, prompts):
        assert r.tokens == solo(m, p, 40)
        assert len(set(r.tokens)) >= 8, f"random model degenerated to {r.tokens}"


def test_a_packed_prefill_leaves_a_cached_prefix_alone():
    """Rows whose prefix is cached, prefilled beside a long one in one packed forward: each writes its own
    slots only, never the shared prefix, and no token is padding."""
    m = model()
    system = [(5 * i) % VOCAB for i in range(40)]
    engine = Engine(m, 4)
    engine.submit(system + [1], 3)
    engine.run()
    with count_forwards(m) as shapes:
        for p in (system + [2], list(range(50, 80)), system + [3]):
            engine.submit(p, 12)
        results = engine.run()
    assert shapes[0] == (1, 9 + 30 + 9) and [r.cached_tokens for r in results] == [32, 0, 32]
    assert [r.tokens for r in results] == [solo(m, p, 12) for p in (system + [2], list(range(50, 80)), system + [3])]
    assert engine.runner.cache.blocks_allocated >= engine.blocks.high_water


def test_a_prompt_longer_than_the_budget_is_chunked_never_refused():
    m = model()
    with count_forwards(m) as shapes:
        engine = Engine(m, 1, max_num_batched_tokens=7)
        engine.submit(list(range(20)), 3)
        (r,) = engine.run()
    assert shapes == [(1, 7), (1, 7), (1, 6), (1, 1), (1, 1)]     # 20 prompt tokens in chunks of 7, then decodes
    assert r.tokens == solo(m, list(range(20)), 3) and len(r.timestamps) == 3


def test_decodes_go_first_and_prefill_chunks_fill_the_rest_of_the_budget():
    """Two streams decoding when a long prompt arrives: each step feeds both decode tokens, and the prompt
    only what is left of the budget; without chunking the prompt runs whole in one step beside them."""
    m = model()
    long = [(5 * j) % VOCAB for j in range(60)]
    for chunked, expect in ((True, [2 + 8] * 7 + [2 + 4]), (False, [2 + 60])):
        engine = Engine(m, 3, max_num_batched_tokens=10 if chunked else CTX, chunked_prefill=chunked)
        engine.submit([1, 2, 3], 30)
        engine.submit([4, 5], 30)
        for _ in range(3):
            engine.step()
        engine.submit(long, 5)
        steps = []
        while engine.next_arrival_s is not None or engine.scheduler.waiting or any(
                s.remaining > 1 for s in engine.scheduler.running):
            engine.step()
            row = engine.timeline[-1]
            steps.append(row["decode_tokens"] + row["prefill_tokens"])
        assert steps == expect, chunked
        results = engine.run()
        assert [r.tokens for r in results] == [solo(m, p, n) for p, n in
                                               (([1, 2, 3], 30), ([4, 5], 30), (long, 5))]


@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_keeps_the_solo_tokens_with_preemption_and_prefix_hits(budget):
    m = model(2, False, 1)
    block_bytes = Engine(m, 1, block_size=4).runner.cache.block_bytes
    max_batch = min(budget, 4)
    engine = Engine(m, max_batch, block_size=4, kv_limit_bytes=30 * block_bytes, max_num_batched_tokens=budget)
    system = [(11 * j) % VOCAB for j in range(13)]
    prompts = [system + [(7 * i + j) % VOCAB for j in range(6 + i)] for i in range(5)]
    for p in prompts:
        engine.submit(p, 30)
    results = engine.run()
    assert [r.tokens for r in results] == [solo(m, p, 30) for p in prompts]
    assert engine.counts.cached_tokens > 0
    assert budget == 1 or engine.counts.preemptions > 0      # one request at a time never runs out of blocks
    assert max(row["decode_tokens"] + row["prefill_tokens"] for row in engine.timeline) <= budget
    assert engine.blocks.used == 0


def test_packed_forwards_compute_no_padding():
    """Token rows the model computed == tokens that needed computing: uncached prompt tokens, and every
    generated token but the last (no preemption here)."""
    m = model()
    engine = Engine(m, 4, max_num_batched_tokens=24)
    prompts = [list(range(i, i + 5 + 9 * i)) for i in range(5)]
    for p in prompts:
        engine.submit(p, 12)
    with count_forwards(m) as shapes:
        results = engine.run()
    real = sum(r.prompt_len - r.cached_tokens + len(r.tokens) - 1 for r in results)
    assert sum(w for _, w in shapes) == engine.counts.token_rows == real
    assert all(b == 1 for b, _ in shapes)


def test_sampled_requests_follow_their_seeds_beside_anything():
    """A sampled request draws from its own generator through generate()'s sampler: its tokens are those of
    generate() with the same seed, whatever runs beside it and however its prompt is chunked."""
    m = model()
    opts = [dict(temperature=0.9, top_k=20, seed=3), dict(temperature=1.2, top_p=0.9, seed=4), {}]
    prompts = [list(range(1, 18)), list(range(30, 39)), list(range(60, 90))]
    expect = [generate(m, p, 16, **o).tokens[0].tolist() for p, o in zip(prompts, opts)]
    for max_batch, budget in ((3, None), (3, 5), (1, 1)):
        engine = Engine(m, max_batch, max_num_batched_tokens=budget)
        for p, o in zip(prompts, opts):
            engine.submit(p, 16, **o)
        assert [r.tokens for r in engine.run()] == expect, (max_batch, budget)
    assert expect[0] != generate(m, prompts[0], 16, temperature=0.9, top_k=20, seed=5).tokens[0].tolist()
    # The same requests as a workload: each Request carries its SamplingParams to the engine.
    wl = Workload(tuple(Request(tuple(p), 16, sampling=SamplingParams(**o)) for p, o in zip(prompts, opts)))
    assert [r.tokens for r in serve(m, wl, 3).results] == expect


@pytest.mark.parametrize("sampling, exc, match", [
    (dict(temperature=0.9), TypeError, "Request.sampling must be a SamplingParams, got dict"),
    (SamplingParams(temperature=1.0, seed=2), None, None),
])
def test_a_request_carries_its_sampling_params_or_is_refused(sampling, exc, match):
    if exc is None:
        assert Request((1, 2), 4, sampling=sampling).sampling.seed == 2
    else:
        with pytest.raises(exc, match=match):
            Request((1, 2), 4, sampling=sampling)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1.0, seed=-1)


def test_preemption_by_recompute_keeps_the_tokens():
    m = model(2, False, 1)
    block_bytes = Engine(m, 1, block_size=4).runner.cache.block_bytes
    engine = Engine(m, 4, block_size=4, kv_limit_bytes=30 * block_bytes)   # 30 blocks: 4 x 46 positions need 48
    prompts = [[(7 * i + j) % VOCAB for j in range(6 + i)] for i in range(4)]
    for p in prompts:
        engine.submit(p, 40)
    results = engine.run()
    assert engine.counts.preemptions > 0
    for r, p in zip(results, prompts):
        assert r.tokens == solo(m, p, 40)
    preempted = [r for r in results if len(r.spans) > 1]
    assert preempted and all(a[1] <= b[0] for r in preempted for a, b in zip(r.spans, r.spans[1:]))


def test_eos_ends_a_request_early_with_finish_reason_stop():
    m = model()
    prompt = list(range(8))
    full = solo(m, prompt, 30)
    eos = full[10]
    engine = Engine(m, 2)
    engine.submit(prompt, 30, eos_id=eos)
    engine.submit(list(range(20, 30)), 5)
    stopped, other = engine.run()
    assert stopped.finish_reason == "stop" and stopped.tokens == full[:full.index(eos) + 1]
    assert other.finish_reason == "length" and len(other.tokens) == 5


# --- the prefix cache is used, and never covers a whole prompt ---------------------------------------

def test_a_shared_prefix_is_served_from_the_cache():
    m = model()
    system = [(3 * i) % VOCAB for i in range(40)]          # 2 full blocks of 16, and 8 more tokens
    engine = Engine(m, 2)
    engine.submit(system + [1, 2, 3], 10)
    first, = engine.run()
    with count_forwards(m) as shapes:
        engine.submit(system + [4, 5], 10)
        second, = engine.run()
    assert first.cached_tokens == 0 and second.cached_tokens == 32
    assert shapes[0] == (1, len(system) + 2 - 32)           # the prefill fed only the uncached tokens
    assert second.tokens == solo(m, system + [4, 5], 10)
    assert engine.counts.cached_tokens == 32 and engine.counts.hit_rate == 32 / (43 + 42)


def test_requests_arriving_together_reuse_the_prefix_the_first_one_writes():
    m = model()
    system = list(range(40))
    engine = Engine(m, 4)
    for tail in range(4):
        engine.submit(system + [50 + tail], 4)
    results = engine.run()
    assert [r.cached_tokens for r in results] == [0, 32, 32, 32]
    assert engine.peak_blocks == 3 + 3 * 1      # the first request's 3 blocks, then 1 own block each
    assert all(r.tokens == solo(m, system + [50 + i], 4) for i, r in enumerate(results))


def test_the_cached_blocks_are_really_read():
    """Corrupt the cached prefix: the next request that reuses it must change (the cache is not decoration)."""
    m = model()
    system = list(range(32))
    engine = Engine(m, 1)
    engine.submit(system + [50], 12)
    engine.run()
    with torch.inference_mode():                           # the engine made its storage in inference mode
        for pool in engine.runner.cache.k:
            pool.mul_(-1.0)
    engine.submit(system + [60], 12)
    corrupted, = engine.run()
    assert corrupted.cached_tokens == 32 and corrupted.tokens != solo(m, system + [60], 12)


def test_an_identical_prompt_of_whole_blocks_still_prefills_its_last_block():
    """nano-vllm issue 144: a fully cached prompt would leave nothing to prefill."""
    m = model()
    prompt = list(range(32))                               # exactly two blocks
    engine = Engine(m, 2)
    engine.submit(prompt, 8)
    engine.run()
    with count_forwards(m) as shapes:
        engine.submit(prompt, 8)
        again, = engine.run()
    assert again.cached_tokens == 16 and shapes[0] == (1, 16)
    assert again.tokens == solo(m, prompt, 8)


def test_prefix_caching_off_and_budget_zero_cache_nothing():
    m = model()
    system = list(range(40))
    for kwargs in (dict(prefix_caching=False), dict(kv_limit_bytes=0)):
        engine = Engine(m, 2, **kwargs)
        for tail in ([1], [2], [3]):
            engine.submit(system + tail, 6)
        results = engine.run()
        assert engine.counts.cached_tokens == 0 and engine.blocks.cached == 0, kwargs
        assert all(r.tokens == solo(m, system + t, 6) for r, t in zip(results, ([1], [2], [3])))


def test_hash_collisions_never_reuse_the_wrong_blocks(monkeypatch):
    monkeypatch.setattr(blocks_mod, "block_hash", lambda parent, tokens: 7)
    m = model()
    engine = Engine(m, 2)
    a, b = list(range(40)), list(range(40, 80))
    for p in (a, b, a):
        engine.submit(p, 6)
    results = engine.run()
    assert [r.tokens for r in results] == [solo(m, p, 6) for p in (a, b, a)]


# --- scheduling: continuous vs static, arrivals, clocks -----------------------------------------------

def spans_of(results):
    return {r.id: r.spans for r in results}


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_continuous_fills_a_free_slot_at_once_and_static_waits_for_the_batch(batching):
    m = model()
    engine = Engine(m, 2, batching=batching)
    short, long_, waiting = engine.submit([1, 2, 3], 3), engine.submit([4, 5, 6], 30), engine.submit([7, 8, 9], 3)
    results = engine.run()
    s = spans_of(results)
    joined_waiting, left_short, left_long = s[waiting][0][0], s[short][0][1], s[long_][0][1]
    assert left_short < left_long
    if batching == "continuous":
        assert left_short <= joined_waiting < left_long        # took the short request's slot
    else:
        assert joined_waiting >= left_long                      # waited for the whole batch
    assert [r.tokens for r in results] == [solo(m, p, n) for p, n in (([1, 2, 3], 3), ([4, 5, 6], 30), ([7, 8, 9], 3))]


def test_arrivals_follow_the_real_clock_and_ttft_counts_from_arrival():
    m = model()
    engine = Engine(m, 4)
    engine.submit([1, 2, 3], 5, arrival_s=0.0)
    late = engine.submit([4, 5, 6], 5, arrival_s=0.08)
    t0 = time.perf_counter()
    results = engine.run()
    wall = time.perf_counter() - t0
    r = results[late]
    assert r.arrival_s == 0.08 and r.timestamps[0] >= 0.08
    assert math.isclose(r.ttft_s, r.timestamps[0] - 0.08)
    assert math.isclose(r.latency_s, r.timestamps[-1] - 0.08)
    assert math.isclose(r.tpot_s, (r.timestamps[-1] - r.timestamps[0]) / 4)
    assert r.itl_s == pytest.approx([b - a for a, b in zip(r.timestamps, r.timestamps[1:])])
    assert all(b >= a for a, b in zip(r.timestamps, r.timestamps[1:]))
    assert 0.08 <= max(x.timestamps[-1] for x in results) <= engine.wall_s <= wall


def test_step_by_step_and_a_second_workload_on_a_fresh_clock():
    m = model()
    engine = Engine(m, 2)
    assert engine.step() == [] and not engine.busy
    engine.submit([1, 2], 2)
    engine.submit([3, 4], 1)
    first = engine.step()                   # both prefill; the one-token request is done at once
    assert [r.id for r in first] == [1] and engine.busy
    second = engine.step()
    assert [r.id for r in second] == [0] and not engine.busy
    engine.submit([5, 6], 2)
    (r,) = engine.run()
    assert r.id == 2 and r.timestamps[0] < first[0].timestamps[0] + 1.0   # a new clock, from 0 again
    assert [x.id for x in engine.finished] == [2]


def test_run_workload_drives_the_engine_with_a_workload():
    m = model()
    wl = make_workload(6, vocab_size=VOCAB, prompt_len=(4, 20), output_len=(2, 8), rate=500.0, seed=1)
    engine = Engine(m, 3)
    for _ in range(2):                               # a second workload on the same engine numbers from 0 again
        results, wall_s = run_workload(engine, wl)
        assert [r.id for r in results] == list(range(6)) and wall_s > 0
        for r, req in zip(results, wl):
            assert r.arrival_s == req.arrival_s and r.tokens == solo(m, list(req.prompt_ids), req.max_new_tokens)
    named = dataclasses.replace(wl, requests=tuple(dataclasses.replace(r, id=100 + i) for i, r in enumerate(wl)))
    assert [r.id for r in run_workload(engine, named)[0]] == list(range(100, 106))


def test_storage_grows_with_the_load_not_the_worst_case():
    m = model()
    engine = Engine(m, 8)
    engine.submit([1, 2, 3], 4)
    engine.run()
    counts = engine.counts
    assert counts.kv_bytes_allocated == counts.block_bytes * engine.runner.cache.blocks_allocated
    assert engine.runner.cache.blocks_allocated < counts.n_blocks == 8 * math.ceil(CTX / 16)


# --- bad input -----------------------------------------------------------------------------------------

def test_a_request_longer_than_the_context_is_rejected_and_the_others_go_on():
    m = model()
    engine = Engine(m, 2)
    engine.submit([1, 2, 3], 4)
    bad = engine.submit(list(range(CTX - 2)), 5)
    engine.submit([4, 5], 4)
    results = engine.run()
    assert results[bad].finish_reason == "rejected" and results[bad].tokens == []
    assert f"exceed the context length {CTX}" in results[bad].error and "shorten" in results[bad].error
    assert math.isnan(results[bad].ttft_s)
    assert [r.finish_reason for r in results if r.id != bad] == ["length", "length"]


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(max_batch_size=0), ValueError, "max_batch_size must be >= 1, got 0"),
    (dict(max_batch_size=2.5), TypeError, "max_batch_size must be an int"),
    (dict(block_size=0), ValueError, "block_size must be >= 1"),
    (dict(block_size=CTX + 1), ValueError, f"block_size must be <= {CTX}"),
    (dict(kv_limit_bytes=-1), ValueError, "kv_limit_bytes must be >= 0"),
    (dict(batching="fifo"), ValueError, r"unknown batching 'fifo'; choose one of \['continuous', 'static'\]"),
    (dict(prefix_caching="yes"), TypeError, "prefix_caching must be True or False"),
    (dict(max_num_batched_tokens=1), ValueError, "max_num_batched_tokens=1 is smaller than max_batch_size=2: every "
                                                 "step must fit one token for each running request"),
    (dict(max_num_batched_tokens=0), ValueError, "max_num_batched_tokens must be >= 1"),
    (dict(max_num_batched_tokens=8, chunked_prefill=False), ValueError,
     f"max_num_batched_tokens=8 is below the context length {CTX}: without chunked prefill a whole prompt"),
    (dict(chunked_prefill=1), TypeError, "chunked_prefill must be True or False"),
])
def test_bad_engine_settings(kwargs, exc, match):
    kwargs = {"max_batch_size": 2, **kwargs}
    with pytest.raises(exc, match=match):
        Engine(model(), **kwargs)


def test_not_a_model():
    with pytest.raises(TypeError, match="model must be a GPT model"):
        Engine("gpt2", 2)


@pytest.mark.parametrize("args, kwargs, exc, match", [
    (([], 4), {}, ValueError, "prompt_ids is empty"),
    (("hello", 4), {}, TypeError, "encode text with the model's tokenizer"),
    (({1: 2}, 4), {}, TypeError, "prompt_ids must be a list of token ids, got dict"),      # was taken as [1]
    (([1.5, 2], 4), {}, TypeError, r"prompt_ids\[0\] must be an int"),
    (([1, VOCAB], 4), {}, ValueError, rf"prompt_ids holds token id {VOCAB}, outside the vocab of size {VOCAB}"),
    ((torch.zeros(2, 3, dtype=torch.long), 4), {}, ValueError, "must be one prompt, a 1-D sequence"),
    (([1, 2], 0), {}, ValueError, "max_new_tokens must be >= 1"),
    (([1, 2], 4), dict(arrival_s=-1), ValueError, "arrival_s must be a finite number >= 0"),
    (([1, 2], 4), dict(arrival_s=1e9), ValueError, "arrival_s must be a finite number >= 0 and <= 3600"),
    (([1, 2], 4), dict(eos_id=VOCAB), ValueError, f"eos_id must be <= {VOCAB - 1}"),
    (([1, 2], 4), dict(temperature=-1), ValueError, "temperature"),
    (([1, 2], 4), dict(temperature=1, top_p=0), ValueError, "top_p"),
    (([1, 2], 4), dict(temperature=1, seed=-3), ValueError, "seed"),
])
def test_bad_requests_are_refused_at_submit(args, kwargs, exc, match):
    engine = Engine(model(), 2)
    with pytest.raises(exc, match=match):
        engine.submit(*args, **kwargs)
    assert not engine.busy


def test_a_tensor_prompt_is_accepted():
    engine = Engine(model(), 1)
    engine.submit(torch.tensor([1, 2, 3]), 3)
    (r,) = engine.run()
    assert r.tokens == solo(model(), [1, 2, 3], 3)


@pytest.mark.gpu
def test_gpu_engine_gives_the_solo_tokens():
    m = model(2, False, 1).float().cuda()
    prompts = [list(range(i, i + 5 + 3 * i)) for i in range(4)]
    engine = Engine(m, 4, block_size=4)
    for p in prompts:
        engine.submit(p, 30)
    results = engine.run()
    assert engine.runner.cache.device.type == "cuda" and max_batch_seen(engine) == 4
    assert [r.tokens for r in results] == [solo(m, p, 30) for p in prompts]


def test_gantt_bars_split_each_stay_into_prefill_and_decode():
    from labutils.figures.serving import gantt_bars, gantt_figure
    from labutils.serving.workload import RequestResult
    # Arrives at 0.1, joins at 0.3, first token at 0.5, preempted at 0.9, rejoins at 1.2, tokens to 1.6.
    r = RequestResult(id=7, arrival_s=0.1, tokens=[1, 2, 3, 4], timestamps=[0.5, 0.7, 1.4, 1.6],
                      finish_reason="length", spans=[(0.3, 0.9), (1.2, 1.6)])
    assert gantt_bars(r) == [("queued", 0.1, 0.3), ("prefill", 0.3, 0.5), ("decode", 0.5, 0.9),
                             ("queued", 0.9, 1.2), ("prefill", 1.2, 1.4), ("decode", 1.4, 1.6)]
    # A stay with no token (preempted during its prefill) is all prefill, and a zero-length wait draws nothing.
    r2 = RequestResult(id=8, arrival_s=0.0, tokens=[], timestamps=[], finish_reason="failed", spans=[(0.0, 0.4)])
    assert gantt_bars(r2) == [("prefill", 0.0, 0.4)]
    fig = gantt_figure([r, r2])
    assert [t.name for t in fig.data] == ["queued", "prefill", "decode"]
    assert list(fig.data[1].base) == [0.3, 1.2, 0.0] and list(fig.data[1].y) == [7, 7, 8]
    # 128 requests (the dashboard's most) once drew a chart 1,912 px tall; it stops growing at 40 rows' height.
    many = [RequestResult(id=i, arrival_s=0.0, tokens=[1], timestamps=[0.1], finish_reason="length",
                          spans=[(0.0, 0.1)]) for i in range(128)]
    assert gantt_figure(many).layout.height == gantt_figure(many[:40]).layout.height < 700


def test_sequences_compare_by_identity_and_keep_their_tokens_whole():
    """`seq in running` and `running.remove(seq)` compared every field of every request: quadratic in the batch."""
    from labutils.serving.sequence import Sequence
    a, b = Sequence(0, [1, 2, 3], 5, 0.0), Sequence(0, [1, 2, 3], 5, 0.0)
    assert a != b and b not in [a] and a in [b, a]
    assert a.tokens is a.tokens, "tokens is kept, not rebuilt on every use"
    a.add_token(9, 1.5)
    assert (a.tokens, a.generated, a.timestamps, a.prompt) == ([1, 2, 3, 9], [9], [1.5], [1, 2, 3])


def test_similar_lengths_never_groups_a_table_more_than_twice_the_first():
    from labutils.serving.paged_cache import similar_lengths
    assert similar_lengths([2, 2, 3, 4, 5, 20, 21]) == [range(0, 4), range(4, 5), range(5, 7)]
    assert similar_lengths([]) == [] and similar_lengths([7]) == [range(0, 1)]


def test_decode_rows_attend_in_groups_of_similar_length():
    """One long request among short ones must not make every row gather as many blocks as it has."""
    from labutils.serving.paged_cache import PagedKVCache, Row
    m = model()
    cache = PagedKVCache(m.config, 4, 40)
    cache.ensure(40)
    rows = [Row([0], 2, 1), Row([1, 2], 5, 1), Row([3, 4], 6, 1), Row(list(range(5, 25)), 70, 1), Row([25, 26], 0, 7)]
    view = cache.batch(rows)
    assert [(g.rows, tuple(g.tables.shape)) for g in view._groups] == [(range(0, 3), (3, 2)), (range(3, 4), (1, 20))]
    assert [(c.start, c.n, len(c.table)) for c in view._chunks] == [(0, 7, 2)]
    assert view.positions.tolist() == [2, 5, 6, 70, 0, 1, 2, 3, 4, 5, 6]


def test_pool_growth_holds_at_most_one_layer_beyond_the_new_pool(monkeypatch):
    """Bug 6: growing one [n_layer, ...] pool held the old and the new pool at once (1.5x the final pool at the
    last doubling), so a budget above about 2/3 of free memory failed though it fit. Layers now grow one by one."""
    from labutils.serving.paged_cache import PagedKVCache
    m = make_model(n_layer=6)
    cache = PagedKVCache(m.config, 4, 64)
    cache.ensure(32)
    live_peak, real_new_zeros = [0], torch.Tensor.new_zeros

    def counting_new_zeros(self, *args, **kwargs):
        out = real_new_zeros(self, *args, **kwargs)
        live_peak[0] = max(live_peak[0], sum(t.nbytes for t in cache.k + cache.v) + out.nbytes)
        return out

    monkeypatch.setattr(torch.Tensor, "new_zeros", counting_new_zeros)
    cache.ensure(64)                                   # the last doubling: 32 -> 64 blocks
    final, one_layer = cache.nbytes, cache.k[0].nbytes
    assert cache.blocks_allocated == 64 and final == 64 * cache.block_bytes
    assert live_peak[0] <= final + one_layer < 1.5 * final
