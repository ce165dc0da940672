"""The fast decode loop: generate()'s greedy tokens, a graph-ready step, device sampling, bad input, GPU checks."""
import time
import warnings

import pytest
import torch
import torch._dynamo

from labutils.decode import fastgen
from labutils.decode.fastgen import STAGES, FastDecoder, FastGenerationResult, check_graph_ready, fast_generate
from labutils.decode.loop import GenerationResult, generate
from labutils.decode.sampling import sample, sampling_probs
from labutils.decode.kvcache import KVCache
from labutils.decode.prepack import column_major_weights
from labutils.model.gpt import GPT, GPTConfig
from labutils.decode.static_cache import StaticKVCache

from test_generate import CTX, VOCAB, count_forwards, make_model, prompt

def fp32_model(n_kv_head=2, gated=False, seed=0, **kw):
    return make_model(n_kv_head, gated, seed=seed, **kw).float()


# --- same greedy tokens as generate(), exactly, in fp32 -----------------------------------------

# (n_kv_head, gated, batch, prompt_len, new): MHA / GQA / MQA, GPT-2 and Llama style, batch 1 and 2,
# prompts from one token to most of the context, and requests that end exactly at the context limit.
CASES = [(4, False, 1, 1, 40), (2, False, 2, 8, 48), (1, False, 1, 30, 30), (2, True, 2, 5, 40),
         (1, True, 1, 17, CTX - 17), (4, True, 2, 60, CTX - 60), (2, False, 1, CTX - 1, 1)]


@pytest.mark.parametrize("n_kv_head,gated,batch,prompt_len,new", CASES)
@pytest.mark.parametrize("stage", ["sync-free", "static"])
def test_greedy_tokens_equal_generate_in_fp32(n_kv_head, gated, batch, prompt_len, new, stage):
    seed = 7 * n_kv_head + 3 * gated + batch + prompt_len
    model = fp32_model(n_kv_head, gated, seed)
    ids = prompt(batch, prompt_len, seed)
    want = generate(model, ids, new)
    got = fast_generate(model, ids, new, **STAGES[stage])
    assert isinstance(got, GenerationResult) and got.tokens.device.type == "cpu"
    assert got.tokens.shape == (batch, new) and got.prompt_len == prompt_len
    assert torch.equal(got.tokens, want.tokens)
    if new >= 30:   # a model that repeats one token would make equality mean little
        for row in got.tokens.tolist():
            assert len(set(row)) >= 8, f"random model degenerated to {row}"


def test_a_reused_decoder_gives_fresh_results():
    """The second request on one FastDecoder (a different prompt length) matches a fresh generate()."""
    model = fp32_model(2, seed=3)
    dec = FastDecoder(model, 2, 60, mode="eager")
    for length, new in [(20, 40), (5, 30), (20, 40)]:
        ids = prompt(2, length, length)
        assert torch.equal(dec.generate(ids, new).tokens, generate(model, ids, new).tokens)


# --- the static cache: device position, zeroed buffers, whole-buffer attention under a mask --------

def test_static_cache_logits_match_one_full_forward():
    model = make_model(2, seed=5)        # float64: compare logits, not only tokens
    ids = prompt(2, 40, 5)
    with torch.inference_mode():
        full = model(ids)
        cache = StaticKVCache(model.config, 2, 48, dtype=torch.float64)
        rows = [model(ids[:, :20], cache)]
        rows += [model(ids[:, t:t + 1], cache, check=False) for t in range(20, 40)]
        assert isinstance(cache.pos, torch.Tensor) and int(cache.pos) == 40
    torch.testing.assert_close(torch.cat(rows, dim=1), full, rtol=0, atol=1e-10)


