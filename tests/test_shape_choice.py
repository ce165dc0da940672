"""The lesson model for the device (perf.shape_choice.shape_for) and random weights built on the device in 16 bits
(model.build), checked without a GPU: free memory mocked under emulated CUDA, and the build traced on the meta
device and run on emulated CUDA."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from labutils.core import fake_cuda
from labutils.core.emulated_cuda import emulated_cuda
from labutils.core.validate import DoesNotFitError
from labutils.model.build import build
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.presets import PRESETS
from labutils.perf.roofline import kv_cache_bytes, weight_bytes
from labutils.perf.shape_choice import GPU_SHAPES, shape_for

GB = 1e9


@pytest.fixture(scope="module", autouse=True)
def guard():
    fake_cuda.install_guard()


@contextlib.contextmanager
def on_gpu(free_gb: float, bf16: bool = True):
    """Emulated CUDA with `free_gb` free. The two patches are undone inside the emulation: monkeypatch's undo, after
    it, would put the emulation's stand-ins back into torch.cuda for every later test."""
    def free(*args):                                              # (bytes free, bytes in all)
        return int(free_gb * GB), int(141 * GB)
    with emulated_cuda(), mock.patch.object(torch.cuda, "mem_get_info", free), \
            mock.patch.object(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16):
        yield


@pytest.mark.parametrize("free_gb, want", [(139.0, "llama-2-7b"), (30.0, "llama-2-7b"), (28.0, "llama-3.2-3b"),
                                           (12.0, "llama-3.2-1b"), (4.0, "gpt2-small")])
def test_the_largest_shape_whose_weights_and_cache_fit_half_the_free_memory(free_gb, want, monkeypatch):
    with on_gpu(free_gb):
        choice = shape_for("cuda", "gpt2-small", cache_tokens=1200)
    assert choice.preset == want and choice.dtype == torch.bfloat16
    if want in GPU_SHAPES:
        need = weight_bytes(want, torch.bfloat16) + kv_cache_bytes(want, 1200, 1, torch.bfloat16)
        assert need <= 0.5 * free_gb * GB
        larger = GPU_SHAPES[:GPU_SHAPES.index(want)]
        assert all(weight_bytes(n, torch.bfloat16) + kv_cache_bytes(n, 1200, 1, torch.bfloat16) > 0.5 * free_gb * GB
                   for n in larger)
        assert f"{free_gb:.1f} GB free" in choice.why
    else:
        assert "even llama-3.2-1b needs" in choice.why
    assert "PRESET" in str(choice)                    # every lesson prints how to choose another


def test_a_bigger_cache_moves_the_choice_down(monkeypatch):
    with on_gpu(40.0):
        small = shape_for("cuda", "gpt2-small", cache_tokens=1000)
        big = shape_for("cuda", "gpt2-small", cache_tokens=4096, batch=8)
    assert (small.preset, big.preset) == ("llama-2-7b", "llama-3.2-3b")


def test_fp16_where_the_gpu_has_no_bf16(monkeypatch):
    with on_gpu(80.0, bf16=False):
        choice = shape_for("cuda", "gpt2-small", cache_tokens=1000)
    assert choice.dtype == torch.float16 and "no bf16" in choice.why


def test_off_cuda_the_lesson_keeps_its_own_shape():
    choice = shape_for("cpu", "tiny", cache_tokens=100_000)
    assert (choice.preset, choice.dtype, choice.config) == ("tiny", torch.float32, GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match="cpu_shape"):
        shape_for("cpu", "llama-9", cache_tokens=10)
    with pytest.raises(ValueError, match="share"):
        shape_for("cpu", "tiny", cache_tokens=10, share=0)


def test_a_lesson_may_bring_its_own_cpu_config_and_still_gets_a_published_shape_on_a_gpu(monkeypatch):
    own = GPTConfig(vocab_size=4096, context_length=1024, n_layer=8, n_head=8, n_embd=512)
    here = shape_for("cpu", own, cache_tokens=3136, batch=9)
    assert (here.config, here.dtype, here.preset) == (own, torch.float32, "the lesson's 8-layer, 512-wide GPT")
    assert "in place of the lesson's config" in str(here) and "set PRESET" in str(shape_for("cpu", "tiny", cache_tokens=9))
    with on_gpu(139.0):
        there = shape_for("cuda", own, cache_tokens=3136, batch=9)
    assert (there.preset, there.config) == ("llama-2-7b", GPTConfig.preset("llama-2-7b"))


def test_every_llama_preset_builds_as_its_published_parameter_count():
    for name in ("llama-3.2-1b", "llama-3.2-3b", "llama-2-7b", "llama-3-8b", "mistral-7b"):
        cfg = GPTConfig.preset(name)
        assert cfg.rope and cfg.norm == "rmsnorm" and cfg.num_params() == PRESETS[name].n_params
        with torch.device("meta"):
            assert GPT(cfg).num_params() == PRESETS[name].n_params


