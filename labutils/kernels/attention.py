"""Causal attention two ways: written out by hand (naive) and fused (PyTorch SDPA / FlashAttention).

Shapes: q is [batch, n_head, Tq, head_dim]; k and v are [batch, n_kv_head, Tk, head_dim].
`q_offset` is the absolute position of the first query. Prefill has q_offset=0 and Tq=Tk;
a decode step with a KV cache has one query at q_offset=Tk-1 that may look at every key.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def causal_mask(tq: int, tk: int, q_offset: int = 0, device=None) -> torch.Tensor:
    """[tq, tk] bool, True where query i (absolute position q_offset+i) may attend to key j."""
    rows = torch.arange(tq, device=device)[:, None] + q_offset
    cols = torch.arange(tk, device=device)[None, :]
    return cols <= rows


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """GQA/MQA: each group of query heads shares one KV head; copy KV heads up to the query count."""
    n_head, n_kv = q.shape[1], k.shape[1]
    if n_head % n_kv:
        raise ValueError(f"n_head={n_head} is not a multiple of n_kv_head={n_kv}")
    if n_head == n_kv:
        return k, v
    rep = n_head // n_kv
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def naive_attention(q, k, v, q_offset: int = 0) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + causal mask) V, with the full [Tq, Tk] score matrix in memory."""
    k, v = _repeat_kv(q, k, v)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    allowed = causal_mask(q.shape[-2], k.shape[-2], q_offset, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa_attention(q, k, v, q_offset: int = 0) -> torch.Tensor:
    """The same maths through one fused call, which never writes the score matrix to memory on GPU."""
    k, v = _repeat_kv(q, k, v)
    tq, tk = q.shape[-2], k.shape[-2]
    if tk == q_offset + tq and tq == 1:
        # A decode step: the single query is the newest position and may see every key.
        return F.scaled_dot_product_attention(q, k, v)
    if q_offset == 0 and tq == tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # is_causal aligns the mask top-left, which is wrong for an offset query block: pass it explicitly.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(tq, tk, q_offset, q.device))


ATTENTION_IMPLS = {"naive": naive_attention, "sdpa": sdpa_attention}


def attention(q, k, v, q_offset: int = 0, impl: str = "sdpa") -> torch.Tensor:
    """Dispatch to one implementation by name; both give the same numbers."""
    try:
        fn = ATTENTION_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(ATTENTION_IMPLS)}") from None
    return fn(q, k, v, q_offset)