def test_static_cache_is_zeroed_masked_and_really_read():
    model = make_model(2, seed=4)
    ids = prompt(1, 16, 4)
    cache = StaticKVCache(model.config, 1, 32, dtype=torch.float64)
    assert not cache.k.any() and not cache.v.any() and int(cache.pos) == 0
    with torch.inference_mode():
        model(ids, cache)
        tok = ids[:, -1:]
        before = (cache.k.clone(), cache.v.clone(), cache.pos.clone())

        def next_logits():
            cache.k.copy_(before[0]), cache.v.copy_(before[1]), cache.pos.copy_(before[2])
            return model(tok, cache, check=False)

        clean = next_logits()
        # Finite garbage past pos is masked out exactly: the step reads only the positions written.
        before[0][:, :, :, 16:], before[1][:, :, :, 16:] = 1e4, -1e4
        torch.testing.assert_close(next_logits(), clean, rtol=0, atol=0)
        before[0][:, :, :, :16] += 1.0         # but the written positions are what the step uses
        assert not torch.allclose(next_logits(), clean), "decode ignored the cache"
    cache.reset()
    assert not cache.k.any() and int(cache.pos) == 0


def test_position_embedding_reads_the_device_position():
    model = fp32_model(4, seed=2)
    seen = []
    handle = model.pos_emb.register_forward_hook(lambda mod, inp, out: seen.append(inp[0].clone()))
    try:
        fast_generate(model, prompt(2, 6), 5, mode="eager")
    finally:
        handle.remove()
    assert [s.tolist() for s in seen] == [list(range(6)), [6], [7], [8], [9]]


def test_gqa_never_repeats_keys_and_values(monkeypatch):
    """The model's SDPA path reads each KV head once: repeat_interleave would copy group x the bytes."""
    model = fp32_model(1, seed=8)                      # MQA: four query heads share one KV head
    want = generate(model, prompt(2, 9), 12).tokens    # (computed before the trap is set)

    def trap(*args, **kwargs):
        raise AssertionError("K/V were repeated")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", trap)
    assert torch.equal(fast_generate(model, prompt(2, 9), 12).tokens, want)
    assert torch.equal(generate(model, prompt(2, 9), 12).tokens, want)     # lesson 06's path too
    with pytest.raises(AssertionError, match="repeated"):                  # the trap can fire
        generate(model.set_attention("naive"), prompt(2, 9), 2)


# --- CUDA-graph readiness, checked on CPU with dynamo ---------------------------------------------

def prefilled(model, ids, **kw) -> FastDecoder:
    dec = FastDecoder(model, ids.shape[0], 40, mode="eager", **kw)
    with torch.inference_mode():
        model(ids, dec.cache, check=False, last_only=True)
        dec.token.copy_(ids[:, -1:])
    return dec


def run_steps(dec: FastDecoder, steps: int = 4) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            dec.step()
            out.append(dec.token[:, 0].clone())
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=10, top_p=0.9)])
def test_decode_step_is_one_static_graph(sampling):
    model = fp32_model(2, seed=1, n_layer=1)
    ids = prompt(2, 8, 1)
    dec = prefilled(model, ids, **sampling)
    check_graph_ready(dec.step, steps=4)        # no graph break, no host read, no recompile
    # The traced steps really ran: the next eager step continues from where they left off.
    # (The noise buffer keeps its value across these steps, so sampled runs are deterministic.)
    assert int(dec.cache.pos) == 12
    ref = prefilled(model, ids, **sampling)
    assert torch.equal(run_steps(dec, 2), run_steps(ref, 6)[:, 4:])


def test_readiness_check_catches_a_python_int_position():
    """Lesson 06's cache keeps pos as an int and returns a growing slice: every step is a new graph."""
    dec = prefilled(fp32_model(2, seed=1, n_layer=1), prompt(1, 8), cache_kind="growing")
    with pytest.raises(torch._dynamo.exc.RecompileError, match="pos"):
        check_graph_ready(dec.step)


