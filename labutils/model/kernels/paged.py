"""Paged attention, the reference way: gather each request's KV blocks into one contiguous run, then SDPA.

A paged KV cache keeps every layer's keys (and values) in one pool of fixed-size blocks,
[n_slots, n_kv_head, head_dim] with slot = block * block_size + offset. A request owns a *block
table*, the list of its blocks in position order, so its key at position p lives in slot
table[p // block_size] * block_size + p % block_size. Production engines read the blocks inside
a fused kernel (vLLM's paged attention); this reference copies them out first, which costs one
extra pass over the request's cache but is easy to check against dense attention on CPU.
"""
from __future__ import annotations

import torch

from labutils.model.kernels.attention import attention


def gather_blocks(pool: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """One layer's pool [n_slots, n_kv_head, head_dim], each row's blocks in table order -> [batch, n_kv_head, L, head_dim].

    It copies whole blocks (block_size x n_kv_head x head_dim contiguous values each), which on a
    CPU is several times faster than picking the same values slot by slot.
    """
    B, nb = block_tables.shape
    blocks = pool.view(-1, block_size, *pool.shape[1:]).index_select(0, block_tables.flatten())
    return blocks.view(B, nb * block_size, *pool.shape[1:]).transpose(1, 2)


def paged_mask(positions: torch.Tensor, n_keys: int) -> torch.Tensor:
    """[batch, 1, Tq, n_keys] bool: query at positions[b, i] may see the keys at positions <= it.

    Gathered keys sit in position order, so key index = key position; the padding past a request's
    own length is always later than its queries, so the same rule hides it.
    """
    keys = torch.arange(n_keys, device=positions.device)
    return (keys[None, None, :] <= positions[:, :, None])[:, None]


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    positions: torch.Tensor, block_size: int, impl: str = "sdpa") -> torch.Tensor:
    """Attention of q [batch, n_head, Tq, head_dim] over each request's blocks in the pools.

    block_tables [batch, n_blocks] (rows padded with any valid block), positions [batch, Tq] (each
    query's absolute position). Equal to dense causal attention over the request's own keys.
    """
    k, v = gather_blocks(k_pool, block_tables, block_size), gather_blocks(v_pool, block_tables, block_size)
    return attention(q, k, v, impl=impl, mask=paged_mask(positions, k.shape[2]))


__all__ = ["gather_blocks", "paged_attention", "paged_mask"]
