"""Weight-only int8: round-trip bounds, Int8Linear vs float, exact byte counts, the trained model, bad input."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labutils.decode import quant
from labutils.perf import roofline
from labutils.decode.loop import generate
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.checkpoints import load_pretrained
from labutils.decode.quant import Int8Embedding, Int8Linear, dequantize, int8_path, quantize_, quantize_per_channel

SMALL = GPTConfig(vocab_size=96, context_length=32, n_layer=2, n_head=2, n_embd=32)


def small_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**SMALL.__dict__, **overrides})).eval()


def rows_of_mixed_scale(n_out=24, n_in=64, seed=0) -> torch.Tensor:
    """Rows whose magnitudes span 1e-4..10, one all-zero row and one outlier: per-channel scales must cope."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * torch.logspace(-4, 1, n_out)[:, None]
    w[3] = 0.0
    w[5, 7] = 50.0
    return w


# ---------------------------------------------------------------- quantize / dequantize

@pytest.mark.parametrize("scales_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_at_most_half_a_step_per_channel(scales_dtype):
    w = rows_of_mixed_scale()
    q, scales = quantize_per_channel(w, scales_dtype)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scales.dtype == scales_dtype and scales.shape == (w.shape[0],)
    assert int(q.min()) >= -127 and int(q.max()) <= 127          # symmetric: -128 is never used
    assert torch.all(w.abs() <= 127 * scales.float()[:, None])      # the scale is rounded up: nothing clips
    err = (w - dequantize(q, scales)).abs().amax(dim=1)
    step = scales.float()
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-30)
    assert err.max() > step.max() / 4                  # the bound is nearly reached: it is not vacuous
    # Each row whose scale the dtype can hold uses (almost) the whole int8 range: no wasted scale.
    # (A row below 127 x the smallest normal scale, fp16's 6e-5, keeps that smallest scale instead.)
    fits = w.abs().amax(dim=1) / 127 >= torch.finfo(scales_dtype).tiny
    assert fits.sum() >= w.shape[0] - 8
    assert torch.all(q[fits].abs().amax(dim=1) >= 126)
    assert torch.all(q[3] == 0) and math.isfinite(float(scales[3])) and float(scales[3]) > 0


def test_quantize_per_channel_rejects_non_matrices():
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize_per_channel(torch.randn(4))
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize_per_channel(torch.ones(2, 2, dtype=torch.int64))


# ---------------------------------------------------------------- Int8Linear

@pytest.mark.parametrize("rows", [1, 3, 40])          # decode rows, and a prefill's: the same kernel for both
@pytest.mark.parametrize("n_in", [64, 24])            # 24 is not a multiple the CPU int8 kernel can walk
def test_int8_linear_matches_its_own_dequantized_weight_and_the_float_layer(rows, n_in):
    torch.manual_seed(1)
    lin = nn.Linear(n_in, 48)
    int8 = Int8Linear.from_linear(lin)
    x = torch.randn(2, rows, n_in)
    y = int8(x)
    assert y.shape == (2, rows, 48) and y.dtype == torch.float32 and torch.isfinite(y).all()
    exact = F.linear(x, dequantize(int8.weight, int8.scales), lin.bias)
    # The CPU kernels compute in bf16 (8 bits of mantissa): about 1% of the output's scale.
    scale = exact.abs().max()
    assert (y - exact).abs().max() <= 0.02 * scale
    with torch.no_grad():
        float_y = lin(x)
    assert (y - float_y).abs().max() <= 0.03 * float_y.abs().max()
    assert not torch.equal(y, float_y)                          # it really is another computation


def test_path_selection():
    assert int8_path("cpu", 768) == "int8pack_bf16"
    assert int8_path("cpu", 24) == "dequant_bf16"             # the int8 kernel would read past each row
    assert int8_path("cuda", 768) == "dequant_compiled"       # fused by torch.compile where it runs
    assert int8_path("mps", 768) == "dequant" and "mps" in quant.FALLBACK
    assert quant.scale_dtype("cpu", torch.float32) == torch.bfloat16
    assert quant.scale_dtype("cuda", torch.float16) == torch.float16