@pytest.mark.parametrize("sabotage", ["item", "branch"])
def test_readiness_check_catches_a_host_read(monkeypatch, sabotage):
    dec = prefilled(fp32_model(2, seed=1, n_layer=1), prompt(1, 8))
    real = fastgen.decode_step                 # the one-token step FastDecoder.step runs

    def with_host_read(*args, **kwargs):
        token = real(*args, **kwargs)
        if sabotage == "item":          # a host copy, even if the value only feeds tensor maths
            return token + 0 * token[0].item()
        return token if token[0].item() < 2 ** 62 else token + 1     # a Python branch on a device value

    monkeypatch.setattr(fastgen, "decode_step", with_host_read)
    with pytest.raises((torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                        torch._dynamo.exc.BackendCompilerFailed), match="item|data-dependent"):
        check_graph_ready(dec.step, steps=2)


# --- sampling on the device -------------------------------------------------------------------------

def test_exponential_race_draws_from_sampling_probs():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 40_000
    g = torch.Generator().manual_seed(0)
    for settings in [dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)]:
        probs = sampling_probs(logits, **settings)[0]
        noise = torch.empty(n, 6).exponential_(generator=g)
        tokens = sample(logits.expand(n, 6), noise=noise, **settings)
        freq = torch.bincount(tokens, minlength=6).double() / n
        torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.012)
        assert not freq[probs == 0].any()      # a token top-k/top-p dropped is never drawn


def test_sampled_tokens_repeat_with_a_seed_and_never_call_multinomial(monkeypatch):
    model = fp32_model(2, seed=9)
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: pytest.fail("multinomial syncs the host"))
    run = lambda seed: fast_generate(model, prompt(2, 8), 30, temperature=1.0, top_k=20, seed=seed).tokens  # noqa
    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = fast_generate(model, prompt(2, 8), 30).tokens
    assert not torch.equal(a, greedy)


# --- results, timestamps, streaming, modes ---------------------------------------------------------

def test_timestamps_setup_and_streaming():
    model = fp32_model(2, seed=3)
    streamed = []
    res = fast_generate(model, prompt(2, 8), 20, on_token=lambda t: streamed.append(t.clone()))
    assert isinstance(res, FastGenerationResult) and res.mode == "eager" and res.fallback is None
    assert len(res.timestamps) == 20 and res.timestamps[0] > 0
    assert all(b >= a for a, b in zip(res.timestamps, res.timestamps[1:]))
    assert res.ttft_s == res.timestamps[0] and res.tpot_s > 0 and res.setup_s >= 0
    assert torch.equal(torch.stack(streamed, dim=1), res.tokens)   # every step, in order, on the host


@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_unavailable_modes_fall_back_to_eager_with_a_reason(mode, monkeypatch):
    model = fp32_model(2, seed=3)
    ids = prompt(1, 8)
    if mode == "compile":
        def broken(*a, **k):
            raise RuntimeError("no C++ compiler found")
        monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match="running eager"):
        res = fast_generate(model, ids, 12, mode=mode)
    assert res.mode == "eager"
    assert ("NVIDIA GPU" if mode == "graph" else "no C++ compiler") in res.fallback
    assert torch.equal(res.tokens, generate(model, ids, 12).tokens)


@pytest.mark.parametrize("mode", ["graph", "compile"])
def test_graphs_need_the_static_cache(mode):
    with pytest.warns(RuntimeWarning, match="static shapes"):
        dec = FastDecoder(fp32_model(), 1, 20, mode=mode, cache_kind="growing")
    assert dec.mode == "eager" and "cache_kind='static'" in dec.fallback


def test_auto_is_eager_on_cpu_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = fast_generate(fp32_model(), prompt(1, 4), 3)
    assert res.mode == "eager" and res.fallback is None


# --- bad input: refused before any work -------------------------------------------------------------

