"""The serving engine's graphed decode steps (serving.decode_graphs), checked without a GPU: the static buffers a
graph replays give the eager step's tokens; a failed capture falls back to eager and says why; a pool that grows
drops the graphs recorded over its old tensors. On a GPU, make gpu-check runs the capture itself."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from labutils.core.emulated_cuda import emulated_cuda
from labutils.decode import fastgen
from labutils.model import GPTConfig
from labutils.model.build import build
from labutils.serving import Engine
from labutils.serving.decode_graphs import DecodeGraphs, bucket, graphs_unavailable
from labutils.serving.runner import ModelRunner

LLAMA = dataclasses.replace(GPTConfig.preset("llama-3.2-1b"), n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
                            n_inner=128, vocab_size=256, context_length=256)


@pytest.fixture(scope="module")
def model():
    return build(LLAMA, "cpu", torch.float32)


def serve(model, graphs, *, kv_limit_bytes=None, prefix=(), sampled=False, seed=0):
    """Nine requests of mixed lengths at t=0 (batches of 1 to 6 rows, so every bucket pads); their tokens."""
    eng = Engine(model, 6, block_size=4, kv_limit_bytes=kv_limit_bytes, cuda_graphs=False)
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
                                  dict(sampled=True)], ids=["plain", "preempting", "shared-prefix", "sampled"])
def test_the_static_decode_step_gives_the_eager_tokens(model, case):
    eager, _ = serve(model, None, **case)
    static, eng = serve(model, lambda cache: DecodeGraphs(model, cache, capture=False), **case)
    assert static == eager
    assert eng.runner.graphs._steps, "no step ran through the static buffers"
    assert all(rows == bucket(rows) and width == bucket(width) for rows, width in eng.runner.graphs._steps)


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [1, 2, 4, 4, 8, 8, 16, 128]


def test_a_pool_that_grows_drops_the_graphs_recorded_over_it(model, monkeypatch):
    recorded = []
    monkeypatch.setattr(fastgen, "capture_graph", lambda fn, device, warm_up: recorded.append(fn) or fn)
    made = []

    def graphs(cache):
        made.append(DecodeGraphs(model, cache, capture=True))
        return made[-1]
    eager, _ = serve(model, None)
    tokens, eng = serve(model, graphs)
    assert tokens == eager
    buckets_now = len(made[0]._steps)
    assert made[0].recorded == len(recorded) > buckets_now      # the pool doubled: some buckets were recorded again


def test_a_capture_that_fails_decodes_eager_and_says_why(model, monkeypatch):
    def refuse(fn, device, warm_up):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(fastgen, "capture_graph", refuse)
    eager, _ = serve(model, None)
    with pytest.warns(RuntimeWarning, match="capture failed .*stream is capturing.*decoding eager"):
        tokens, eng = serve(model, lambda cache: DecodeGraphs(model, cache, capture=True))
    assert tokens == eager and eng.runner.graphs.failed


def test_graphs_are_used_only_where_the_device_has_them(model):
    assert ModelRunner(model, 4, 8).graphs is None                           # a CPU: eager
    with pytest.raises(ValueError, match="cuda_graphs=True, but CUDA graphs need an NVIDIA GPU; the model is on cpu"):
        ModelRunner(model, 4, 8, cuda_graphs=True)
    with emulated_cuda():
        assert "emulated" in graphs_unavailable(torch.device("cuda"))


@pytest.mark.gpu
def test_gpu_decode_steps_replay_as_graphs_and_give_the_eager_tokens(model):
    cuda = build(LLAMA, "cuda", torch.bfloat16)
    eager, _ = serve(cuda, None)
    graphed, eng = serve(cuda, lambda cache: DecodeGraphs(cuda, cache))
    assert eng.runner.graphs.failed is None and eng.runner.graphs.recorded > 0
    assert graphed == eager
    assert Engine(cuda, 2).runner.graphs is not None                   # on by default where the device has them
