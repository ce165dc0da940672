"""FLOP and byte counts per phase, checked against numbers worked out by hand and against torch's FLOP counter."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labutils.perf import roofline as rl
from labutils.decode.kvcache import KVCache
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.presets import ModelShape, get_shape

# A toy shape small enough to count by hand: 1,000 params, 2 layers, n_embd 8, 1 KV head of dim 4 (GQA).
# Tables: 10 x 8 token rows + 16 x 8 position rows = 208; the tied output layer is the 80-weight token table;
# so the blocks hold 1000 - 208 = 792 and one token looks up 16 embedding elements.
TOY = ModelShape("toy", n_layer=2, n_head=2, n_kv_head=1, n_embd=8, vocab_size=10, context_length=16,
                 n_inner=32, gated_mlp=False, tie_weights=True, n_params=1000, source="test")


def test_counts_split_blocks_output_layer_and_embedding_rows():
    c = rl.counts(TOY)
    assert (c.n_params, c.body_params, c.head_params, c.row_params) == (1000, 792, 80, 16)
    untied = rl.counts(ModelShape("u", 2, 2, 2, 8, 10, 16, 32, True, False, 1000, "test", learned_positions=False))
    assert (untied.body_params, untied.head_params, untied.row_params) == (1000 - 80 - 80, 80, 8)


def test_flops_per_token_counts_matmul_weights_not_the_lookup():
    assert rl.flops_per_token(TOY) == 2 * (792 + 80)                       # 1744: no FLOPs for the lookup
    assert rl.flops_per_token(TOY, pos=10) == 1744 + 4 * 2 * 10 * 8         # 2384


def test_prefill_flops_applies_the_output_layer_to_the_last_position_only():
    # 3 tokens through 792 block weights, the 80-weight output layer once, 6 keys of causal attention; batch 2.
    assert rl.prefill_flops(TOY, 3, batch=2) == 2 * (2 * 792 * 3 + 2 * 80 + 4 * 2 * 8 * 6)   # 10592


def test_decode_flops_is_one_token_per_sequence():
    assert rl.decode_flops(TOY, 10, batch=3) == 3 * 2384


def test_decode_bytes_is_weights_read_plus_rows_plus_kv_cache():
    # KV per position: 2 (K,V) x 2 layers x 1 kv head x 4 dims x 2 bytes = 32 bytes.
    assert rl.decode_bytes(TOY, 10, 1, torch.float16) == (792 + 80 + 16) * 2 + 320
    # fp32, batch 3: weights are read once for the batch; rows and cache are per sequence.
    assert rl.decode_bytes(TOY, 10, 3, torch.float32) == (792 + 80 + 3 * 16) * 4 + 64 * 10 * 3
    assert rl.decode_bytes(TOY, 0, 1, "bf16") == 1776


def test_prefill_bytes_reads_weights_once_and_writes_the_cache():
    assert rl.prefill_bytes(TOY, 5, 2, torch.float16) == (792 + 80 + 10 * 16) * 2 + 32 * 5 * 2


def test_weight_bytes_is_everything_stored():
    assert rl.weight_bytes(TOY) == 2000 and rl.weight_bytes(TOY, "fp32") == 4000
    assert rl.weight_bytes("llama-2-7b") == 6_738_415_616 * 2            # the published count, not a formula


def test_a_model_counts_its_real_tensors_tied_once():
    cfg = GPTConfig(vocab_size=50, context_length=24, n_layer=2, n_head=4, n_embd=32)
    model = GPT(cfg)
    assert rl.weight_bytes(model) == 4 * cfg.num_params() == rl.weight_bytes(cfg, "fp32")
    assert rl.decode_bytes(model, 7, 2) == rl.decode_bytes(cfg, 7, 2, "fp32")
    half = GPT(cfg).to(torch.bfloat16)
    assert rl.weight_bytes(half) == rl.weight_bytes(cfg, "bf16")
    # A buffer stored at another size (an int8 weight and its scales, say) counts at that size.
    half.blocks[0].mlp.register_buffer("packed", torch.zeros(100, dtype=torch.int8))
    assert rl.weight_bytes(half) == rl.weight_bytes(cfg, "bf16") + 100
    assert rl.decode_bytes(half, 0) == rl.decode_bytes(cfg, 0, 1, "bf16") + 100
    with pytest.raises(ValueError, match="pass dtype only with a config"):
        rl.weight_bytes(model, "fp16")


@pytest.mark.parametrize("modern", [False, True])
def test_block_counts_match_the_model_parameters(modern):
    extra = dict(rope=True, norm="rmsnorm", gated_mlp=True, bias=False) if modern else {}
    cfg = GPTConfig(vocab_size=300, context_length=64, n_layer=3, n_head=4, n_embd=64, n_kv_head=2, **extra)
    model = GPT(cfg)
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_f.")))
    assert rl.counts(cfg).body_params == rl.counts(model).body_params == blocks
    assert rl.counts(cfg).head_params == cfg.vocab_size * cfg.n_embd
    # Bytes one decode step reads: the blocks, the output layer, and one row of each table it has.
    rows = cfg.n_embd * (1 if modern else 2)
    assert rl.step_weight_bytes(model) == 4 * (blocks + cfg.vocab_size * cfg.n_embd + rows)


@pytest.mark.parametrize("prompt_len", [1, 16, 40])
def test_prefill_flops_agree_with_torchs_flop_counter(prompt_len):
    # Independent count: torch's FLOP counter over a real prefill (naive attention: it counts the full score
    # matrix, so we compare the matmul part and check attention separately). Biases and norms ride along in
    # body_params, hence the 2% tolerance at this width.
    cfg = GPTConfig(vocab_size=512, context_length=64, n_layer=2, n_head=4, n_embd=128)
    model = GPT(cfg).eval()
    ids = torch.zeros(1, prompt_len, dtype=torch.long)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(ids, KVCache(cfg, 1, prompt_len), last_only=True)
    by_op = {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}
    linear = sum(n for op, n in by_op.items() if "mm" in op and "bmm" not in op)
    attention = sum(n for op, n in by_op.items() if "attention" in op or "bmm" in op)
    predicted = rl.prefill_flops(cfg, prompt_len) - 4 * cfg.n_layer * cfg.n_embd * prompt_len * (prompt_len + 1) // 2
    assert linear == pytest.approx(predicted, rel=0.02)
    # Full-logits prefill would have cost prompt_len output layers; ours costs one.
    assert linear < predicted + 2 * cfg.vocab_size * cfg.n_embd
    assert attention <= 4 * cfg.n_layer * cfg.n_embd * prompt_len * prompt_len


def test_gpt2_small_counts():
    # GPTConfig counts the published 124,439,808 parameters, so a preset name and the shape agree.
    assert GPTConfig.preset("gpt2-small").num_params() == get_shape("gpt2-small").n_params == 124_439_808
    assert rl.weight_bytes("gpt2-small", torch.float16) == 248_879_616
    assert rl.decode_bytes(get_shape("gpt2-small"), 7) == rl.decode_bytes("gpt2-small", 7)
    assert rl.decode_bytes(GPTConfig.preset("gpt2-small"), 7) == rl.decode_bytes("gpt2-small", 7)


def test_decode_intensity_is_one_flop_per_byte_in_fp16_and_prefill_far_higher():
    cfg = GPTConfig.preset("gpt2-small")
    decode = rl.arithmetic_intensity(rl.decode_flops(cfg, 1000), rl.decode_bytes(cfg, 1000, 1, torch.float16))
    # 2 FLOPs per 2-byte weight, and 4 FLOPs per 4 bytes of K and V: just under 1 (the embedding rows read no math).
    assert 0.99 < decode < 1.0
    prefill = rl.arithmetic_intensity(rl.prefill_flops(cfg, 1000), rl.prefill_bytes(cfg, 1000, 1, torch.float16))
    assert 500 < prefill < 1000
    # Batching decode shares the weight reads: intensity grows with batch (until the KV cache dominates).
    batched = rl.arithmetic_intensity(rl.decode_flops(cfg, 10, 8), rl.decode_bytes(cfg, 10, 8, torch.float16))
    assert batched > 7


def test_one_gemm_with_its_activations_is_far_below_prompt_length_intensity():
    # gpt2-small's 768 x 768 attention projection at T=1,000 in fp16: weight 1.18 MB, activations 3.07 MB.
    ai = rl.arithmetic_intensity(rl.linear_flops(768, 768, 1000), rl.linear_bytes(768, 768, 1000, "fp16"))
    assert ai == pytest.approx(2 * 768 * 768 * 1000 / ((768 * 768 + 1000 * 1536) * 2))
    assert 270 < ai < 285


def test_roofline_is_the_lower_of_the_two_roofs():
    assert rl.attainable_flops(1.0, 100e12, 2e12) == 2e12
    assert rl.attainable_flops(1000.0, 100e12, 2e12) == 100e12


def test_floor_times():
    assert rl.decode_floor_s(TOY, 10, 1, torch.float16, bandwidth_Bps=2096.0) == pytest.approx(1.0)
    assert rl.prefill_floor_s(TOY, 3, 2, peak_flops=10592.0) == pytest.approx(1.0)


def test_mbu_and_mfu_follow_the_design_definitions():
    # MBU = (weight + KV bytes per step) / TPOT / peak bandwidth = 2096 / 2.096e-6 / 2e9.
    assert rl.mbu(TOY, 10, 1, torch.float16, tpot_s=2.096e-6, bandwidth_Bps=2e9) == pytest.approx(0.5)
    # MFU = FLOPs / seconds / peak FLOP/s, with the same FLOPs as the floor: a pass at the floor is 100%.
    flops = rl.prefill_flops(TOY, 3, 2)
    assert rl.mfu(flops, 2.0, flops) == pytest.approx(0.5)
    assert rl.mfu(flops, rl.prefill_floor_s(TOY, 3, 2, peak_flops=1e6), 1e6) == pytest.approx(1.0)


def test_mqa_variant_loses_its_kv_projection_weights():
    llama = get_shape("llama-2-7b")
    mqa = llama.with_kv_heads(1)
    assert llama.n_params - mqa.n_params == 2 * 32 * 4096 * 128 * 31
    assert rl.kv_bytes_per_token(mqa) * 32 == rl.kv_bytes_per_token(llama)
    cfg = GPTConfig(vocab_size=50, context_length=24, n_layer=2, n_head=4, n_embd=32)
    shape = ModelShape("c", 2, 4, 4, 32, 50, 24, 128, False, True, cfg.num_params(), "test")
    assert shape.with_kv_heads(1).n_params == GPTConfig(**{**cfg.__dict__, "n_kv_head": 1}).num_params()
    with pytest.raises(ValueError, match=r"n_kv_head must divide n_head=32, got 3; choose one of \[1, 2, 4, 8, 16, 32\]"):
        llama.with_kv_heads(3)


@pytest.mark.parametrize("call, message", [
    (lambda: rl.decode_bytes(TOY, -1), "pos must be >= 0"),
    (lambda: rl.prefill_flops(TOY, 0), "prompt_len must be >= 1"),
    (lambda: rl.decode_bytes(TOY, 1, 0), "batch must be >= 1"),
    (lambda: rl.decode_bytes(TOY, 1.5), "pos must be an int"),
    (lambda: rl.mbu(TOY, 1, 1, "fp16", 0.0, 1e9), "tpot_s must be a finite number > 0"),
    (lambda: rl.mbu(TOY, 1, 1, "fp16", math.nan, 1e9), "tpot_s must be a finite number > 0"),
    (lambda: rl.mfu(10.0, 1.0, 0), "peak_flops must be a finite number > 0"),
    (lambda: rl.arithmetic_intensity(1.0, 0), "nbytes must be a finite number > 0"),
    (lambda: rl.decode_bytes(TOY, 1, 1, "fp12"), "unknown dtype"),
    (lambda: rl.flops_per_token(42), r"x \(the model\) must be a GPT model.*got int 42"),
    (lambda: rl.flops_per_token("gpt5"), "unknown preset"),
    (lambda: rl.counts(ModelShape("x", 1, 1, 1, 8, 100, 16, 32, False, True, 10, "test")), "cannot hold"),
])
def test_bad_input_names_the_problem(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