def test_too_many_tokens_are_refused_before_any_forward():
    model = fp32_model()
    with count_forwards(model) as shapes:
        with pytest.raises(ValueError, match=rf"exceed the context length {CTX}"):
            fast_generate(model, prompt(1, 10), CTX - 9)
        dec = FastDecoder(model, 1, 30, mode="eager")
        with pytest.raises(ValueError, match=r"do not fit the cache's max_len=30.*larger max_len"):
            dec.generate(prompt(1, 10), 21)
        with pytest.raises(ValueError, match="batch_size=1"):
            dec.generate(prompt(2, 10), 5)
    assert shapes == []


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="turbo"), r"unknown mode 'turbo'; choose one of \['auto', 'eager', 'graph', 'compile'\]"),
    (dict(cache_kind="paged"), r"unknown cache_kind 'paged'; choose one of \['static', 'growing'\]"),
    (dict(temperature=-1), "temperature must be"),
    (dict(top_k=0), "top_k must be"),
])
def test_bad_settings_name_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fast_generate(fp32_model(), prompt(1, 4), 3, **kwargs)


def test_bad_requests():
    model = fp32_model()
    with pytest.raises(ValueError, match="empty"):
        fast_generate(model, [], 3)
    with pytest.raises(TypeError, match="max_new_tokens must be an int"):
        fast_generate(model, prompt(1, 4), 2.5)
    with pytest.raises(ValueError, match="outside the vocab"):
        fast_generate(model, [[VOCAB]], 3)
    with pytest.raises(TypeError, match="on_token must be a function"):
        fast_generate(model, prompt(1, 4), 3, on_token="print")
    with pytest.raises(ValueError, match="exceeds the context length"):
        StaticKVCache(model.config, 1, CTX + 1)


def test_out_of_memory_says_what_to_shrink(monkeypatch):
    def oom(*a, **k):
        raise RuntimeError("CUDA out of memory. Tried to allocate 9.00 GiB")
    monkeypatch.setattr(torch, "zeros", oom)
    with pytest.raises(MemoryError, match=r"KV cache of .* MiB \(batch_size=4 x max_len=50, .*\) does not fit.*"
                                          r"smaller batch_size or max_len \(fewer new tokens\)"):
        StaticKVCache(fp32_model().config, 4, 50)


# --- on a GPU (make gpu-check) -------------------------------------------------------------------

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
BF16_STEPS = 32   # bf16 greedy tokens equal generate()'s for this many steps on the test model


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mode,sampling", [("graph", {}), ("graph", dict(temperature=1.0, top_k=20)),
                                           ("compile", {})])
def test_gpu_graph_and_compile_give_the_eager_tokens(mode, sampling):
    model = fp32_model(2, seed=11).cuda()
    ids = prompt(2, 8, 11)
    eager = fast_generate(model, ids, 40, mode="eager", seed=3, **sampling)
    fast = fast_generate(model, ids, 40, mode=mode, seed=3, **sampling)
    assert (fast.mode, fast.fallback) == (mode, None)
    assert fast.setup_s > 0
    assert torch.equal(fast.tokens, eager.tokens)


@pytest.mark.gpu
@requires_gpu
def test_gpu_bf16_fast_loop_equals_generate():
    model = make_model(2, seed=12).to("cuda", torch.bfloat16)
    ids = prompt(2, 8, 12)
    fast = fast_generate(model, ids, BF16_STEPS)
    assert fast.mode == "graph"
    assert torch.equal(fast.tokens, generate(model, ids, BF16_STEPS).tokens)


