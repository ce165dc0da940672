"""Online-softmax tiled attention written by hand (the FlashAttention idea): exact, and no [Tq, Tk] matrix.

Keys and values arrive one tile at a time. Each query row keeps three running things: the largest
score seen so far (m), the sum of exp(score - m) so far (l) and the output accumulator (acc, the
same exponentials times V). When a new tile raises the maximum, what was summed under the old one is
multiplied by exp(m_old - m_new), so at the end acc / l is exactly softmax(scores) @ V. The largest
score block alive at any moment is [block_q, block_k] per head.
"""
from __future__ import annotations

import math

import torch

from labutils.core.validate import check_count, check_flag
from labutils.model.kernels.attention import _causal_mask, _repeat_kv


def tile_is_masked(q_start: int, q_stop: int, k_start: int, q_offset: int = 0) -> bool:
    """True when every (query, key) pair of the tile lies in the future: its first key comes after its last query.

    Queries q_start..q_stop-1 sit at absolute positions q_offset + i; keys start at k_start.
    A causal kernel skips such a tile outright: no multiply-adds, no exponentials.
    """
    return k_start > q_offset + q_stop - 1


def causal_tile_counts(seq_len: int, block_q: int = 64, block_k: int = 64) -> tuple[int, int]:
    """(tiles skipped, tiles in the grid) for causal prefill of seq_len tokens in block_q x block_k tiles."""
    seq_len = check_count("seq_len", seq_len, 1)
    block_q = check_count("block_q", block_q, 1, hint="tiles hold at least one query")
    block_k = check_count("block_k", block_k, 1, hint="tiles hold at least one key")
    q_starts, k_starts = range(0, seq_len, block_q), range(0, seq_len, block_k)
    skipped = sum(tile_is_masked(qs, min(qs + block_q, seq_len), ks) for qs in q_starts for ks in k_starts)
    return skipped, len(q_starts) * len(k_starts)


def skipped_tile_fraction(seq_len: int, block_q: int = 64, block_k: int = 64) -> float:
    """Share of the tile grid a causal kernel never computes: 0 for one tile, towards 1/2 for long sequences."""
    skipped, total = causal_tile_counts(seq_len, block_q, block_k)
    return skipped / total


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [batch, heads, seq, head_dim], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape != v.shape or k.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0] or k.shape[-2] < 1:
        raise ValueError(f"k and v must share one shape [batch, n_kv_head, Tk >= 1, head_dim] matching q's batch "
                         f"and head_dim; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def tiled_attention(q, k, v, *, causal: bool = True, block_q: int = 64, block_k: int = 64, q_offset: int = 0,
                    stats: dict | None = None) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) [+ causal mask]) V, tile by tile. Same shapes and maths as naive_attention.

    `q_offset` is the absolute position of the first query, as in naive_attention (causal only).

    `stats`, when given a dict, is filled with tiles_computed, tiles_skipped and largest_scores (the
    shape of the biggest score block the kernel held), so a lesson can show what was never built.
    """
    _check_qkv(q, k, v)
    causal = check_flag("causal", causal)
    block_q = check_count("block_q", block_q, 1, hint="tiles hold at least one query")
    block_k = check_count("block_k", block_k, 1, hint="tiles hold at least one key")
    q_offset = check_count("q_offset", q_offset, 0)
    k, v = _repeat_kv(q, k, v)
    tq, tk = q.shape[-2], k.shape[-2]
    out = torch.empty_like(q)
    counts = dict(tiles_computed=0, tiles_skipped=0, largest_scores=(0, 0))
    for qs in range(0, tq, block_q):
        qe = min(qs + block_q, tq)
        q_tile = q[..., qs:qe, :] / math.sqrt(q.shape[-1])
        m = torch.full((*q.shape[:2], qe - qs, 1), float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)
        acc = torch.zeros_like(q_tile)
        for ks in range(0, tk, block_k):
            if causal and tile_is_masked(qs, qe, ks, q_offset):
                counts["tiles_skipped"] += 1       # no multiply-adds at all for this tile
                continue
            ke = min(ks + block_k, tk)
            s = q_tile @ k[..., ks:ke, :].transpose(-2, -1)     # [B, H, block_q, block_k]: the only scores alive
            if causal and ke - 1 > q_offset + qs:              # the tile crosses the diagonal: mask inside it
                s = s.masked_fill(~_causal_mask(qe - qs, ke - ks, q_offset + qs - ks, q.device), float("-inf"))
            # Key 0 is visible to every query and comes first, so m is finite from the first tile on.
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            rescale = torch.exp(m - m_new)     # what was summed under the old maximum, brought to the new one
            l = l * rescale + p.sum(dim=-1, keepdim=True)
            acc = acc * rescale + p @ v[..., ks:ke, :]
            m = m_new
            counts["tiles_computed"] += 1
            counts["largest_scores"] = max(counts["largest_scores"], tuple(s.shape[-2:]), key=math.prod)
        out[..., qs:qe, :] = acc / l
    if stats is not None:
        stats.update(counts)
    return out
