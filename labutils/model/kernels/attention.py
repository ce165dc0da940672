"""Causal attention two ways: written out by hand (naive) and fused (PyTorch SDPA / FlashAttention).

Shapes: q is [batch, n_head, Tq, head_dim]; k and v are [batch, n_kv_head, Tk, head_dim].
`q_offset` is the absolute position of the first query. Prefill has q_offset=0 and Tq=Tk;
a decode step with a KV cache has one query at q_offset=Tk-1 that may look at every key.
`mask` ([Tq, Tk] bool, True = may attend; or [batch, 1, Tq, Tk] when each sequence sees its own keys)
replaces the offset: a static cache hands over its whole preallocated buffer, and a paged cache each
request's gathered blocks, and only the cache knows which of those keys are written yet.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from labutils.core.validate import DEVICE_KINDS, check_count, check_device

# On CUDA the course chooses SDPA's kernels itself, in this order, instead of leaving it to torch's heuristic.
# Recent torch prefers cuDNN's attention on Hopper, and cuDNN builds a new plan for every new sequence length: a
# decode loop with a growing cache meets a new length at every step, and on an H200 those rebuilds took 548 of
# 596 ms of lesson 08's profile (gpt2-small ITLs of about 70 ms, against 3.7 ms once each length had been seen).
# Flash and memory-efficient attention need no plan; math is the fallback any shape, dtype and mask can use.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def causal_mask(tq: int, tk: int, q_offset: int = 0, device=None) -> torch.Tensor:
    """[tq, tk] bool, True where query i (absolute position q_offset+i) may attend to key j."""
    tq, tk, q_offset = check_count("tq", tq), check_count("tk", tk), check_count("q_offset", q_offset)
    device = None if device is None else check_device("device", device, (*DEVICE_KINDS, "meta"))
    return _causal_mask(tq, tk, q_offset, device)


def _causal_mask(tq: int, tk: int, q_offset: int, device: torch.device) -> torch.Tensor:
    """causal_mask for the kernels, which pass their tensors' shapes and device as they are."""
    rows = torch.arange(tq, device=device)[:, None] + q_offset
    cols = torch.arange(tk, device=device)[None, :]
    return cols <= rows


def _group(q: torch.Tensor, k: torch.Tensor) -> int:
    """GQA/MQA: how many query heads share each KV head."""
    n_head, n_kv = q.shape[1], k.shape[1]
    if n_head % n_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv}")
    return n_head // n_kv


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Copy KV heads up to the query count: the readable way, at the price of group x the K/V bytes."""
    rep = _group(q, k)
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def attention_weights(q, k, q_offset: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + causal mask): [B, n_head, Tq, Tk], each row positive and summing to 1.

    The probabilities naive attention multiplies V by; lesson 03 also draws them as a heatmap.
    """
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(_group(q, k), dim=1)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    allowed = _causal_mask(q.shape[-2], k.shape[-2], q_offset, q.device) if mask is None else mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1)


def naive_attention(q, k, v, q_offset: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + causal mask) V, with the full [Tq, Tk] score matrix in memory."""
    k, v = _repeat_kv(q, k, v)
    return attention_weights(q, k, q_offset, mask) @ v


# torch before 2.6 takes the set but not the order; cuDNN is left out either way.
_ORDERED = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}


def sdpa(q, k, v, **kwargs) -> torch.Tensor:
    """The course's one call of F.scaled_dot_product_attention: on CUDA under CUDA_SDPA_BACKENDS, in that order."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(CUDA_SDPA_BACKENDS), **_ORDERED):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_choice(device) -> str:
    """The SDPA kernels the course allows on `device`, in its order, in words (lesson 03 prints it)."""
    if check_device("device", device).type != "cuda":
        return "PyTorch's own pick (the course chooses only on CUDA)"
    names = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
             SDPBackend.MATH: "math"}
    return (", then ".join(names[b] for b in CUDA_SDPA_BACKENDS)
            + "; never cuDNN's attention, which builds a new plan for every new sequence length")


def _groupedsdpa(q, k, v, mask: torch.Tensor) -> torch.Tensor:
    """Masked GQA without copying K/V: fold each group of query heads into the query axis.

    q [B, n_head, Tq, d] -> [B, n_kv, group * Tq, d], so every KV head meets its own queries;
    the mask repeats once per group. Fused kernels that take a mask but not unequal head counts
    (CUDA's memory-efficient kernel) still run, instead of a fallback that repeats K/V.
    """
    B, H, tq, d = q.shape
    group = _group(q, k)
    if group == 1:
        return sdpa(q, k, v, attn_mask=mask)
    qg = q.reshape(B, k.shape[1], group * tq, d)       # a view when tq == 1 (decode)
    if tq > 1:   # the query rows are now (group, tq): tile the mask's query axis to match
        mask = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)
    out = sdpa(qg, k, v, attn_mask=mask)
    # reshape, never view: the layout of a fused kernel's output is the kernel's choice. CUDA's return it as
    # [B, T, H, d] in memory seen as [B, H, T, d], where a view across the head axis raises; the CPU's never do.
    return out.reshape(B, H, tq, d)


def sdpa_attention(q, k, v, q_offset: int = 0, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The same maths through one fused call, which never writes the score matrix to memory on GPU.

    GQA reads each KV head once (`enable_gqa`, or a grouped view under a mask): no repeated copy,
    so the bytes moved match roofline.decode_bytes.
    """
    gqa = _group(q, k) > 1
    tq, tk = q.shape[-2], k.shape[-2]
    if mask is not None:
        return _groupedsdpa(q, k, v, mask)
    if tk == q_offset + tq and tq == 1:
        # A decode step: the single query is the newest position and may see every key.
        return sdpa(q, k, v, enable_gqa=gqa)
    if q_offset == 0 and tq == tk:
        return sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
    # is_causal aligns the mask top-left, which is wrong for an offset query block: pass it explicitly.
    return _groupedsdpa(q, k, v, _causal_mask(tq, tk, q_offset, q.device))


ATTENTION_IMPLS = {"naive": naive_attention, "sdpa": sdpa_attention}


def attention(q, k, v, q_offset: int = 0, impl: str = "sdpa", mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch to one implementation by name; both give the same numbers."""
    try:
        fn = ATTENTION_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(ATTENTION_IMPLS)}") from None
    return fn(q, k, v, q_offset) if mask is None else fn(q, k, v, q_offset, mask=mask)
