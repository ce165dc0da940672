"""What attention costs as the sequence grows: time, peak memory and score-matrix bytes, naive vs SDPA."""
from __future__ import annotations

import contextlib
import math
import os

import torch

from labutils.model.kernels import ATTENTION_IMPLS
from labutils.core.devices import is_oom
from labutils.core.dtypes import dtype_bytes
from labutils.core.progress_bar import progress
from labutils.perf.timing import synchronize, time_fn, torch_threads
from labutils.core.validate import check_count, check_device, describe

# Standard (unfused) attention moves the [T, T] matrix through main memory four times: QK^T writes
# the scores S, the softmax reads S and writes the probabilities P, and P @ V reads P. A fused kernel
# (FlashAttention) keeps each tile of S and P in on-chip memory, so none of those trips happen.
SCORE_PASSES = {"naive": 4, "sdpa": 0}


def score_matrix_bytes(seq_len: int, n_head: int, batch_size: int = 1, dtype=torch.float32,
                       n_queries: int | None = None) -> int:
    """Bytes of one [batch, n_head, n_queries, seq_len] score matrix (n_queries defaults to seq_len)."""
    n_queries = seq_len if n_queries is None else n_queries
    for name, value in (("seq_len", seq_len), ("n_head", n_head), ("batch_size", batch_size), ("n_queries", n_queries)):
        check_count(name, value, 1)
    return batch_size * n_head * n_queries * seq_len * dtype_bytes(dtype)


def score_traffic_bytes(seq_len: int, n_head: int, batch_size: int = 1, dtype=torch.float32,
                        impl: str = "naive") -> int:
    """Score-matrix bytes written to and read back from main memory by one causal prefill."""
    if impl not in SCORE_PASSES:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(SCORE_PASSES)}")
    return SCORE_PASSES[impl] * score_matrix_bytes(seq_len, n_head, batch_size, dtype)


def qkvo_bytes(seq_len: int, n_head: int, head_dim: int, batch_size: int = 1, dtype=torch.float32) -> int:
    """Read Q, K and V once and write the output once: the least any exact attention must move."""
    for name, value in (("seq_len", seq_len), ("n_head", n_head), ("head_dim", head_dim), ("batch_size", batch_size)):
        check_count(name, value, 1)
    return 4 * batch_size * n_head * seq_len * head_dim * dtype_bytes(dtype)


def flash_traffic_bytes(seq_len: int, n_head: int, head_dim: int, block_q: int = 128, batch_size: int = 1,
                        dtype=torch.float32) -> int:
    """Bytes a FlashAttention-style kernel moves: Q read and O written once, K and V read once per query block."""
    block_q = check_count("block_q", block_q, 1, hint="a query block holds at least one query")
    one = qkvo_bytes(seq_len, n_head, head_dim, batch_size, dtype) // 4    # one [B, H, T, d] tensor
    return 2 * one + math.ceil(seq_len / block_q) * 2 * one


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ backend prints start/stop lines straight to file descriptor 2; hide them."""
    try:
        saved = os.dup(2)
    except OSError:      # no real stderr (some embedded interpreters): nothing to hide
        yield
        return
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_memory_bytes(fn, device) -> tuple[int | None, str]:
    """Most bytes allocated at once while `fn()` runs, beyond what was allocated before; and how we know.

    CUDA: the caching allocator's own peak counter. CPU: every allocation and free that
    torch.profiler records, replayed in time order. Elsewhere (MPS) there is no peak counter: None.
    """
    device = check_device("device", device)
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        out = fn()
        synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) - before, "measured: torch.cuda.max_memory_allocated"
    if device.type == "cpu":
        current = peak = 0
        for nbytes in cpu_memory_events(fn):   # positive: an allocation; negative: a free
            current += nbytes
            peak = max(peak, current)
        return peak, "measured: torch.profiler allocation records (CPU)"
    return None, f"not measured: no peak-memory counter on {device.type}"


def cpu_memory_events(fn) -> list[int]:
    """Every allocation (+bytes) and free (-bytes) on the CPU while `fn()` runs, in time order, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    if not callable(fn):
        raise TypeError(f"fn must be a function of no arguments, got {type(fn).__name__}; wrap a call as lambda: f(x)")
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    return [nbytes for _, nbytes in events]


