"""GPTConfig and GPT: shapes, parameter counts, input checks, checkpoints, and cached == uncached."""
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labutils.decode.kvcache import KVCache
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.checkpoints import load_checkpoint, save_checkpoint
from labutils.model.presets import PRESETS

SMALL = GPTConfig(vocab_size=50, context_length=24, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(SMALL).eval()


# ---- config --------------------------------------------------------------------------------------

def test_config_defaults_fill_in():
    assert SMALL.n_kv_head == 4 and SMALL.n_inner == 128 and SMALL.head_dim == 8


def test_n_embd_must_split_into_heads():
    with pytest.raises(ValueError, match="n_embd=30 must be divisible by n_head=4"):
        GPTConfig(n_embd=30, n_head=4)


def test_n_head_must_be_a_multiple_of_n_kv_head():
    with pytest.raises(ValueError, match="n_head=6 must be a multiple of n_kv_head=4"):
        GPTConfig(n_embd=48, n_head=6, n_kv_head=4)


@pytest.mark.parametrize("field", ["vocab_size", "context_length", "n_layer", "n_head", "n_embd"])
def test_sizes_must_be_positive(field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{field: 0})


def test_gpt2_small_preset_has_the_published_parameter_count():
    cfg = GPTConfig.preset("gpt2-small")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.vocab_size, cfg.context_length) == (12, 12, 768, 50257, 1024)
    assert cfg.num_params() == 124_439_808
    assert GPT(cfg).num_params() == 124_439_808


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_a_config_of_the_right_size(name):
    shape = PRESETS[name]
    cfg = GPTConfig.preset(name)
    assert cfg.head_dim == shape.head_dim and cfg.n_kv_head == shape.n_kv_head
    # Llama-style presets build with RoPE (no position table) and RMSNorm, as the models do: every count is the
    # published one, but Qwen2.5's, whose Q, K and V projections carry biases (one per output, in every layer).
    assert cfg.rope == (not shape.learned_positions) and cfg.norm == ("rmsnorm" if cfg.rope else "layernorm")
    qkv_biases = cfg.n_layer * (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim if name.startswith("qwen") else 0
    assert cfg.num_params() + qkv_biases == shape.n_params


def test_preset_overrides_and_unknown_names():
    assert GPTConfig.preset("gpt2-small", n_layer=2).n_layer == 2
    with pytest.raises((KeyError, ValueError), match="gpt2-tiniest"):
        GPTConfig.preset("gpt2-tiniest")


@settings(max_examples=25, deadline=None)
@given(n_kv_head=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 3]), head_dim=st.sampled_from([2, 4, 8]),
       n_layer=st.integers(1, 3), vocab=st.integers(1, 70), ctx=st.integers(1, 40),
       n_inner=st.one_of(st.none(), st.integers(1, 50)), gated=st.booleans(), bias=st.booleans(),
       tie=st.booleans())
def test_num_params_formula_matches_the_model(n_kv_head, group, head_dim, n_layer, vocab, ctx, n_inner,
                                              gated, bias, tie):
    n_head = n_kv_head * group   # MHA when group == 1, MQA when n_kv_head == 1, GQA otherwise
    cfg = GPTConfig(vocab_size=vocab, context_length=ctx, n_layer=n_layer, n_head=n_head,
                    n_embd=n_head * head_dim, n_kv_head=n_kv_head, n_inner=n_inner, gated_mlp=gated,
                    bias=bias, tie_weights=tie)
    assert GPT(cfg).num_params() == cfg.num_params()


# ---- forward and input checks --------------------------------------------------------------------

def test_forward_shape(model):
    ids = torch.randint(0, SMALL.vocab_size, (3, 10))
    assert model(ids).shape == (3, 10, SMALL.vocab_size)


def test_last_only_logits_are_the_last_row_of_the_full_logits(model):
    ids = torch.randint(0, SMALL.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, last = model(ids), model(ids, last_only=True)
    assert last.shape == (2, 1, SMALL.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], rtol=1e-5, atol=1e-6)


