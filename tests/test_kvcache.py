"""KV cache: the bytes formula for every preset and dtype, the 7B crossover, GQA/MQA, the static buffers."""
import dataclasses

import pytest
import torch

from labutils.core.dtypes import dtype_bytes
from labutils.decode.kvcache import KVCache
from labutils.perf.roofline import (counts, decode_bytes, flops_per_token, kv_bytes_per_token, kv_cache_bytes,
                                    kv_positions, prefill_flops, sliding_window,
                                    tokens_where_cache_exceeds_weights, weight_bytes)
from labutils.model.gpt import GPTConfig
from labutils.model.presets import PRESETS, get_shape

# Written out independently of labutils, so a wrong table there cannot agree with itself.
BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1,
         torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.int8: 1}
# Sliding windows from the models' config.json files, written out here for the same reason.
WINDOW = {"mistral-7b": 4096}
if hasattr(torch, "float8_e4m3fn"):
    BYTES[torch.float8_e4m3fn] = 1
    BYTES[torch.float8_e5m2] = 1


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", list(BYTES), ids=str)
def test_formula_for_every_preset_and_dtype(preset, dtype):
    s = get_shape(preset)
    for seq_len, batch in [(0, 1), (1, 1), (1000, 1), (4096, 8), (s.context_length, 3)]:
        kept = min(seq_len, WINDOW.get(preset, seq_len))
        expected = 2 * s.n_layer * s.n_kv_head * (s.n_embd // s.n_head) * BYTES[dtype] * kept * batch
        assert kv_cache_bytes(preset, seq_len, batch, dtype) == expected
        assert kv_cache_bytes(s, seq_len, batch, dtype) == expected
    assert kv_bytes_per_token(preset, dtype) == kv_cache_bytes(preset, 1, 1, dtype)


def test_default_dtype_is_fp16():
    assert kv_cache_bytes("gpt2-small", 10) == kv_cache_bytes("gpt2-small", 10, 1, "fp16")
    assert dtype_bytes(torch.float16) == dtype_bytes("fp16") == 2


def test_gpt_config_works_like_a_preset():
    cfg = GPTConfig.preset("llama-3-8b")
    assert kv_cache_bytes(cfg, 100, 2) == kv_cache_bytes("llama-3-8b", 100, 2)
    small = GPTConfig(vocab_size=100, context_length=64, n_layer=2, n_head=4, n_embd=32)
    assert weight_bytes(small, "fp32") == 4 * small.num_params()


def test_seed_7b_example_half_a_megabyte_per_token():
    # Llama-2-7B: 32 layers x 32 KV heads x 128 dims x K and V x 2 bytes = 0.5 MiB per token.
    assert kv_bytes_per_token("llama-2-7b") == 2 * 32 * 32 * 128 * 2 == 524_288
    # ~14 GB of fp16 weights, as the essay says.
    assert weight_bytes("llama-2-7b") == 6_738_415_616 * 2
    assert 13e9 < weight_bytes("llama-2-7b") < 14e9


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("dtype", ["fp16", "fp8"])
def test_crossover_is_the_first_context_where_the_cache_is_bigger(preset, batch, dtype):
    n = tokens_where_cache_exceeds_weights(preset, batch, dtype)
    w = weight_bytes(preset)
    if n is None:       # only a window can cap the cache below the weights, and then no context gets there
        assert preset in WINDOW and kv_cache_bytes(preset, 10 ** 9, batch, dtype) <= w
        return
    assert kv_cache_bytes(preset, n - 1, batch, dtype) <= w < kv_cache_bytes(preset, n, batch, dtype)


def test_seed_7b_crossover():
    n = tokens_where_cache_exceeds_weights("llama-2-7b")
    assert n == 13_476_831_232 // 524_288 + 1 == 25_706   # 25,705.02 tokens of 0.5 MiB fill 14 GB
    # One request never gets there within Llama-2's 4,096-token context...
    assert n > get_shape("llama-2-7b").context_length
    assert kv_cache_bytes("llama-2-7b", 4096) == 2 * 1024 ** 3      # 2 GiB at full context
    # ...but a batch of 7 full-context conversations does: the "busy batch" of the essay.
    assert kv_cache_bytes("llama-2-7b", 4096, 6) < weight_bytes("llama-2-7b") < kv_cache_bytes("llama-2-7b", 4096, 7)
    assert tokens_where_cache_exceeds_weights("llama-2-7b", 7) <= 4096 < tokens_where_cache_exceeds_weights("llama-2-7b", 6)
    # An fp8 cache holds twice the tokens before it gets there.
    assert tokens_where_cache_exceeds_weights("llama-2-7b", dtype="fp8") == 2 * (n - 1) + 1


def test_gqa_and_mqa_shrink_the_cache():
    assert kv_bytes_per_token("llama-2-7b") == 4 * kv_bytes_per_token("llama-3-8b")   # 32 -> 8 KV heads
    assert kv_bytes_per_token("mistral-7b") == kv_bytes_per_token("llama-3-8b")
    assert kv_bytes_per_token("llama-2-70b") == kv_bytes_per_token("llama-2-7b") * 80 * 8 // (32 * 32)
    mqa = dataclasses.replace(get_shape("llama-2-7b"), n_kv_head=1)
    assert kv_bytes_per_token("llama-2-7b") == 32 * kv_bytes_per_token(mqa)


def test_sliding_window_caps_mistral_at_4096_positions():
    per_token = kv_bytes_per_token("mistral-7b")
    assert kv_cache_bytes("mistral-7b", 32768) == kv_cache_bytes("mistral-7b", 4096) == 4096 * per_token
    assert kv_cache_bytes("mistral-7b", 4095) == 4095 * per_token           # grows until the window is full
    assert kv_cache_bytes("mistral-7b", 4097, 3, "fp8") == kv_cache_bytes("mistral-7b", 4096, 3, "fp8")
    assert kv_positions("mistral-7b", 32768) == 4096 and kv_positions("llama-3-8b", 8192) == 8192
    assert sliding_window("mistral-7b") == 4096 and sliding_window("llama-3-8b") is None
    # Llama-3-8B has the same per-token bytes, and no window: its cache keeps growing.
    assert kv_cache_bytes("llama-3-8b", 8192) == 2 * kv_cache_bytes("mistral-7b", 8192)


def test_sliding_window_in_the_crossover_and_the_step_costs():
    # At batch 1 the capped cache (0.54 GB) never reaches the 14.5 GB of weights; a batch of 27 windows does.
    w, window_bytes = weight_bytes("mistral-7b"), kv_cache_bytes("mistral-7b", 4096)
    assert tokens_where_cache_exceeds_weights("mistral-7b") is None
    assert 26 * window_bytes <= w < 27 * window_bytes
    assert tokens_where_cache_exceeds_weights("mistral-7b", 26) is None
    assert tokens_where_cache_exceeds_weights("mistral-7b", 27) <= 4096
    # A step reads (and attends over) the window only: the same bytes and FLOPs at 8k as at 4k.
    assert decode_bytes("mistral-7b", 8192) == decode_bytes("mistral-7b", 4096)
    assert flops_per_token("mistral-7b", 8192) == flops_per_token("mistral-7b", 4096)
    assert flops_per_token("llama-3-8b", 8192) > flops_per_token("llama-3-8b", 4096)
    # Prefill: token t attends to min(t, 4096) keys, so 100 tokens past the window add 100 x 4096 keys.
    c = counts("mistral-7b")
    per_key, per_token = 4 * c.n_layer * c.n_embd, 2 * c.body_params
    assert prefill_flops("mistral-7b", 4196) - prefill_flops("mistral-7b", 4096) == 100 * (per_token + per_key * 4096)


def test_a_window_must_be_a_positive_count():
    s = get_shape("mistral-7b")
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0.*None for full attention"):
        dataclasses.replace(s, sliding_window=0)
    with pytest.raises(TypeError, match="sliding_window"):
        dataclasses.replace(s, sliding_window=4096.5)
    assert dataclasses.replace(s, sliding_window=None).sliding_window is None
    assert s.with_kv_heads(1).sliding_window == 4096             # a GQA/MQA variant keeps its window


def test_the_course_gpt_has_no_window():
    # GPTConfig.preset copies the shape, not the window: the course's attention sees every position.
    assert kv_cache_bytes(GPTConfig.preset("mistral-7b"), 32768) == 32768 * kv_bytes_per_token("mistral-7b")


def test_bad_arguments():
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes("tiny", -1)
    with pytest.raises(ValueError, match="batch_size"):
        kv_cache_bytes("tiny", 10, 0)
    with pytest.raises(TypeError, match="seq_len"):
        kv_cache_bytes("tiny", 10.5)
    with pytest.raises(ValueError, match="unknown dtype"):
        kv_cache_bytes("tiny", 10, 1, "fp4")
    with pytest.raises(ValueError, match="unknown preset"):
        kv_cache_bytes("gpt-5", 10)
    with pytest.raises(ValueError, match="batch_size"):
        tokens_where_cache_exceeds_weights("tiny", 0)


# --- the static cache -----------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_buffer_bytes_match_the_calculator(preset, dtype):
    # device="meta" allocates nothing, so even llama-3-70b at full context is free to build.
    s = get_shape(preset)
    full = dataclasses.replace(s, sliding_window=None)    # KVCache keeps every position: no rolling buffer
    for max_len, batch in [(1, 1), (s.context_length, 1), (min(100, s.context_length), 4)]:
        cache = KVCache(s, batch, max_len, device="meta", dtype=dtype)
        assert cache.nbytes == kv_cache_bytes(full, max_len, batch, dtype)
        assert cache.nbytes == kv_bytes_per_token(s, dtype) * max_len * batch
        assert cache.k.shape == (s.n_layer, batch, s.n_kv_head, max_len, s.head_dim)


def test_real_buffer_bytes_match_for_a_small_model():
    cfg = GPTConfig(vocab_size=100, context_length=64, n_layer=3, n_head=4, n_embd=32, n_kv_head=2)
    cache = KVCache(cfg, 2, 50, dtype=torch.float16)
    assert cache.nbytes == kv_cache_bytes(cfg, 50, 2, torch.float16) == 2 * 3 * 2 * 8 * 2 * 50 * 2


def small_cache(max_len=8, batch=2):
    cfg = GPTConfig(vocab_size=100, context_length=16, n_layer=2, n_head=4, n_embd=16, n_kv_head=2)
    return KVCache(cfg, batch, max_len), cfg


def kv(batch, t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, t, 4, generator=g), torch.randn(batch, 2, t, 4, generator=g)


def test_update_advance_reset():
    cache, _ = small_cache()
    k0, v0 = kv(2, 3, 0)
    k, v = cache.update(0, k0, v0)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    cache.update(1, k0 * 2, v0 * 2)
    cache.advance(3)
    assert cache.pos == 3
    k1, v1 = kv(2, 1, 1)
    k, v = cache.update(0, k1, v1)          # appends after the 3 stored positions
    assert k.shape == (2, 2, 4, 4)
    assert torch.equal(k[:, :, :3], k0) and torch.equal(k[:, :, 3:], k1) and torch.equal(v[:, :, 3:], v1)
    assert torch.equal(cache.k[1, :, :, :3], k0 * 2)   # each layer owns its own slot
    cache.advance(1)
    cache.reset()
    assert cache.pos == 0
    k, _ = cache.update(0, k1, v1)          # after reset, writing starts from position 0 again
    assert k.shape[2] == 1 and torch.equal(cache.k[0, :, :, 0:1], k1)


def test_clone_is_independent():
    cache, _ = small_cache()
    k0, v0 = kv(2, 3, 0)
    cache.update(0, k0, v0)
    cache.advance(3)
    copy = cache.clone()
    # Only written entries are defined (layer 0, positions < 3): torch.empty may hold NaN elsewhere.
    assert copy.pos == 3 and torch.equal(copy.k[0, :, :, :3], cache.k[0, :, :, :3])
    copy.k.zero_()
    copy.advance(1)
    assert torch.equal(cache.k[0, :, :, :3], k0) and cache.pos == 3


def test_overflow_names_the_size_and_the_fix():
    cache, _ = small_cache(max_len=4)
    cache.update(0, *kv(2, 3, 0))
    cache.advance(3)
    with pytest.raises(ValueError, match=r"cache holds 4 positions; 3 used, 2 more do not fit.*max_len.*reset"):
        cache.update(0, *kv(2, 2, 1))
    with pytest.raises(ValueError, match="holds 4 positions"):
        cache.check_fits(2, 2)
    with pytest.raises(ValueError, match="holds 4 positions"):
        cache.advance(2)
    assert cache.pos == 3


def test_batch_mismatch_in_update():
    cache, _ = small_cache(batch=2)
    with pytest.raises(ValueError, match="batch_size=2"):
        cache.update(0, *kv(1, 1, 0))


def test_bad_construction():
    _, cfg = small_cache()
    with pytest.raises(ValueError, match="max_len must be <= 16, got 17; it exceeds the context length 16"):
        KVCache(cfg, 1, 17)
    with pytest.raises(ValueError, match="max_len"):
        KVCache(cfg, 1, 0)
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(cfg, 0, 4)
    assert KVCache(cfg).max_len == 16 and "KVCache(n_layer=2" in repr(KVCache(cfg))


def test_numpy_integers_are_accepted():
    np = pytest.importorskip("numpy")
    assert kv_cache_bytes("tiny", np.int64(5), np.int32(2)) == kv_cache_bytes("tiny", 5, 2)
