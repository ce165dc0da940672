"""Generation: cached decode gives the recompute tokens, the cache is really used, bad input is refused early."""
import contextlib
import dataclasses
import itertools
import math

import pytest
import torch

from labutils.decode.loop import GenerationResult, decode_step, generate, prefill
from labutils.decode.kvcache import KVCache
from labutils.model.gpt import GPT, GPTConfig

VOCAB, CTX, N_NEW = 97, 96, 64


def make_model(n_kv_head=4, gated=False, seed=0, n_layer=2, n_head=4, n_embd=32, ctx=CTX, impl="sdpa"):
    """A small float64 model whose weights are spread out enough that greedy decoding wanders.

    GPT-2's init (std 0.02) makes a random model echo one token forever, and then "same tokens with
    and without the cache" proves little. float64 makes an argmax tie from rounding practically impossible.
    """
    cfg = GPTConfig(vocab_size=VOCAB, context_length=ctx, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                    n_kv_head=n_kv_head, gated_mlp=gated, bias=not gated, tie_weights=not gated)
    torch.manual_seed(seed)
    model = GPT(cfg).set_attention(impl)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                scale = 1.0 if name.endswith("emb.weight") or name.startswith("lm_head") else 3.0
                p.copy_(torch.randn(p.shape, generator=g) * scale / p.shape[-1] ** 0.5)
    return model.double().eval()


def prompt(batch=1, length=8, seed=0):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def count_forwards(model):
    """Within the block, record the ids shape of every forward pass the model runs; the hook goes at the end."""
    shapes = []
    handle = model.register_forward_pre_hook(lambda mod, args: shapes.append(tuple(args[0].shape)))
    try:
        yield shapes
    finally:
        handle.remove()


# MHA / GQA / MQA x GPT-2-style (GELU, tied) / Llama-style (SwiGLU, untied) x batch 1 and 2.
SWEEP = list(itertools.product([4, 2, 1], [False, True], [1, 2]))


@pytest.mark.parametrize("n_kv_head,gated,batch", SWEEP)
def test_cached_tokens_equal_recompute_tokens(n_kv_head, gated, batch):
    seed = 10 * n_kv_head + 2 * gated + batch
    model = make_model(n_kv_head, gated, seed=seed)
    ids = prompt(batch, 8, seed)
    cached = generate(model, ids, N_NEW, use_cache=True)
    recomputed = generate(model, ids, N_NEW, use_cache=False)
    assert cached.tokens.shape == (batch, N_NEW)
    assert torch.equal(cached.tokens, recomputed.tokens)
    for row in cached.tokens.tolist():   # the model must not just repeat itself, or equality means little
        assert len(set(row)) >= 8, f"random model degenerated to {row}"


def test_naive_and_sdpa_attention_give_the_same_cached_tokens():
    ids = prompt(2, 8, 3)
    a = generate(make_model(2, seed=3, impl="naive"), ids, N_NEW).tokens
    b = generate(make_model(2, seed=3, impl="sdpa"), ids, N_NEW).tokens
    assert torch.equal(a, b)


@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_cached_logits_match_one_full_forward(n_kv_head):
    """Prefill half the sequence, decode the rest one token at a time: every logit row matches."""
    model = make_model(n_kv_head, seed=5)
    ids = prompt(2, 40, 5)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, 2, 40, dtype=torch.float64)
        rows = [model(ids[:, :20], cache)]
        rows += [model(ids[:, t:t + 1], cache) for t in range(20, 40)]
    torch.testing.assert_close(torch.cat(rows, dim=1), full, rtol=0, atol=1e-10)


# --- the cache is really used ---------------------------------------------------------------

@pytest.mark.parametrize("batch", [1, 2])
def test_prefill_feeds_the_prompt_and_each_decode_step_feeds_one_token(batch):
    model = make_model(2, seed=1)
    with count_forwards(model) as shapes:
        generate(model, prompt(batch, 8), 10, use_cache=True)
        cached = list(shapes)
        shapes.clear()
        generate(model, prompt(batch, 8), 10, use_cache=False)
        recomputed = list(shapes)
    assert cached == [(batch, 8)] + [(batch, 1)] * 9
    # Without the cache, every step feeds the whole sequence so far: the work the cache saves.
    assert recomputed == [(batch, 8 + i) for i in range(10)]