def test_int8_linear_runs_the_kernel_int8_path_picks(monkeypatch):
    calls = []
    for name, kernel in list(quant.KERNELS.items()):
        monkeypatch.setitem(quant.KERNELS, name,
                            lambda *args, _k=kernel, _n=name: calls.append(_n) or _k(*args))
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 32))
    layer(torch.randn(1, 1, 64))
    layer(torch.randn(1, 30, 64))
    assert calls == ["int8pack_bf16", "int8pack_bf16"], "one kernel per layer, whatever the rows"
    assert "kernel=int8pack_bf16" in repr(layer)


# ---------------------------------------------------------------- quantize_ on a GPT

def test_quantize_swaps_every_linear_and_ties_the_embedding_to_the_int8_table():
    model = small_gpt()
    float_linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert quantize_(model) is model
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == float_linears
    assert isinstance(model.tok_emb, Int8Embedding) and model.tok_emb.table is model.lm_head
    # The lookup reads the int8 rows of the output layer's table.
    ids = torch.tensor([[0, 5, 95]])
    expected = dequantize(model.lm_head.weight, model.lm_head.scales)[ids]
    torch.testing.assert_close(model.tok_emb(ids), expected, rtol=0, atol=0)
    keys = model.state_dict().keys()
    assert "lm_head.weight" in keys and not any(k.startswith("tok_emb") for k in keys)   # stored once
    assert model.state_dict()["lm_head.weight"].dtype == torch.int8


def _linear_weights(model):
    """Unique float weights of the model's Linear layers (a tied one once)."""
    seen = {}
    for m in model.modules():
        if isinstance(m, nn.Linear):
            seen[id(m.weight)] = m.weight
    return list(seen.values())


@pytest.mark.parametrize("tie", [True, False])
def test_weight_bytes_shrink_by_exactly_the_int8_saving(tie):
    model = small_gpt(tie_weights=tie)
    before = roofline.weight_bytes(model)
    assert before == model.num_params() * 4
    weights = _linear_weights(model)
    # Each n_out x n_in weight: 4 bytes -> 1 byte per element, plus one bf16 scale per output row.
    saving = sum(w.numel() * (4 - 1) - w.shape[0] * 2 for w in weights)
    quantize_(model)
    assert roofline.weight_bytes(model) == before - saving
    if not tie:
        assert isinstance(model.tok_emb, nn.Embedding)          # an untied embedding stays float