def test_a_7b_model_is_laid_out_in_16_bits_without_a_byte_of_fp32(monkeypatch):
    """The build never makes an fp32 copy: every allocation it asks for on the device is bf16 (traced on emulated
    CUDA with a 7B shape cut to 2 layers, so it runs in seconds)."""
    cfg = GPTConfig.preset("llama-2-7b", n_layer=2, vocab_size=1024)
    seen = []
    real_empty = torch.empty_like

    def spy(t, *a, **k):
        seen.append(k.get("dtype", t.dtype))
        return real_empty(t, *a, **k)
    with emulated_cuda():
        monkeypatch.setattr(torch, "empty_like", spy)
        model = build(cfg, "cuda", torch.bfloat16, seed=0)
    assert seen and set(seen) == {torch.bfloat16}
    params = list(model.parameters())
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in params)
    assert model.num_params() == cfg.num_params()
    assert 0.015 < model.tok_emb.weight.float().std().item() < 0.025       # GPT-2's init, not empty memory


def test_the_build_is_seeded_and_refuses_what_does_not_fit(monkeypatch):
    cfg = GPTConfig(vocab_size=64, context_length=32, n_layer=2, n_head=2, n_embd=16)
    a, b = build(cfg, "cpu", torch.bfloat16, seed=3), build(cfg, "cpu", torch.bfloat16, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.lm_head.weight is a.tok_emb.weight                # tied weights stay tied
    torch.manual_seed(0)
    plain = GPT(cfg)
    assert not torch.equal(plain.tok_emb.weight.bfloat16(), a.tok_emb.weight)
    with on_gpu(10.0):
        with pytest.raises(DoesNotFitError, match=r"13\.5 GB in torch.bfloat16, but only 10\.0 GB is free on cuda"):
            build(GPTConfig.preset("llama-2-7b"), "cuda", torch.bfloat16)


def test_emulated_cuda_keeps_the_small_shapes():
    # Emulated CUDA computes on the CPU: a lesson that picked a Llama shape there would run for hours (the dry run
    # of gpu_check timed out on lesson 06 when emulated CUDA said 16 GiB were free). It reports too little memory.
    with emulated_cuda():
        choice = shape_for("cuda", "tiny", cache_tokens=4096)
    assert choice.preset == "tiny" and choice.dtype == torch.bfloat16 and "even llama-3.2-1b needs" in choice.why


def test_the_baseline_prompt_doubles_until_a_roof_sets_its_prefill(monkeypatch):
    """Lesson 05's baseline prompt: the shortest doubling of `shortest` whose FLOPs at the peak take at least twice its
    pass's fixed costs and at least its host's time (floor_sets_time), so that twice the prompt can double TTFT."""
    from labutils import measure
    from labutils.measure import request
    from labutils.perf import roofline
    asked, host = [], {"s": 0.01}
    monkeypatch.setattr(request, "fixed_pass_s", lambda preset, phase, n, *a, **k: 0.004)
    monkeypatch.setattr(request, "measure_request", lambda preset, n, *a, **k: asked.append((n, k)) or
                        {"ttft_s": host["s"]})
    peak = roofline.prefill_flops(GPTConfig.preset("tiny"), 512) / 0.025       # 512 tokens: 25 ms, 256: under 13
    choice = measure.compute_bound_prompt("tiny", "fp32", "cpu", peak)
    assert (choice.tokens, choice.fixed_s, choice.host_s) == (256, 0.004, 0.01) and choice.compute_bound
    host["s"] = 0.02                                        # a host slower than 256 tokens' floor: 512
    choice = measure.compute_bound_prompt("tiny", "fp32", "cpu", peak)
    assert choice.tokens == 512 and choice.floor_s == pytest.approx(0.025) and choice.compute_bound
    assert [a[0] for a in asked] == [256, 256, 512] and all(k["skeleton"] and k["repeats"] == 3 for _, k in asked)
    choice = measure.compute_bound_prompt("tiny", "fp32", "cpu", peak * 1e6, longest=2048)
    assert choice.tokens == 2048 and not choice.compute_bound      # none qualifies: the last doubling, and it says so
    assert max(k["context_length"] for _, k in asked) >= 2048 + 16          # a position table long enough for each
    assert measure.compute_bound_prompt("tiny", "fp32", "cpu", peak * 1e6, longest=3000).tokens == 2048
    with pytest.raises(ValueError, match="longest"):
        measure.compute_bound_prompt("tiny", "fp32", "cpu", peak, shortest=512, longest=256)


def test_the_host_counts_only_where_it_is_slower_than_the_floor():
    from labutils.measure import floor_sets_time
    assert floor_sets_time(1.0, 0.5) and not floor_sets_time(1.0, 0.6)           # twice the fixed costs
    assert floor_sets_time(1.0, 0.1, host_s=1.0) and not floor_sets_time(1.0, 0.1, host_s=1.1)
    assert not floor_sets_time(1.0, 0.6, host_s=0.1)                              # and both