def test_token_embedding_sees_one_token_per_decode_step():
    """The same proof one level down, on the embedding lookup itself."""
    model = make_model(4, seed=2)
    seen = []
    handle = model.tok_emb.register_forward_hook(lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    try:
        generate(model, prompt(2, 12), 6)
    finally:
        handle.remove()
    assert seen == [(2, 12)] + [(2, 1)] * 5


def test_corrupting_the_cache_changes_the_next_logits():
    model = make_model(2, seed=4)
    ids = prompt(2, 16, 4)
    with torch.no_grad():
        cache = KVCache(model.config, 2, 32, dtype=torch.float64)
        tok = prefill(model, ids, cache)
        clean = model(tok[:, None], cache.clone())
        for name in ("k", "v"):
            bad = cache.clone()
            getattr(bad, name)[:, :, :, :cache.pos] += 1.0   # only the written positions
            assert not torch.allclose(model(tok[:, None], bad), clean), f"decode ignored cache.{name}"
        # Garbage beyond pos must not matter: a decode step reads exactly the positions written so far.
        junk = cache.clone()
        junk.k[:, :, :, cache.pos:] = float("nan")
        junk.v[:, :, :, cache.pos:] = float("nan")
        torch.testing.assert_close(model(tok[:, None], junk), clean, rtol=0, atol=0)


def test_decode_from_the_cache_alone_matches_recompute():
    """Decode steps see only the newest token; the right answer can only come from the cache."""
    model = make_model(1, seed=6)
    ids = prompt(1, 10, 6)
    with torch.no_grad():
        cache = KVCache(model.config, 1, 20, dtype=torch.float64)
        tok = prefill(model, ids, cache)
        seq = torch.cat([ids, tok[:, None]], dim=1)
        for _ in range(9):
            tok = decode_step(model, tok, cache)
            seq = torch.cat([seq, tok[:, None]], dim=1)
    expected = generate(model, ids, 10, use_cache=False).tokens
    assert torch.equal(seq[:, 10:], expected)


def test_cache_pos_advances_by_one_per_decode_step():
    model = make_model(4, seed=7)
    with torch.no_grad():
        cache = KVCache(model.config, 1, 30, dtype=torch.float64)
        tok = prefill(model, prompt(1, 9), cache)
        assert cache.pos == 9
        for step in range(1, 21):
            tok = decode_step(model, tok, cache)
            assert cache.pos == 9 + step


# --- bad input is refused before any work -------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_too_long_request_names_the_context_before_any_forward(use_cache):
    model = make_model(seed=0)
    with count_forwards(model) as shapes:
        with pytest.raises(ValueError, match=rf"context length {CTX}"):
            generate(model, prompt(1, 40), CTX - 39, use_cache=use_cache)
    assert shapes == []
    assert generate(model, prompt(1, 40), CTX - 40, use_cache=use_cache).tokens.shape == (1, CTX - 40)


@pytest.mark.parametrize("ids", [[], torch.tensor([], dtype=torch.long), torch.empty(2, 0, dtype=torch.long),
                                 [[]]])
def test_empty_prompt(ids):
    with pytest.raises(ValueError, match="empty"):
        generate(make_model(), ids, 4)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_must_be_positive(n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(make_model(), [1, 2, 3], n)


@pytest.mark.parametrize("n", [2.5, "4", True])
def test_max_new_tokens_must_be_an_int(n):
    with pytest.raises(TypeError, match="max_new_tokens"):
        generate(make_model(), [1, 2, 3], n)


@pytest.mark.parametrize("ids", [[1.5, 2.0], torch.tensor([1.0, 2.0]), [True, False], "hello",
                                 torch.tensor([[1, 2]], dtype=torch.float64), [[1, 2], [3]]])
def test_non_integer_ids_are_refused(ids):
    model = make_model()
    with count_forwards(model) as shapes:
        with pytest.raises(TypeError, match="ids"):
            generate(model, ids, 4)
    assert shapes == []


def test_out_of_vocab_id_is_refused():
    with pytest.raises(ValueError, match="vocab"):
        generate(make_model(), [1, VOCAB], 4)


def test_invalid_sampling_is_refused_before_any_forward():
    model = make_model()
    with count_forwards(model) as shapes:
        with pytest.raises(ValueError, match="temperature"):
            generate(model, [1, 2], 4, temperature=-1.0)
        with pytest.raises(ValueError, match="top_p"):
            generate(model, [1, 2], 4, temperature=1.0, top_p=0.0)
    assert shapes == []


@pytest.mark.parametrize("use_cache", [True, False])
def test_stop_token_ends_the_request_with_that_token(use_cache):
    model, ids = make_model(), prompt(1, 8, 3)
    full = generate(model, ids, 40, use_cache=use_cache).tokens[0]
    stop = int(full[5])
    first = full.tolist().index(stop)                 # the first place the stop token appears
    out = generate(model, ids, 40, use_cache=use_cache, stop_token=stop)
    assert out.tokens.shape == (1, first + 1) and int(out.tokens[0, -1]) == stop
    assert torch.equal(out.tokens[0], full[:first + 1]) and len(out.timestamps) == first + 1
    # A stop token the model never says changes nothing.
    unused = next(t for t in range(VOCAB) if t not in full.tolist())
    assert torch.equal(generate(model, ids, 40, use_cache=use_cache, stop_token=unused).tokens[0], full)


def test_stop_token_in_a_batch_waits_for_every_row_and_pads_with_it():
    model, ids = make_model(), prompt(2, 8, 3)
    full = generate(model, ids, 40).tokens
    stop = int(full[0, 3])
    out = generate(model, ids, 40, stop_token=stop).tokens
    ends = [row.tolist().index(stop) if stop in row.tolist() else 39 for row in full]
    assert out.shape[1] == max(ends) + 1
    for row, end in enumerate(ends):
        assert torch.equal(out[row, :end + 1], full[row, :end + 1])
        assert (out[row, end + 1:] == stop).all()      # a finished row keeps saying stop


def test_stop_token_forward_count_and_bad_values():
    model, ids = make_model(), prompt(1, 8, 3)
    stop = int(generate(model, ids, 10).tokens[0, 2])
    with count_forwards(model) as shapes:
        n = generate(model, ids, 10, stop_token=stop).tokens.shape[1]
    assert len(shapes) == n                         # no forward pass after the stop
    with pytest.raises(ValueError, match=r"stop_token must be <= 96, got 97.*enc.eot_token"):
        generate(model, ids, 4, stop_token=VOCAB)
    with pytest.raises(TypeError, match="stop_token must be an int, got float"):
        generate(model, ids, 4, stop_token=1.5)


def test_batch_mismatch_with_cache():
    model = make_model()
    cache = KVCache(model.config, batch_size=1, max_len=20, dtype=torch.float64)
    with pytest.raises(ValueError, match="batch"):
        prefill(model, prompt(2, 5), cache)
    assert cache.pos == 0
    tok = prefill(model, prompt(1, 5), cache)
    with pytest.raises(ValueError, match="batch"):
        decode_step(model, tok.repeat(2), cache)     # would otherwise broadcast into the batch-1 cache
    with pytest.raises(ValueError, match=r"1-D tensor \[batch\]"):
        decode_step(model, tok[:, None], cache)
    assert cache.pos == 5


def test_decode_past_the_cache_says_how_to_fix_it():
    model = make_model()
    cache = KVCache(model.config, batch_size=1, max_len=6, dtype=torch.float64)
    tok = prefill(model, prompt(1, 5), cache)
    tok = decode_step(model, tok, cache)
    with pytest.raises(ValueError, match=r"holds 6 positions.*max_len"):
        decode_step(model, tok, cache)
    assert cache.pos == 6


# --- timestamps and the request metrics --------------------------------------------------------

@pytest.mark.parametrize("use_cache", [True, False])
def test_timestamps_and_metrics(use_cache):
    res = generate(make_model(), prompt(2, 6), 12, use_cache=use_cache)
    ts = res.timestamps
    assert isinstance(res, GenerationResult)
    assert len(ts) == 12 and res.tokens.shape == (2, 12) and res.tokens.device.type == "cpu"
    assert res.prompt_len == 6
    assert all(t >= 0 for t in ts) and all(b >= a for a, b in zip(ts, ts[1:]))
    assert res.ttft_s == ts[0]
    assert res.tpot_s == pytest.approx((ts[-1] - ts[0]) / 11)
    assert res.latency_s == ts[-1]
    assert res.ttft_s + 11 * res.tpot_s == pytest.approx(res.latency_s)
    assert len(res.itl_s) == 11 and sum(res.itl_s) == pytest.approx(ts[-1] - ts[0])


def test_single_token_has_no_tpot():
    res = generate(make_model(), [1, 2, 3], 1)
    assert len(res.timestamps) == 1 and res.ttft_s == res.timestamps[0]
    assert math.isnan(res.tpot_s)


def test_list_and_1d_prompts_are_batch_one():
    model = make_model(seed=8)
    ids = prompt(1, 7, 8)
    a = generate(model, ids, 5).tokens
    assert torch.equal(generate(model, ids[0], 5).tokens, a)
    assert torch.equal(generate(model, ids[0].tolist(), 5).tokens, a)


@pytest.mark.parametrize("batch", [1, 2])
def test_llama_style_model_cached_tokens_equal_recompute_tokens(batch):
    # RoPE reads each token's position from the cache (cache.begin): a wrong offset would change the tokens.
    model = make_model(2, gated=True, seed=4)
    cfg = dataclasses.replace(model.config, norm="rmsnorm", rope=True)
    llama = GPT(cfg).double().eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("pos_emb")
             and not k.endswith(("ln_1.bias", "ln_2.bias", "ln_f.bias"))}
    llama.load_state_dict(state)
    ids = prompt(batch, 8, 4)
    cached = generate(llama, ids, 40).tokens
    assert torch.equal(cached, generate(llama, ids, 40, use_cache=False).tokens)
    assert len(set(cached[0].tolist())) > 3       # it wanders, so the equality says something


def test_llama_style_model_gives_the_same_tokens_on_every_decode_path():
    # RoPE reads positions from three kinds of cache: the static one (fastgen), the growing one, and the
    # paged batch, whose rows sit at different positions. Each must give generate()'s greedy tokens.
    from labutils.decode.fastgen import fast_generate
    from labutils.serving.engine import Engine
    from labutils.decode.speculative import speculative_generate
    cfg = dataclasses.replace(make_model(2, gated=True).config, norm="rmsnorm", rope=True)
    torch.manual_seed(0)
    llama = GPT(cfg).double().eval()
    with torch.no_grad():
        for p in llama.parameters():
            if p.dim() == 2:
                p.mul_(40)                       # spread the weights so greedy decoding wanders
    ids = prompt(2, 8, 5)
    ref = generate(llama, ids, 24).tokens
    assert len(set(ref[0].tolist())) > 4
    for cache_kind in ("static", "growing"):
        assert torch.equal(fast_generate(llama, ids, 24, cache_kind=cache_kind, mode="eager").tokens, ref)
    assert torch.equal(speculative_generate(llama, llama, ids[:1], 24, k=3).tokens, ref[:1])
    engine = Engine(llama, 4, block_size=4)
    prompts = [list(range(5)), list(range(10, 30)), list(range(40, 43))]
    for p in prompts:
        engine.submit(p, 16)
    for r, p in zip(engine.run(), prompts):
        assert r.tokens == generate(llama, p, 16).tokens[0].tolist()


@pytest.mark.parametrize("bad, err", [(dict(temperature=-1), ValueError), (dict(top_p=2.0), ValueError),
                                      (dict(top_k=0), ValueError), (dict(temprature=0.5), TypeError)])
def test_a_refused_prefill_or_decode_step_leaves_the_cache_as_it_was(bad, err):
    """The sampling options used to be checked after the forward, which had already written the cache."""
    model = make_model(2, seed=1)
    ids = prompt(1, 8)
    cache = KVCache(model.config, 1, 16, dtype=torch.float64)
    with torch.no_grad():
        with pytest.raises(err, match="temperature|top_p|top_k|unknown sampling option"):
            prefill(model, ids, cache, **bad)
        assert cache.pos == 0
        tok = prefill(model, ids, cache)
        with pytest.raises(err):
            decode_step(model, tok, cache, **bad)
        assert cache.pos == 8
