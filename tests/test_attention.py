"""Attention kernels agree (MHA, GQA, MQA, offset queries), the mask is causal, and their costs add up."""
import math

import pytest
import torch

from labutils.measure import attention_cost as ac
from labutils.model.kernels import ATTENTION_IMPLS, attention, causal_mask, naive_attention, sdpa_attention

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def qkv(batch, n_head, n_kv_head, tq, tk, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_head, tq, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, n_kv_head, tk, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, n_kv_head, tk, head_dim, generator=g, dtype=dtype)
    return q, k, v


def reference(q, k, v, q_offset):
    """Attention one query at a time, in float64 loops: slow and obviously right."""
    B, H, Tq, d = q.shape
    group = H // k.shape[1]
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=torch.float64)
    for h in range(H):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()   # query head h reads KV head h // group
        for i in range(Tq):
            visible = q_offset + i + 1                                   # keys 0 .. q_offset + i
            s = q[:, h, i:i + 1].double() @ kh[:, :visible].transpose(-2, -1) / math.sqrt(d)
            out[:, h, i] = (torch.softmax(s, dim=-1) @ vh[:, :visible])[:, 0]
    return out


# (n_head, n_kv_head, Tq, Tk, q_offset): prefill, decode, chunked prefill, static-cache reads.
CASES = [
    (4, 4, 7, 7, 0),     # prefill, multi-head
    (4, 2, 9, 9, 0),     # prefill, GQA
    (4, 1, 9, 9, 0),     # prefill, MQA
    (4, 4, 1, 12, 11),   # decode step: one query, sees every key
    (6, 2, 1, 12, 11),   # decode step, GQA
    (4, 2, 5, 12, 7),    # a later chunk of prefill: queries at 7..11 over keys 0..11
    (4, 4, 5, 20, 7),    # keys beyond the queries (a static cache buffer): must stay masked
    (4, 1, 1, 20, 3),    # decode read of a longer buffer, MQA
    (2, 2, 4, 4, 0),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_head,n_kv_head,tq,tk,q_offset", CASES)
def test_naive_equals_sdpa_equals_reference(dtype, n_head, n_kv_head, tq, tk, q_offset):
    q, k, v = qkv(2, n_head, n_kv_head, tq, tk, 8, dtype)
    want = reference(q, k, v, q_offset)
    for impl in ("naive", "sdpa"):
        got = attention(q, k, v, q_offset=q_offset, impl=impl)
        assert got.shape == q.shape and got.dtype == dtype
        err = (got.double() - want).abs().max().item()
        assert err < TOL[dtype], f"{impl}: max error {err:.2e}"


@pytest.mark.parametrize("seed", range(5))
def test_random_shapes_agree(seed):
    g = torch.Generator().manual_seed(100 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))   # noqa: E731
    n_kv = r(1, 3)
    n_head, tk, d = n_kv * r(1, 3), r(1, 40), r(1, 16)
    tq = r(1, tk)
    q_offset = r(0, tk - tq)
    q, k, v = qkv(r(1, 3), n_head, n_kv, tq, tk, d, torch.float64, seed)
    a, b = naive_attention(q, k, v, q_offset), sdpa_attention(q, k, v, q_offset)
    assert (a - b).abs().max().item() < 1e-10
    assert (a - reference(q, k, v, q_offset)).abs().max().item() < 1e-10


def test_keys_beyond_the_query_do_not_leak():
    """Garbage (even inf/nan-free huge values) in the unwritten part of a cache buffer changes nothing."""
    q, k, v = qkv(1, 4, 2, 3, 10, 8, torch.float64)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 6:], v2[:, :, 6:] = 1e6, -1e6   # positions 6..9 lie past the last query (offset 3 + 3 queries)
    for fn in ATTENTION_IMPLS.values():
        assert torch.equal(fn(q, k, v, 3), fn(q, k2, v2, 3))


def test_causal_mask_values():
    assert causal_mask(3, 3).tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    # Two queries at positions 2 and 3 over five keys.
    assert causal_mask(2, 5, q_offset=2).tolist() == [[True, True, True, False, False],
                                                     [True, True, True, True, False]]
    m = causal_mask(4, 9, q_offset=3)
    assert m.dtype == torch.bool and m.shape == (4, 9)
    assert m.sum(dim=1).tolist() == [4, 5, 6, 7]   # query i sees q_offset + i + 1 keys