def sdpa_kernel_name(q, k, v) -> str:
    """Which kernel the course's SDPA call runs for these tensors (flash, efficient, cudnn, math): on CUDA the one it
    chose first that takes them (model.kernels.attention.CUDA_SDPA_BACKENDS), elsewhere PyTorch's pick."""
    from torch.profiler import ProfilerActivity, profile

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{name} must be a [batch, heads, seq, head_dim] tensor (make_qkv makes q, k, v), "
                            f"got {describe(t)}")
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        ATTENTION_IMPLS["sdpa"](q, k, v)
        synchronize(q.device)
    # The dispatcher's op is aten::scaled_dot_product_attention; the kernel it chose is aten::_scaled_dot_product_*.
    names = [e.key for e in prof.key_averages() if e.key.startswith("aten::_scaled_dot_product")]
    return max(names, key=len) if names else "aten::scaled_dot_product_attention"


def make_qkv(seq_len: int, n_head: int = 4, head_dim: int = 64, batch_size: int = 1, n_kv_head: int | None = None,
             device="cpu", dtype=torch.float32, seed: int = 0):
    """Random q [B, H, T, d] and k, v [B, n_kv_head, T, d], reproducible from `seed`."""
    device = check_device("device", device)          # "cuda" without a GPU: the course's message, not torch's
    n_kv_head = n_head if n_kv_head is None else n_kv_head
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch_size, n_head, seq_len, head_dim)] + 2 * [(batch_size, n_kv_head, seq_len, head_dim)]
    # Draw on the CPU so every device sees the same numbers, then move.
    return tuple(torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)


def measure_attention(seq_lens, *, n_head: int = 4, head_dim: int = 64, batch_size: int = 1, device="cpu",
                      dtype=torch.float32, impls=("naive", "sdpa"), warmup: int = 1, repeats: int = 3) -> list[dict]:
    """Time and peak memory of causal prefill attention for each sequence length and implementation.

    One row per (seq_len, impl): median_s, peak_bytes (+ memory_source saying how it was obtained),
    score_bytes (the formula for one score matrix), and error ("out of memory") when the run did not fit.
    """
    for impl in impls:
        if impl not in ATTENTION_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(ATTENTION_IMPLS)}")
    device = check_device("device", device)
    rows = []
    for seq_len in progress(list(seq_lens), desc="sequence lengths"):
        q, k, v = make_qkv(seq_len, n_head, head_dim, batch_size, device=device, dtype=dtype)
        for impl in impls:
            fn = ATTENTION_IMPLS[impl]
            row = dict(impl=impl, seq_len=seq_len, n_head=n_head, head_dim=head_dim, batch_size=batch_size,
                       dtype=str(dtype).removeprefix("torch."), device=device.type,
                       score_bytes=score_matrix_bytes(seq_len, n_head, batch_size, dtype),
                       median_s=math.nan, peak_bytes=None, memory_source="", error=None)
            try:
                row["median_s"] = time_fn(lambda: fn(q, k, v), device=device, warmup=warmup, repeats=repeats).median_s
                row["peak_bytes"], row["memory_source"] = peak_memory_bytes(lambda: fn(q, k, v), device)
            except (RuntimeError, MemoryError) as err:
                if not is_oom(err):
                    raise
                row["error"] = "out of memory"   # the point of the lesson, not a crash
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
        del q, k, v
    return rows


def measure_causal_skip(seq_len: int = 2048, *, n_head: int = 4, head_dim: int = 64, block: int = 128,
                        device="cpu", threads: int | None = 1, repeats: int = 3) -> dict[str, float]:
    """Median ms of causal vs full attention, for the hand-written tiled kernel and for SDPA.

    The causal runs skip the fully masked tiles, so causal / full shows what skipping saves in time.
    `threads=1` on a CPU by default: the tiled kernel issues thousands of small products, and with
    more threads than free cores each one waits on the others, which swamps the effect being measured.
    """
    from labutils.model.kernels import sdpa, tiled_attention

    seq_len = check_count("seq_len", seq_len, 1)
    block = check_count("block", block, 1, hint="a tile holds at least one query and one key")
    threads = None if threads is None else check_count("threads", threads, 1)
    q, k, v = make_qkv(seq_len, n_head, head_dim, device=device)
    runs = {"tiled, causal": lambda: tiled_attention(q, k, v, block_q=block, block_k=block),
            "tiled, full": lambda: tiled_attention(q, k, v, causal=False, block_q=block, block_k=block),
            "sdpa, causal": lambda: sdpa(q, k, v, is_causal=True),
            "sdpa, full": lambda: sdpa(q, k, v)}
    with torch_threads(threads if torch.device(device).type == "cpu" else None):
        return {name: time_fn(fn, device=device, warmup=1, repeats=repeats).median_s * 1e3
                for name, fn in runs.items()}