def test_quantized_model_generates_like_the_float_model():
    model = small_gpt()
    int8 = quantize_(copy.deepcopy(model))
    ids = torch.randint(0, SMALL.vocab_size, (3, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, got = model(ids), int8(ids)
    assert (got - ref).norm() / ref.norm() < 0.05
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
    out = generate(int8, ids, 6)
    assert out.tokens.shape == (3, 6)
    # The KV cache follows the activations' dtype, not int8.
    assert next(int8.parameters()).dtype == torch.float32


def test_bf16_model_is_quantized_and_keeps_its_dtype():
    model = small_gpt().to(torch.bfloat16)
    quantize_(model)
    ids = torch.randint(0, SMALL.vocab_size, (1, 5))
    assert model(ids).dtype == torch.bfloat16


# ---------------------------------------------------------------- bad input

def test_quantizing_twice_is_refused():
    model = quantize_(small_gpt())
    with pytest.raises(ValueError, match="already holds int8 layers.*copy.deepcopy"):
        quantize_(model)


def test_a_model_without_linear_layers_is_refused():
    with pytest.raises(ValueError, match="Sequential has no nn.Linear"):
        quantize_(nn.Sequential(nn.ReLU(), nn.LayerNorm(4)))
    with pytest.raises(TypeError, match="nn.Module"):
        quantize_("gpt2")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_unsupported_dtype_names_the_supported_ones_and_changes_nothing(dtype):
    model = small_gpt()
    model.blocks[1].mlp.fc.to(dtype)         # one bad layer among good ones
    with pytest.raises(ValueError, match=r"on cpu serve models in \['float32', 'bfloat16'\]"):
        quantize_(model)
    assert not quant.is_quantized(model)     # checked before any layer was swapped


def test_unsupported_device_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"run on \['cpu', 'cuda', 'mps'\], not 'xpu'"):
        quant.check_supported("xpu", torch.float32)
    with pytest.raises(ValueError, match="not 'xpu'"):
        int8_path("xpu", 64)
    quant.check_supported("mps", torch.float16)              # mps: supported, on the slow path, said so


def test_mps_falls_back_with_one_line_and_runs_the_dequantize_matmul(monkeypatch, capsys):
    # No Apple GPU here: each layer picks its kernel as it would on "mps", and quantize_ reports that device's line.
    real = quant.int8_path
    monkeypatch.setattr(quant, "int8_path", lambda device, n_in: real("mps", n_in))
    monkeypatch.setitem(quant.FALLBACK, "cpu", quant.FALLBACK["mps"])
    model = quantize_(small_gpt())
    assert capsys.readouterr().out.count("no int8 matmul kernel") == 1
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert {m.kernel for m in layers} == {"dequant"}
    x = torch.randn(2, layers[0].in_features)
    torch.testing.assert_close(layers[0](x), F.linear(x, dequantize(layers[0].weight, layers[0].scales),
                                                       layers[0].bias), rtol=1e-4, atol=1e-4)


def test_fp16_dequantize_matmul_scales_before_it_sums():
    # 64 products of 127 x 200 would overflow fp16's 65,504 if the scale came after the sum.
    q = torch.full((4, 64), 127, dtype=torch.int8)
    scales = torch.full((4,), 0.01, dtype=torch.float16)
    x = torch.full((1, 64), 200.0, dtype=torch.float16)
    y = quant.KERNELS["dequant"](x, q, scales)
    assert torch.isfinite(y).all() and y.dtype == torch.float16
    assert y[0, 0].item() == pytest.approx(64 * 200 * 1.27, rel=0.01)


# ---------------------------------------------------------------- measurements

def test_int8_paths_times_every_path_side_by_side():
    t = quant.int8_paths(n_out=64, n_in=64, batch=1, device="cpu", rounds=1, repeats=2)
    assert set(t) == {"fp32", "bf16", *quant.KERNELS} - {"dequant_compiled"}     # CUDA's path, not timed on a CPU
    assert all(math.isfinite(s) and s > 0 for s in t.values())
    odd = quant.int8_paths(n_out=8, n_in=24, batch=2, device="cpu", rounds=1, repeats=1)
    assert "int8pack_bf16" not in odd and "dequant_bf16" in odd     # never run the kernel out of bounds
    with pytest.raises(ValueError, match="batch must be >= 1"):
        quant.int8_paths(batch=0)


@pytest.fixture(scope="module")
def heldout():
    from labutils.text.dataset import course_tokens
    return course_tokens()[1]


def test_compare_on_the_trained_tiny_model(heldout):
    model, _ = load_pretrained()
    before = copy.deepcopy(model.state_dict())
    row = quant.compare(model, heldout[:4 * 1024 + 1], new_tokens=24, n_prompts=6)
    # Bytes: exactly the int8 saving, and about a quarter of fp32 (scales and float norms/biases remain).
    saving = sum(w.numel() * 3 - w.shape[0] * 2 for w in _linear_weights(model))
    assert row["weight_bytes"] == roofline.weight_bytes(model) == model.num_params() * 4
    assert row["int8_weight_bytes"] == row["weight_bytes"] - saving
    assert 0.25 < row["int8_weight_bytes"] / row["weight_bytes"] < 0.3
    # Accuracy: small logit error, mostly the same greedy tokens, held-out loss within 0.01 nats of fp32.
    assert 0 < row["logit_rel_err"] < 0.02 and row["logit_max_abs_err"] > 0
    assert row["greedy_agreement"] >= 0.75 and row["greedy_steps"] == 24
    assert 0 < row["greedy_prefix"] <= 24
    assert abs(row["int8_heldout_loss"] - row["heldout_loss"]) < 0.01
    # The float model is left as it was.
    assert not quant.is_quantized(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="already int8"):
        quant.compare(quantize_(model), heldout[:4097])


# ---------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_path_matches_float_and_generates():
    model = small_gpt().to("cuda", torch.bfloat16)
    int8 = quantize_(copy.deepcopy(model))
    assert int8.lm_head.weight.device.type == "cuda" and int8.lm_head.scales.dtype == torch.bfloat16
    ids = torch.randint(0, SMALL.vocab_size, (2, 8), device="cuda")
    with torch.no_grad():
        ref, got = model(ids).float(), int8(ids).float()
    assert (got - ref).norm() / ref.norm() < 0.05
    assert generate(int8, ids, 4).tokens.shape == (2, 4)
    t = quant.int8_paths(n_out=256, n_in=256, device="cuda", rounds=1, repeats=2)
    assert {"fp32", "bf16", "dequant"} <= set(t)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_under_the_compiled_decode_step_keeps_batched_equal_to_solo():
    # Issue 27 part 3: int8 under one compiled, graphed decode step (gpt-fast's way), and a batch's rows still
    # give each request's own tokens.
    from labutils.decode.fastgen import FastDecoder
    int8 = quantize_(small_gpt().to("cuda", torch.bfloat16))
    ids = torch.randint(0, SMALL.vocab_size, (4, 8), generator=torch.Generator().manual_seed(0)).to("cuda")
    batched = FastDecoder(int8, 4, 24, mode="compile")
    assert batched.mode == "compile" and batched.fallback is None
    together = batched.generate(ids, 12).tokens
    solo = FastDecoder(int8, 1, 24, mode="compile")
    assert all(torch.equal(solo.generate(ids[i:i + 1], 12).tokens[0], together[i]) for i in range(4))


def test_a_layer_inside_a_compiled_step_runs_the_plain_dequantize_matmul(monkeypatch):
    # Compiled on its own, each CUDA layer would be a graph of its own inside the step's graph; under the whole
    # step's compile it must be the plain form inductor fuses. Checked on the CPU with the kernels recorded.
    layer = Int8Linear.from_linear(nn.Linear(32, 16, bias=False))
    layer.kernel = "dequant_compiled"                 # what int8_path gives a layer on CUDA
    ran = []
    for name in ("dequant", "dequant_compiled"):
        monkeypatch.setitem(quant.KERNELS, name, lambda x, q, s, b, name=name: ran.append(name) or x[:, :16])
    x = torch.randn(3, 32)
    layer(x)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    layer(x)
    assert ran == ["dequant_compiled", "dequant"]


def test_the_tied_lookup_follows_the_model_to_another_dtype():
    model = quantize_(small_gpt())
    ids = torch.randint(0, SMALL.vocab_size, (1, 5))
    assert model.tok_emb(ids).dtype == torch.float32
    before, float_bytes = roofline.weight_bytes(model), sum(p.numel() * 4 for p in model.parameters())
    model.to(torch.bfloat16)
    assert model.tok_emb(ids).dtype == torch.bfloat16 and model(ids).dtype == torch.bfloat16
    # Only the float tensors (norms, biases, positions) halve; the int8 table and bf16 scales stay.
    assert roofline.weight_bytes(model) == before - float_bytes // 2


def test_int8_batched_and_speculative_tokens_equal_solo_generate():
    # A kernel chosen per call by row count gave a batch of 16 (a GEMM) other rounding than one row (the GEMV):
    # 4 of 16 engine requests, and 2 of 8 speculative prompts, differed from their solo run on the int8 tiny model.
    from labutils.decode.loop import generate
    from labutils.model.checkpoints import load_pretrained
    from labutils.serving.engine import Engine
    from labutils.decode.speculative import speculative_generate
    model, enc = load_pretrained()
    model = quantize_(model)
    from labutils.text.corpus import text_samples
    words = " ".join(text_samples().values()).split()
    prompts = [enc.encode(" ".join(words[i * 5:i * 5 + 4])) for i in range(16)]
    engine = Engine(model, max_batch_size=16)
    for p in prompts:
        engine.submit(p, 12)
    batched = [r.tokens for r in engine.run()]
    solo = [generate(model, p, 12).tokens[0].tolist() for p in prompts]
    assert batched == solo, f"{sum(a != b for a, b in zip(batched, solo))} of 16 differ"
    for k in (4, 7, 8, 12):
        for p, want in zip(prompts[:8], solo[:8]):
            assert speculative_generate(model, model, p, 12, k=k).tokens[0].tolist() == want, f"k={k}"