def test_first_query_sees_only_itself():
    """Prefill row 0 attends to key 0 alone, so its output is exactly v[0]."""
    q, k, v = qkv(1, 2, 2, 5, 5, 4, torch.float64)
    for fn in ATTENTION_IMPLS.values():
        assert torch.allclose(fn(q, k, v)[:, :, 0], v[:, :, 0], atol=1e-12)


def test_bad_impl_name_lists_the_choices():
    q, k, v = qkv(1, 2, 2, 3, 3, 4, torch.float32)
    with pytest.raises(ValueError, match=r"unknown attention impl 'flash'.*'naive', 'sdpa'"):
        attention(q, k, v, impl="flash")


def test_heads_that_do_not_group_are_refused():
    q, k, v = qkv(1, 3, 2, 3, 3, 4, torch.float32)
    with pytest.raises(ValueError, match="n_head=3 is not a multiple of n_kv_head=2"):
        naive_attention(q, k, v)


# ---- labutils.measure.attention_cost: the formulas and measurements lesson 03 plots -------------------

def test_score_matrix_bytes_formula():
    assert ac.score_matrix_bytes(4096, 12, dtype=torch.float16) == 12 * 4096 * 4096 * 2 == 402_653_184
    assert ac.score_matrix_bytes(10, 2, batch_size=3) == 3 * 2 * 10 * 10 * 4
    assert ac.score_matrix_bytes(1000, 8, n_queries=1) == 8 * 1000 * 4   # a decode step: one row
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        ac.score_matrix_bytes(0, 4)
    with pytest.raises(ValueError, match="fp12"):
        ac.score_matrix_bytes(8, 4, dtype="fp12")


def test_score_traffic_is_four_trips_for_naive_and_none_for_fused():
    s = ac.score_matrix_bytes(512, 4)
    assert ac.score_traffic_bytes(512, 4, impl="naive") == 4 * s
    assert ac.score_traffic_bytes(512, 4, impl="sdpa") == 0
    assert ac.qkvo_bytes(512, 4, 64) == 4 * 512 * 4 * 64 * 4
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        ac.score_traffic_bytes(512, 4, impl="flash")


def test_peak_memory_counts_a_known_allocation():
    peak, source = ac.peak_memory_bytes(lambda: torch.ones(1_000_000), "cpu")
    assert source.startswith("measured")
    assert 4_000_000 <= peak < 4_100_000


def test_naive_holds_score_matrices_and_sdpa_does_not():
    """The lesson's memory claim, measured: naive keeps >= 1 full [T, T] matrix alive, SDPA none."""
    q, k, v = ac.make_qkv(256, n_head=4, head_dim=32)
    s = ac.score_matrix_bytes(256, 4)
    naive_peak, _ = ac.peak_memory_bytes(lambda: naive_attention(q, k, v), "cpu")
    sdpa_peak, _ = ac.peak_memory_bytes(lambda: sdpa_attention(q, k, v), "cpu")
    assert naive_peak >= 2 * s         # scores and their scaled copy coexist
    assert sdpa_peak < s / 2


def test_measure_attention_rows():
    rows = ac.measure_attention([16, 32], n_head=2, head_dim=8, warmup=0, repeats=1)
    assert [(r["seq_len"], r["impl"]) for r in rows] == [(16, "naive"), (16, "sdpa"), (32, "naive"), (32, "sdpa")]
    for r in rows:
        assert r["median_s"] > 0 and r["peak_bytes"] > 0 and r["error"] is None
        assert r["score_bytes"] == ac.score_matrix_bytes(r["seq_len"], 2)
    with pytest.raises(ValueError, match="unknown attention impl 'fast'"):
        ac.measure_attention([16], impls=("fast",))


def test_measure_attention_reports_out_of_memory_and_reraises_other_errors(monkeypatch):
    def oom(q, k, v, q_offset=0):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 TB")

    monkeypatch.setitem(ATTENTION_IMPLS, "naive", oom)
    rows = ac.measure_attention([8], n_head=1, head_dim=4, warmup=0, repeats=1)
    assert rows[0]["error"] == "out of memory" and rows[0]["peak_bytes"] is None
    assert rows[1]["error"] is None   # sdpa still ran

    def broken(q, k, v, q_offset=0):
        raise RuntimeError("shape mismatch")

    monkeypatch.setitem(ATTENTION_IMPLS, "naive", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        ac.measure_attention([8], n_head=1, head_dim=4, warmup=0, repeats=1)


def test_sdpa_kernel_name_is_an_sdpa_op():
    assert "scaled_dot_product" in ac.sdpa_kernel_name(*ac.make_qkv(64, n_head=2, head_dim=16))


# ---- labutils.model.kernels.tiled: online-softmax attention by hand ---------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labutils.model.kernels import (attention_weights, causal_tile_counts, model_attention_weights,
                                    skipped_tile_fraction, tile_is_masked, tiled_attention)