def test_gqa_and_gated_models_run():
    cfg = dataclasses.replace(SMALL, n_kv_head=1, gated_mlp=True, bias=False, tie_weights=False)
    out = GPT(cfg)(torch.zeros(2, 5, dtype=torch.long))
    assert out.shape == (2, 5, cfg.vocab_size) and torch.isfinite(out).all()


def test_id_outside_vocab_is_refused(model):
    with pytest.raises(ValueError, match="vocab"):
        model(torch.tensor([[1, 2, SMALL.vocab_size]]))
    with pytest.raises(ValueError, match="vocab"):
        model(torch.tensor([[-1, 2]]))


def test_sequence_longer_than_context_is_refused(model):
    ids = torch.zeros(1, SMALL.context_length + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"context length {SMALL.context_length}"):
        model(ids)
    model(ids[:, :-1])   # exactly the context length is fine


def test_cache_continuation_past_context_is_refused(model):
    cache = KVCache(SMALL, batch_size=1)
    model(torch.zeros(1, SMALL.context_length - 1, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="context length"):
        model(torch.zeros(1, 2, dtype=torch.long), cache)


def test_wrong_kind_of_ids_is_refused(model):
    with pytest.raises(TypeError, match="integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        model(torch.zeros(1, 0, dtype=torch.long))


def test_naive_and_sdpa_models_agree(model):
    ids = torch.randint(0, SMALL.vocab_size, (2, 16))
    with torch.no_grad():
        a = model.set_attention("naive")(ids)
        b = model.set_attention("sdpa")(ids)
    assert torch.allclose(a, b, atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        model.set_attention("flash")


def test_output_depends_only_on_the_past(model):
    """Causality: changing a later token leaves earlier logits untouched."""
    ids = torch.randint(0, SMALL.vocab_size, (1, 12))
    changed = ids.clone()
    changed[0, 8] = (ids[0, 8] + 1) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


# ---- the KV cache path (q_offset) ----------------------------------------------------------------

@pytest.mark.parametrize("impl", ["naive", "sdpa"])
@pytest.mark.parametrize("chunks", [[20], [7, 13], [5, 1, 1, 6, 7], [1] * 20])
def test_cached_forward_in_chunks_equals_full_forward(impl, chunks):
    torch.manual_seed(1)
    cfg = dataclasses.replace(SMALL, n_kv_head=2)   # GQA, so the cache holds fewer heads than the queries
    model = GPT(cfg).eval().set_attention(impl)
    ids = torch.randint(0, cfg.vocab_size, (2, sum(chunks)))
    cache = KVCache(cfg, batch_size=2, max_len=cfg.context_length)
    with torch.no_grad():
        full = model(ids)
        parts, start = [], 0
        for n in chunks:
            parts.append(model(ids[:, start:start + n], cache))
            start += n
    assert cache.pos == sum(chunks)
    assert torch.allclose(torch.cat(parts, dim=1), full, atol=1e-5)


# ---- checkpoints ---------------------------------------------------------------------------------

def test_checkpoint_round_trip(model, tmp_path):
    save_checkpoint(model, tmp_path / "ckpt")
    back = load_checkpoint(tmp_path / "ckpt")
    assert back.config == model.config
    assert back.lm_head.weight is back.tok_emb.weight   # still tied after loading
    ids = torch.randint(0, SMALL.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))


def test_checkpoint_round_trip_untied_gqa(tmp_path):
    cfg = dataclasses.replace(SMALL, n_kv_head=1, tie_weights=False, gated_mlp=True)
    model = GPT(cfg).eval()
    save_checkpoint(model, tmp_path)
    back = load_checkpoint(tmp_path)
    assert back.config == cfg
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))


def test_load_checkpoint_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json and model.pt"):
        load_checkpoint(tmp_path)


# ---- the Llama-style block: RMSNorm, RoPE (SwiGLU is gated_mlp) -------------------------------------

from labutils.model.gpt import RMSNorm, rope, rope_angles, rotate, rotation  # noqa: E402