@pytest.mark.gpu
@requires_gpu
def test_gpu_event_timestamps_are_sane_against_wall_time():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2-small")).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 128))
    dec = FastDecoder(model, 1, 128 + 64)
    dec.generate(ids, 64)                               # warm-up
    t0 = time.perf_counter()
    res = dec.generate(ids, 64)
    wall = time.perf_counter() - t0
    ts = res.timestamps
    assert 0 < ts[0] < ts[-1] <= wall + 1e-3         # the device clock and the host's agree to a millisecond
    assert ts[-1] >= 0.5 * wall, f"events say {ts[-1]:.4f} s of a {wall:.4f} s request"
    assert all(b >= a for a, b in zip(ts, ts[1:]))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gpu_decode_steps_never_sync_the_host(mode):
    model = fp32_model(2, seed=13).cuda()
    dec = FastDecoder(model, 1, 64, mode=mode, temperature=1.0, top_k=20)
    g = torch.Generator(device="cuda").manual_seed(0)
    host = torch.empty((20, 1), dtype=torch.long, pin_memory=True)
    with torch.inference_mode():
        model(prompt(1, 8).cuda(), dec.cache, check=False, last_only=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(20):
                dec.noise.exponential_(generator=g)
                dec._run()
                host[i].copy_(dec.token[:, 0], non_blocking=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert host.max() < model.config.vocab_size


@pytest.mark.gpu
@requires_gpu
def test_gpu_out_of_memory_says_what_to_shrink():
    with pytest.raises(MemoryError, match="does not fit on cuda.*smaller batch"):
        StaticKVCache(GPTConfig.preset("gpt2-small"), 100_000, 1024, device="cuda")


def test_column_major_weights_keep_values_ties_and_tokens():
    model = fp32_model(2, seed=14)
    ids = prompt(2, 8, 14)
    want = generate(model, ids, 30).tokens
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tied = make_model(2, seed=14).float()
    assert tied.lm_head.weight is tied.tok_emb.weight
    column_major_weights(tied)
    assert tied.lm_head.weight is tied.tok_emb.weight and tied.lm_head.weight.stride() == (1, VOCAB)
    column_major_weights(model)
    for name, w in model.state_dict().items():
        assert torch.equal(w, before[name]), name
    assert model.blocks[0].attn.qkv.weight.t().is_contiguous()
    assert torch.equal(fast_generate(model, ids, 30).tokens, want)


# ---- issue 18's bugs: each test failed before its fix ------------------------------------------------------------

def eager_compile(calls):
    """torch.compile's stand-in on a CPU test: count the compiles, run the step eagerly (no inductor, no graphs)."""
    def compile_(fn, **kwargs):
        calls.append(kwargs.get("mode"))
        return fn
    return compile_


def test_the_warm_up_stays_inside_a_two_position_cache(monkeypatch):
    # fast_generate(model, [tok], 1) sizes the cache to 2 positions; three warm-up steps wrote position 2,
    # an IndexError on a CPU and a device-side assert (a dead CUDA context) on a GPU.
    calls = []
    monkeypatch.setattr(torch, "compile", eager_compile(calls))
    model = make_model()
    dec = FastDecoder(model, 1, 2, mode="compile")
    assert dec.mode == "compile" and dec.fallback is None, dec.fallback
    one = torch.tensor([[3]])                                   # fast_generate(model, [tok], 1): max_len 2
    got = dec.generate(one, 1)
    assert torch.equal(got.tokens, generate(model, one, 1).tokens)


def test_compile_is_paid_once_per_shape_bucket_not_once_per_request(monkeypatch):
    # Each fast_generate built a new max_len = T + n: a new compile per call, and past dynamo's recompile limit
    # the loop turned eager with a note nobody read.
    calls = []
    monkeypatch.setattr(torch, "compile", eager_compile(calls))
    monkeypatch.setattr(fastgen, "_DECODERS", {})
    model = make_model()
    results = [fast_generate(model, prompt(1, T), 4, mode="compile") for T in range(3, 12)]
    assert all(r.mode == "compile" and r.fallback is None for r in results)
    assert len(calls) == 1, f"{len(calls)} compiles for 9 requests in one max_len bucket"
    assert all(torch.equal(r.tokens, generate(model, prompt(1, T), 4).tokens) for r, T in zip(results, range(3, 12)))
    fast_generate(model, prompt(3, 3), 4, mode="compile")      # a batch of 3: bucket 4, one more
    assert len(calls) == 2 and max(k[1] for k in fastgen._DECODERS) == 4


def test_buckets():
    assert [fastgen.bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert fastgen.bucket(10, smallest=64) == 64 and fastgen.bucket(100, smallest=64) == 128


def test_check_graph_ready_keeps_other_compiled_code():
    # It used to call torch._dynamo.reset(), which threw away every compiled decoder in the process.
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return gm.forward
    x = torch.ones(4)
    f = torch.compile(lambda: x * 2, backend=counting)
    f()
    dec = FastDecoder(make_model(), 1, 16, mode="eager")
    with torch.inference_mode():
        dec.model(prompt(1, 3), dec.cache, check=False, last_only=True)
    check_graph_ready(dec.step, steps=3)
    f()
    assert len(compiles) == 1, "check_graph_ready made earlier compiled code compile again"


def test_compiled_decoders_of_one_shape_do_not_recompile_each_other(monkeypatch):
    # Two decoders compiled the same method (FastDecoder.step): the second guarded against the first's tensors.
    compiles = []

    def counting(gm, example_inputs):
        compiles.append(1)
        return gm.forward
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counting, fullgraph=True, dynamic=False))
    model = make_model()
    decoders = [FastDecoder(model, 1, 16, mode="compile") for _ in range(3)]
    assert all(d.mode == "compile" for d in decoders), [d.fallback for d in decoders]
    before = len(compiles)
    for d in decoders:
        d.generate(prompt(1, 3), 4)
    assert len(compiles) == before, "a decoder's step compiled again when another decoder ran"


def test_a_smaller_batch_rides_in_its_bucket_and_a_larger_one_is_refused():
    model = make_model()
    dec = FastDecoder(model, 4, 32, mode="eager")
    ids = prompt(3, 5)
    got = dec.generate(ids, 6)
    assert got.tokens.shape == (3, 6) and torch.equal(got.tokens, generate(model, ids, 6).tokens)
    seen = []
    dec.generate(ids, 2, on_token=lambda t: seen.append(tuple(t.shape)))
    assert seen == [(3,), (3,)]                           # the callback sees only the real rows
    with pytest.raises(ValueError, match="does not fit this decoder's batch_size=4"):
        dec.generate(prompt(5, 5), 2)


def test_the_fast_loop_runs_generates_own_prefill_and_step(monkeypatch):
    """One prefill and one one-token step: the fast loop calls loop.prefill once and loop.decode_step per token."""
    calls = []

    def counted(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(fastgen, "prefill", counted("prefill", fastgen.prefill))
    monkeypatch.setattr(fastgen, "decode_step", counted("decode_step", fastgen.decode_step))
    model = fp32_model(2, seed=5)
    fast = fast_generate(model, prompt(1, 6), 5, mode="eager", temperature=1.0, top_k=10, seed=2)
    assert calls == ["prefill"] + ["decode_step"] * 4
    assert fast.tokens.shape == (1, 5)


def test_auto_compiles_int8_weights_on_cuda_and_graphs_float_ones():
    """On CUDA "auto" means the graph for float weights and compile for int8 ones (gpt-fast's way: a graph of eager
    ops would write a 16-bit copy of every int8 weight each step). Emulated CUDA runs neither, so each falls back and
    its reason names the mode that auto chose; on a CPU auto is eager, with no fallback."""
    import copy

    from labutils.core.emulated_cuda import emulated_cuda
    from labutils.decode import quant
    model = make_model().float()
    on_cpu = fast_generate(quant.quantize_(copy.deepcopy(model)), prompt(), 3)
    assert on_cpu.mode == "eager" and on_cpu.fallback is None
    with emulated_cuda(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = model.to("cuda", torch.bfloat16)
        reasons = {name: fast_generate(m, prompt().to("cuda"), 3).fallback
                   for name, m in (("float", model), ("int8", quant.quantize_(copy.deepcopy(model))))}
    assert "no graph" in reasons["float"] and "no compile" in reasons["int8"], reasons
