"""What GPT.forward asks of a KV cache: four verbs, so the model never asks which cache it holds.

Three caches answer them: lesson 06's `decode.kvcache.KVCache` (a Python position, attention causal by offset),
`decode.static_cache.StaticKVCache` (a device position and a mask, what a CUDA graph can replay) and
`serving.paged_cache.PackedBatch` (many requests end to end, each attending to its own blocks). Each cache
writes its new keys and values and attends in its own way, as mini-sglang's attention backends do; this is
also the one place a cache may choose another attention kernel for its device.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Cache(Protocol):
    """A forward with a cache: check(model, ids) once per request, then begin(n) -> the new tokens' positions,
    attend(...) in every layer, advance(n) once every layer has written."""

    def check(self, model, ids: torch.Tensor) -> None:
        """Refuse ids (and a cache) this forward cannot take, with a message that says how to fix it.
        May read device values (a host sync): GPT.forward(check=True) calls it, never the per-token loop."""

    def begin(self, n_new: int) -> torch.Tensor:
        """Called once per forward, before any layer: the positions of the n_new new tokens (RoPE and the
        learned position table read them)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """Store this forward's k, v [batch, n_kv_head, n_new, head_dim] for `layer`, then return q's attention
        over every key the cache holds for it: [batch, n_head, n_new, head_dim]. `impl` is the model's kernel."""

    def advance(self, n: int) -> None:
        """Called once per forward, after every layer: the n new positions now count as written."""


__all__ = ["Cache"]