def test_rmsnorm_matches_torch_and_has_one_weight_per_channel():
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)) * 4 + 2
    norm = RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 16))
    expected = torch.nn.functional.rms_norm(x, (16,), norm.weight, eps=1e-5)
    torch.testing.assert_close(norm(x), expected)
    assert sum(p.numel() for p in norm.parameters()) == 16
    # Unlike LayerNorm it keeps the mean: a constant vector comes out as weight x sign, not 0.
    assert torch.allclose(RMSNorm(4)(torch.full((4,), 3.0)), torch.ones(4), atol=1e-5)


def test_rope_rotates_pairs_keeps_lengths_and_is_identity_at_zero():
    x = torch.randn(2, 3, 7, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    pos = torch.arange(7)
    y = rope(x, pos)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0])                  # position 0: no turn
    assert not torch.allclose(y[:, :, 1:], x[:, :, 1:])
    # The first pair (dims 0 and 4) turns by exactly pos radians (frequency base^0 = 1).
    c, s = torch.cos(torch.tensor(3.0, dtype=torch.float64)), torch.sin(torch.tensor(3.0, dtype=torch.float64))
    x0, x4 = x[:, :, 3, 0], x[:, :, 3, 4]
    torch.testing.assert_close(y[:, :, 3, 0], x0 * c - x4 * s, atol=1e-6, rtol=0)
    torch.testing.assert_close(y[:, :, 3, 4], x4 * c + x0 * s, atol=1e-6, rtol=0)


def test_rope_scores_depend_only_on_the_distance():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 16, generator=g,
                                                                                 dtype=torch.float64)
    def score(m, n):
        return float((rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum())
    assert score(5, 2) == pytest.approx(score(105, 102), abs=1e-9)
    assert score(5, 2) == pytest.approx(score(3, 0), abs=1e-9)
    assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-6)


def test_rope_per_row_positions_match_one_row_at_a_time():
    x = torch.randn(2, 2, 3, 8, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[0, 1, 2], [7, 8, 9]])
    both = rope(x, pos)
    torch.testing.assert_close(both[1:], rope(x[1:], pos[1]))
    torch.testing.assert_close(both[:1], rope(x[:1], pos[0]))


LLAMA_SMALL = GPTConfig(vocab_size=61, context_length=40, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, n_inner=88,
                        gated_mlp=True, bias=False, tie_weights=False, norm="rmsnorm", rope=True)


def test_llama_style_model_has_no_position_table_and_counts_its_params():
    model = GPT(LLAMA_SMALL)
    assert model.pos_emb is None and not LLAMA_SMALL.learned_positions
    assert model.num_params() == LLAMA_SMALL.num_params()
    assert all(isinstance(m, RMSNorm) for m in (model.blocks[0].ln_1, model.blocks[0].ln_2, model.ln_f))
    for norm in ("layernorm", "rmsnorm"):
        for use_rope in (False, True):
            cfg = dataclasses.replace(SMALL, norm=norm, rope=use_rope)
            assert GPT(cfg).num_params() == cfg.num_params()


def test_llama_2_7b_with_rmsnorm_and_rope_has_the_published_count():
    cfg = GPTConfig.preset("llama-2-7b", norm="rmsnorm", rope=True)
    assert cfg.num_params() == PRESETS["llama-2-7b"].n_params == 6_738_415_616
    with torch.device("meta"):                                  # real modules, no memory
        assert GPT(cfg).num_params() == 6_738_415_616


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
def test_rope_model_cached_forward_equals_full_forward(impl):
    torch.manual_seed(0)
    model = GPT(LLAMA_SMALL).double().eval().set_attention(impl)
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(LLAMA_SMALL, 2, 12, dtype=torch.float64)
        parts = [model(ids[:, :5], cache), model(ids[:, 5:6], cache), model(ids[:, 6:], cache)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full)