@settings(max_examples=60)
@given(batch=st.integers(1, 2), n_kv=st.integers(1, 2), group=st.integers(1, 2), t=st.integers(1, 70),
       d=st.integers(1, 12), block_q=st.integers(1, 40), block_k=st.integers(1, 40), causal=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_tiled_equals_sdpa(batch, n_kv, group, t, d, block_q, block_k, causal, seed):
    q, k, v = qkv(batch, n_kv * group, n_kv, t, t, d, torch.float32, seed)
    got = tiled_attention(q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max().item()


@pytest.mark.parametrize("n_head,n_kv_head,tq,tk,q_offset", CASES)
def test_tiled_with_offset_queries_equals_reference(n_head, n_kv_head, tq, tk, q_offset):
    """Decode steps and later prefill chunks: queries at q_offset.. over a longer key buffer."""
    q, k, v = qkv(2, n_head, n_kv_head, tq, tk, 8, torch.float64)
    got = tiled_attention(q, k, v, causal=True, block_q=3, block_k=4, q_offset=q_offset)
    assert (got - reference(q, k, v, q_offset)).abs().max().item() < 1e-10


@settings(max_examples=80)
@given(t=st.integers(1, 300), block_q=st.integers(1, 80), block_k=st.integers(1, 80))
def test_skipped_tiles_match_the_mask_and_the_kernel(t, block_q, block_k):
    """A tile counts as skipped exactly when the causal mask is False on all of it, and the kernel skips those."""
    mask = causal_mask(t, t)
    brute = sum(not mask[qs:qs + block_q, ks:ks + block_k].any()
                for qs in range(0, t, block_q) for ks in range(0, t, block_k))
    skipped, total = causal_tile_counts(t, block_q, block_k)
    assert skipped == brute and total == math.ceil(t / block_q) * math.ceil(t / block_k)
    if t <= 80:   # the kernel itself, on shapes cheap enough to run many times
        stats = {}
        q, k, v = qkv(1, 1, 1, t, t, 2, torch.float32)
        tiled_attention(q, k, v, block_q=block_q, block_k=block_k, stats=stats)
        assert (stats["tiles_skipped"], stats["tiles_computed"]) == (skipped, total - skipped)


def test_skipped_fraction_tends_to_a_half():
    assert skipped_tile_fraction(64, 64, 64) == 0                 # one tile, on the diagonal
    assert skipped_tile_fraction(256, 64, 64) == 6 / 16           # n blocks: n(n-1)/2 of n^2
    assert 0.49 < skipped_tile_fraction(8192, 64, 64) < 0.5
    assert tile_is_masked(0, 64, 64) and not tile_is_masked(0, 64, 63)
    assert not tile_is_masked(0, 1, 5, q_offset=5)                # a decode query sees its own key


def test_tiled_holds_only_tiles():
    """The largest score block is one tile, and the measured peak stays far below one [T, T] score matrix."""
    q, k, v = ac.make_qkv(512, n_head=2, head_dim=16)
    stats = {}
    peak, _ = ac.peak_memory_bytes(lambda: tiled_attention(q, k, v, block_q=32, block_k=64, stats=stats), "cpu")
    assert stats["largest_scores"] == (32, 64)
    out_bytes = q.numel() * q.element_size()
    assert peak < out_bytes + ac.score_matrix_bytes(512, 2) / 8
    naive_peak, _ = ac.peak_memory_bytes(lambda: naive_attention(q, k, v), "cpu")
    assert naive_peak > 4 * peak


def test_tiled_refuses_bad_arguments():
    q, k, v = qkv(1, 2, 2, 5, 5, 4, torch.float32)
    with pytest.raises(ValueError, match="block_q must be >= 1, got 0; tiles hold at least one query"):
        tiled_attention(q, k, v, block_q=0)
    with pytest.raises(TypeError, match="block_k must be an int"):
        tiled_attention(q, k, v, block_k=2.5)
    with pytest.raises(TypeError, match="causal must be True or False"):
        tiled_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match=r"q must be a 4-D tensor.*got \(5, 4\)"):
        tiled_attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match="k and v must share one shape"):
        tiled_attention(q, k, v[..., :3, :])
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        causal_tile_counts(0)


