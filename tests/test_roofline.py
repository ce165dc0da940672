"""FLOP and byte counts per phase, checked against numbers worked out by hand."""
import math

import pytest
import torch

from labutils import roofline as rl
from labutils.model import GPTConfig
from labutils.presets import ModelShape, get_shape

# A toy shape small enough to count by hand: 1,000 params, 2 layers, n_embd 8, 1 KV head of dim 4 (GQA).
TOY = ModelShape("toy", n_layer=2, n_head=2, n_kv_head=1, n_embd=8, vocab_size=100, context_length=64,
                 n_inner=32, gated_mlp=False, tie_weights=True, n_params=1000, source="test")


def test_flops_per_token_is_two_per_param_plus_attention():
    assert rl.flops_per_token(TOY) == 2000
    assert rl.flops_per_token(TOY, pos=10) == 2000 + 4 * 2 * 10 * 8      # 2640


def test_prefill_flops_sums_the_causal_attention_term():
    # 3 tokens attend to 1, 2, 3 keys: 6 keys in all; batch 2 doubles everything.
    assert rl.prefill_flops(TOY, 3, batch=2) == 2 * (2000 * 3 + 4 * 2 * 8 * 6)   # 12768
    assert rl.prefill_flops(TOY, 3) == sum(rl.flops_per_token(TOY, t) for t in (1, 2, 3))


def test_decode_flops_is_one_token_per_sequence():
    assert rl.decode_flops(TOY, 10, batch=3) == 3 * 2640


def test_decode_bytes_is_weights_plus_kv_cache_read():
    # KV per position: 2 (K,V) x 2 layers x 1 kv head x 4 dims x 2 bytes = 32 bytes.
    assert rl.decode_bytes(TOY, 10, 1, torch.float16) == 2000 + 320
    # fp32, batch 3: weights are read once for the batch, every sequence has its own cache.
    assert rl.decode_bytes(TOY, 10, 3, torch.float32) == 4000 + 64 * 10 * 3
    assert rl.decode_bytes(TOY, 0, 1, "bf16") == 2000


def test_prefill_bytes_reads_weights_once_and_writes_the_cache():
    assert rl.prefill_bytes(TOY, 5, 2, torch.float16) == 2000 + 32 * 5 * 2


def test_gpt2_small_counts():
    # GPTConfig counts the published 124,439,808 parameters, so a preset name and the shape agree.
    assert GPTConfig.preset("gpt2-small").num_params() == get_shape("gpt2-small").n_params == 124_439_808
    assert rl.decode_bytes("gpt2-small", 0, 1, torch.float16) == 248_879_616
    assert rl.decode_bytes(get_shape("gpt2-small"), 7) == rl.decode_bytes("gpt2-small", 7)


def test_decode_intensity_is_one_flop_per_byte_in_fp16_and_prefill_is_prompt_len_times_higher():
    cfg = GPTConfig.preset("gpt2-small")
    decode = rl.arithmetic_intensity(rl.decode_flops(cfg, 1000), rl.decode_bytes(cfg, 1000, 1, torch.float16))
    # 2 FLOPs per 2-byte weight, and 4 FLOPs per 4 bytes of K and V (multi-head attention): exactly 1.
    assert decode == pytest.approx(1.0)
    prefill = rl.arithmetic_intensity(rl.prefill_flops(cfg, 1000), rl.prefill_bytes(cfg, 1000, 1, torch.float16))
    assert 0.9 * 1000 < prefill < 1.1 * 1000
    # Batching decode shares the weight reads: intensity grows with batch (until the KV cache dominates).
    batched = rl.arithmetic_intensity(rl.decode_flops(cfg, 10, 8), rl.decode_bytes(cfg, 10, 8, torch.float16))
    assert batched > 7


def test_floor_times():
    assert rl.decode_floor_s(TOY, 10, 1, torch.float16, bandwidth_Bps=2320.0) == pytest.approx(1.0)
    assert rl.prefill_floor_s(TOY, 3, 2, peak_flops=12768.0) == pytest.approx(1.0)


def test_mbu_and_mfu_follow_the_design_definitions():
    # MBU = (weight + KV bytes per step) / TPOT / peak bandwidth = 2320 / 2.32e-6 / 2e9.
    assert rl.mbu(TOY, 10, 1, torch.float16, tpot_s=2.32e-6, bandwidth_Bps=2e9) == pytest.approx(0.5)
    # MFU = 2 x params x tokens / seconds / peak FLOP/s = 2 x 1000 x 500 / 2 / 1e6.
    assert rl.mfu(TOY, tokens=500, seconds=2.0, flops=1e6) == pytest.approx(0.5)
    assert rl.mfu(TOY, 500, 2.0, 1e6) == pytest.approx(0.5)      # positional, as in DESIGN order


@pytest.mark.parametrize("call, message", [
    (lambda: rl.decode_bytes(TOY, -1), "pos must be >= 0"),
    (lambda: rl.prefill_flops(TOY, 0), "prompt_len must be >= 1"),
    (lambda: rl.decode_bytes(TOY, 1, 0), "batch must be >= 1"),
    (lambda: rl.decode_bytes(TOY, 1.5), "pos must be an int"),
    (lambda: rl.mbu(TOY, 1, 1, "fp16", 0.0, 1e9), "tpot_s must be > 0"),
    (lambda: rl.mbu(TOY, 1, 1, "fp16", math.nan, 1e9), "tpot_s must be > 0"),
    (lambda: rl.mfu(TOY, 10, 1.0, 0), "flops must be > 0"),
    (lambda: rl.arithmetic_intensity(1.0, 0), "nbytes must be > 0"),
    (lambda: rl.decode_bytes(TOY, 1, 1, "fp12"), "unknown cache dtype"),
    (lambda: rl.flops_per_token(42), "expected a GPTConfig"),
    (lambda: rl.flops_per_token("gpt5"), "unknown preset"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
