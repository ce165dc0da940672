"""The serving engine's graphed steps (serving.step_graphs), checked without a GPU: the fixed buffers a graph replays
(decode rows and at most one prefill chunk, padded to buckets) give the eager step's tokens; a failed capture falls
back to eager and says why; a pool that grows drops the graphs recorded over its old tensors. On a GPU,
make gpu-check runs the capture itself."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labutils.core.emulated_cuda import emulated_cuda
from labutils.decode import fastgen
from labutils.model import GPTConfig
from labutils.model.build import build
from labutils.serving import Engine
from labutils.core.devices import graphs_unavailable
from labutils.serving.step_graphs import MOST_CHUNK, StepGraphs, bucket
from labutils.serving.runner import ModelRunner

LLAMA = dataclasses.replace(GPTConfig.preset("llama-3.2-1b"), n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                            n_inner=128, vocab_size=256, context_length=256)


@pytest.fixture(scope="module")
def model():
    return build(LLAMA, "cpu", torch.float32)


def serve(model, graphs, *, kv_limit_bytes=None, prefix=(), sampled=False, budget=None, seed=0):
    """Nine requests of mixed lengths at t=0 (batches of 1 to 6 rows, so every bucket pads); their tokens."""
    eng = Engine(model, 6, block_size=4, kv_limit_bytes=kv_limit_bytes, max_num_batched_tokens=budget,
                 cuda_graphs=False)
    if graphs is not None:
        eng.runner.graphs = graphs(eng.runner.cache)
    g = torch.Generator().manual_seed(seed)
    for i in range(9):
        prompt = list(prefix) + torch.randint(0, 256, (int(torch.randint(3, 40, (1,), generator=g)),),
                                              generator=g).tolist()
        options = dict(temperature=0.8, top_k=20, seed=i) if sampled and i % 2 else {}
        eng.submit(prompt, int(torch.randint(8, 40, (1,), generator=g)), **options)
    return [r.tokens for r in eng.run()], eng


@pytest.mark.parametrize("case", [dict(), dict(kv_limit_bytes=6_000), dict(prefix=tuple(range(1, 13))),
                                  dict(sampled=True), dict(budget=16), dict(budget=16, prefix=tuple(range(1, 30)))],
                         ids=["plain", "preempting", "shared-prefix", "sampled", "chunked", "chunked-prefix"])
def test_the_fixed_buffer_step_gives_the_eager_tokens(model, case):
    eager, _ = serve(model, None, **case)
    static, eng = serve(model, lambda cache: StepGraphs(model, cache, capture=False), **case)
    assert static == eager
    keys = eng.runner.graphs.buckets
    assert any(rows for rows, *_ in keys), "no decode step ran through the fixed buffers"
    assert any(chunk for _, _, chunk, _ in keys), "no step with a prefill chunk ran through them"
    assert all(x == bucket(x) for key in keys for x in key)


@pytest.mark.parametrize("n_decode,chunk_n,start", [(3, 5, 9), (0, 12, 17), (5, 0, 0), (1, 2, 0)])
def test_a_fixed_buffer_step_gives_the_packed_steps_logits(model, n_decode, chunk_n, start):
    """Logits, not just tokens: a random model's argmax hardly moves when attention is wrong. Keys and values are
    random too, so a query that sees one key too many or too few changes its row."""
    from labutils.serving.paged_cache import PagedKVCache, Row
    g = torch.Generator().manual_seed(n_decode * 100 + chunk_n)
    caches = []
    for _ in range(2):
        cache = PagedKVCache(LLAMA, 4, 64)
        cache.ensure(64)
        caches.append(cache)
    for layer in range(LLAMA.n_layer):
        for pools in ("k", "v"):
            values = torch.randn(getattr(caches[0], pools)[layer].shape, generator=g)
            for cache in caches:
                getattr(cache, pools)[layer].copy_(values)
    blocks = torch.randperm(64, generator=g).tolist()
    decode = []
    for i in range(n_decode):                                 # tables of 2 to 6 blocks, each row at its own position
        width = 2 + i % 5
        table, blocks = blocks[:width], blocks[width:]
        decode.append((int(torch.randint(0, 256, (1,), generator=g)), 4 * width - 1 - i % 3, table))
    chunk = None
    if chunk_n:
        width = -(-(start + chunk_n) // 4) + 1                # one block more than it needs, as a table can hold
        chunk = (torch.randint(0, 256, (chunk_n,), generator=g).tolist(), start, blocks[:width])
    rows = [Row(t, p, 1) for _, p, t in decode] + ([Row(chunk[2], start, chunk_n)] if chunk else [])
    ids = torch.tensor([[tok for tok, _, _ in decode] + (chunk[0] if chunk else [])])
    with torch.inference_mode():
        packed = model(ids, caches[0].batch(rows), check=False)[0]
        fixed = StepGraphs(model, caches[1], capture=False).run(decode, chunk)
    want = packed[list(range(n_decode)) + ([n_decode + chunk_n - 1] if chunk else [])]
    torch.testing.assert_close(fixed, want, atol=1e-4, rtol=1e-4)
    for layer in range(LLAMA.n_layer):                        # and the same keys and values were written
        torch.testing.assert_close(caches[1].k[layer], caches[0].k[layer], atol=1e-5, rtol=1e-5)


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 5, 8, 9, 100)] == [0, 1, 2, 4, 4, 8, 8, 16, 128]


def test_a_step_with_two_chunks_or_a_long_one_runs_eager(model, monkeypatch):
    seen = []
    real = StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, decode, chunk: seen.append(chunk) or real(self, decode, chunk))
    eng = Engine(model, 4, block_size=4, cuda_graphs=False)
    eng.runner.graphs = StepGraphs(model, eng.runner.cache, capture=False)
    eng.submit(list(range(1, 20)), 2)
    eng.submit(list(range(100, 130)), 2)               # two prompts in the first step: two chunks, eager
    eng.step()
    assert seen == []
    longest = (list(range(MOST_CHUNK)), 0, [0])
    assert StepGraphs.fits([longest]) and not StepGraphs.fits([(longest[0] + [0], 0, [0])])
    assert StepGraphs.fits([]) and not StepGraphs.fits([longest, longest])


def test_a_pool_that_grows_drops_the_graphs_recorded_over_it(model, monkeypatch):
    recorded = []
    monkeypatch.setattr(fastgen, "capture_graph", lambda fn, device, warm_up: recorded.append(fn) or fn)
    made = []

    def graphs(cache):
        made.append(StepGraphs(model, cache, capture=True))
        return made[-1]
    eager, _ = serve(model, None)
    tokens, eng = serve(model, graphs)
    assert tokens == eager
    assert made[0].recorded == len(recorded) > len(made[0].buckets)   # the pool doubled: buckets were recorded again


def test_a_capture_that_fails_decodes_eager_and_says_why(model, monkeypatch):
    def refuse(fn, device, warm_up):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(fastgen, "capture_graph", refuse)
    eager, _ = serve(model, None)
    with pytest.warns(RuntimeWarning, match="capture failed .*stream is capturing.*running eager"):
        tokens, eng = serve(model, lambda cache: StepGraphs(model, cache, capture=True))
    assert tokens == eager and eng.runner.graphs.failed


def test_graphs_are_used_only_where_the_device_has_them(model):
    assert ModelRunner(model, 4, 8).graphs is None                           # a CPU: eager
    with pytest.raises(ValueError,
                       match="cuda_graphs=True, but CUDA graphs need an NVIDIA GPU and the model is on cpu"):
        ModelRunner(model, 4, 8, cuda_graphs=True)
    with emulated_cuda():
        assert "emulated" in graphs_unavailable(torch.device("cuda"))


def test_recording_a_graph_is_setup_kept_off_the_engines_clocks(model, monkeypatch):
    """vLLM records its graphs before it serves. Here a step records one the first time its bucket comes, so the
    engine's clock (and a simulated machine's) leaves those seconds out: a 0.3 s recording is no 0.3 s token gap."""
    import time
    from labutils.serving import disagg, make_workload, runner

    def slow_capture(fn, device, warm_up):
        time.sleep(0.3)
        return fn
    monkeypatch.setattr(fastgen, "capture_graph", slow_capture)
    monkeypatch.setattr(runner, "graphs_unavailable", lambda device: None)     # graphs on, as on a GPU
    tokens, eng = serve(model, lambda cache: StepGraphs(model, cache), budget=16)
    assert eng.runner.setup_s >= 0.3 * eng.runner.graphs.recorded > 0
    gaps = [b - a for r in eng.finished for a, b in zip(r.timestamps, r.timestamps[1:])]
    assert max(gaps) < 0.25 and eng.wall_s < eng.runner.setup_s
    wl = make_workload(6, vocab_size=256, prompt_len=(4, 30), output_len=(4, 12), seed=0)
    sim = disagg.serve_mixed(model, wl, 4)
    waits = [b - a for r in sim.results for a, b in zip([r.arrival_s] + r.timestamps, r.timestamps)]
    assert max(waits) < 0.25 and max(sim.busy) <= 1.0


@pytest.mark.gpu
def test_gpu_decode_steps_replay_as_graphs_and_give_the_eager_tokens(model):
    cuda = build(LLAMA, "cuda", torch.float32)      # fp32: a graph's padded widths sum keys in another order, and
                                                    # bf16 rounding could flip a near-tie of a random model
    eager, _ = serve(cuda, None)
    graphed, eng = serve(cuda, lambda cache: StepGraphs(cuda, cache))
    assert eng.runner.graphs.failed is None and eng.runner.graphs.recorded > 0
    assert graphed == eager
    assert Engine(cuda, 2).runner.graphs is not None                   # on by default where the device has them