# ---- attention weights, and a trained model's --------------------------------------------------------

def test_attention_weights_are_causal_rows_that_sum_to_one():
    q, k, v = qkv(1, 4, 2, 6, 6, 8, torch.float64)
    w = attention_weights(q, k)
    assert w.shape == (1, 4, 6, 6)
    assert torch.equal(w.triu(1), torch.zeros_like(w))
    assert torch.allclose(w.sum(-1), torch.ones(1, 4, 6, dtype=torch.float64))
    assert torch.allclose(w @ v.repeat_interleave(2, dim=1), naive_attention(q, k, v))


def test_model_attention_weights_rederive_the_layer():
    """Weights from the hook equal those computed by hand from the layer's input, and reproduce its output."""
    from labutils.model.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=16, n_layer=2, n_head=4, n_embd=16, n_kv_head=2)).eval()
    ids = [3, 1, 4, 1, 5, 9, 2]
    w = model_attention_weights(model, ids, layer=1)
    assert w.shape == (4, 7, 7)
    caught = {}
    model.blocks[1].attn.register_forward_hook(lambda m, inp, out: caught.update(x=inp[0], y=out))
    with torch.no_grad():
        model(torch.tensor([ids]))
        attn = model.blocks[1].attn
        q, k, v = attn.qkv(caught["x"][0]).split([16, 8, 8], dim=-1)
        q, k, v = (t.view(7, -1, 4).transpose(0, 1) for t in (q, k, v))
        by_hand = torch.softmax((q @ k.repeat_interleave(2, 0).transpose(-2, -1) / 2).masked_fill(
            ~causal_mask(7, 7), float("-inf")), dim=-1)
        y = attn.proj((w @ v.repeat_interleave(2, 0)).transpose(0, 1).reshape(7, 16))
    assert torch.allclose(w, by_hand, atol=1e-6)
    assert torch.allclose(y, caught["y"][0], atol=1e-6)
    with pytest.raises(ValueError, match=r"layer must be <= 1, got 2; this model has layers 0..1"):
        model_attention_weights(model, ids, layer=2)
    with pytest.raises(ValueError, match="ids must be one non-empty prompt"):
        model_attention_weights(model, [], layer=0)


def test_flash_traffic_rereads_k_and_v_once_per_query_block():
    one = 2 * 12 * 1024 * 64                      # bytes of one [12, 1024, 64] fp16 tensor
    assert ac.flash_traffic_bytes(1024, 12, 64, block_q=128, dtype=torch.float16) == 2 * one + 8 * 2 * one
    assert ac.flash_traffic_bytes(1000, 1, 4, block_q=128) == 2 * 4000 * 4 + 8 * 2 * 4000 * 4   # ceil(1000/128) = 8
    # One block holding every query reads each tensor exactly once: the QKVO minimum.
    assert ac.flash_traffic_bytes(256, 4, 32, block_q=256) == ac.qkvo_bytes(256, 4, 32)
    with pytest.raises(ValueError, match="block_q must be >= 1, got 0"):
        ac.flash_traffic_bytes(256, 4, 32, block_q=0)
    with pytest.raises(ValueError, match="head_dim must be >= 1, got 0"):
        ac.qkvo_bytes(256, 4, 0)


def test_cpu_memory_events_see_every_score_matrix_naive_writes():
    """Naive attention allocates four fp32 [T, T] tensors: scores, scaled, masked, probabilities."""
    q, k, v = ac.make_qkv(64, n_head=2, head_dim=8)
    s = ac.score_matrix_bytes(64, 2)
    events = ac.cpu_memory_events(lambda: naive_attention(q, k, v))
    assert sum(e == s for e in events) == 4
    assert sum(events) == 0                          # and everything, the output too, is freed again
    assert ac.cpu_memory_events(lambda: torch.ones(10)).count(40) == 1
    with pytest.raises(TypeError, match="fn must be a function of no arguments"):
        ac.cpu_memory_events(42)


def test_measure_causal_skip_times_four_runs_and_restores_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ms = ac.measure_causal_skip(96, n_head=1, head_dim=8, block=16, repeats=1)   # runs on one thread
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert list(ms) == ["tiled, causal", "tiled, full", "sdpa, causal", "sdpa, full"]
    assert all(t > 0 for t in ms.values())
    with pytest.raises(ValueError, match="block must be >= 1, got 0"):
        ac.measure_causal_skip(96, block=0)
    with pytest.raises(ValueError, match="threads must be >= 1, got 0"):
        ac.measure_causal_skip(96, threads=0)