def test_rope_model_sees_order_without_a_position_table():
    # One layer: the last token's attention is a weighted sum over keys, blind to their order unless
    # something marks positions. With the position table zeroed it is blind; RoPE alone restores order.
    def last_logits(cfg, ids):
        torch.manual_seed(0)
        model = GPT(cfg).double().eval()
        if model.pos_emb is not None:
            torch.nn.init.zeros_(model.pos_emb.weight)
        with torch.no_grad():
            return model(torch.tensor([ids]))[0, -1]
    one = dataclasses.replace(LLAMA_SMALL, n_layer=1)
    blind = dataclasses.replace(one, rope=False)
    torch.testing.assert_close(last_logits(blind, [3, 9, 4]), last_logits(blind, [9, 3, 4]))
    assert not torch.allclose(last_logits(one, [3, 9, 4]), last_logits(one, [9, 3, 4]))


def test_bad_norm_and_odd_rope_head_dim_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown GPTConfig.norm 'batchnorm'; choose one of \['layernorm', 'rmsnorm'\]"):
        GPTConfig(n_embd=32, n_head=4, norm="batchnorm")
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        GPTConfig(n_embd=12, n_head=4, rope=True)
    with pytest.raises(TypeError, match="GPTConfig.rope must be True or False"):
        GPTConfig(n_embd=32, n_head=4, rope="yes")
    from labutils.model.checkpoints import save_hf_gpt2
    with pytest.raises(ValueError, match="rope=True has no GPT-2 equivalent"):
        save_hf_gpt2(GPT(dataclasses.replace(SMALL, rope=True)), tmp_path)


def test_llama_style_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    model = GPT(LLAMA_SMALL).eval()
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    ids = torch.randint(0, 61, (1, 9))
    assert loaded.config == LLAMA_SMALL
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def _top_level_ops(model, cache, ids) -> list[str]:
    with torch.inference_mode(), torch.profiler.profile() as prof:
        model(ids, cache, check=False, last_only=True)
    return [e.name for e in prof.events() if e.cpu_parent is None]


def test_a_llama_layer_runs_few_ops_and_rope_angles_once_a_forward():
    """On a GPU each op a layer runs from Python is its host's time, and each kernel a launch (lesson 08); an eager
    Llama-2-7B step runs 32 layers of them. RoPE's angles made in every layer, RMSNorm as five ops and q and k turned
    apart took a layer from 45 ops to 79; RoPE's halves turned apart, a cast each way in 16 bits, q, k and v laid out
    for attention one by one and each cache view made twice, from 30 to 45. The ops a layer adds are counted as the
    difference between a 4-layer and a 2-layer model, in bf16, where a cast would be a kernel."""
    counts = {}
    for layers in (2, 4):
        cfg = dataclasses.replace(LLAMA_SMALL, n_layer=layers)
        model, cache = GPT(cfg).to(torch.bfloat16).eval(), KVCache(cfg, 2, 16, dtype=torch.bfloat16)
        ops = _top_level_ops(model, cache, torch.zeros(2, 3, dtype=torch.long))
        counts[layers] = ops
        assert ops.count("aten::cos") == 1 and ops.count("aten::sin") == 1      # the angles: once, for every layer
        assert ops.count("aten::rms_norm") == 2 * layers + 1                    # one op a norm
    assert (len(counts[4]) - len(counts[2])) / 2 <= 30
    assert counts[4].count("aten::to") == counts[2].count("aten::to")         # no cast in a layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rotate_is_the_pairwise_turn_to_the_bit(dtype):
    """rotate's four ops give what turning each pair (x1, x2) by its own cos and sin gives, bit for bit, in x's dtype
    with the angles' cos and sin cast to it (Hugging Face's Llama): the rewrite that cut the kernels changed no value
    (negating a product is exact)."""
    g = torch.Generator().manual_seed(4)
    for shape, pos in (((2, 5, 7, 64), torch.arange(7)), ((2, 3, 6, 16), torch.tensor([[0, 1, 2, 3, 4, 5],
                                                                                         [9, 8, 7, 6, 5, 4]]))):
        x = (torch.randn(*shape, generator=g) * 3).to(dtype)
        cos, sin = (t.to(dtype) for t in rope_angles(pos, shape[-1], dtype))
        x1, x2 = x[..., :shape[-1] // 2], x[..., shape[-1] // 2:]
        pairwise = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        turned = rotate(x, *rotation(pos, shape[-1], dtype))
        assert turned.dtype == dtype and torch.equal(turned, pairwise)
