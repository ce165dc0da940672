"""A KV cache with static shapes and a device-side position: what a CUDA graph can replay."""
from __future__ import annotations

import torch

from labutils.decode.kvcache import KVBuffers, cache_args
from labutils.model.kernels.attention import attention


class StaticKVCache(KVBuffers):
    """Keys and values for every layer, [n_layer, batch, n_kv_head, max_len, head_dim], plus `pos` on the device.

    Lesson 06's KVCache keeps `pos` as a Python int and hands attention a slice that grows every
    step. Both change between steps, so a CUDA graph or torch.compile would have to capture a new
    step each time. Here nothing the step reads changes shape or lives on the host:
    - `pos` is a 0-d long tensor on the cache's device; advance() adds to it in place;
    - update() writes at `pos` with index_copy_ and returns the whole buffer;
    - `mask` ([n_new, max_len] bool, built from `pos` in begin()) hides the keys not written yet.
    The buffers are zeroed, not empty: a masked probability of 0 times a NaN left by torch.empty
    is still NaN.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None, device=None,
                 dtype=torch.float32):
        batch_size, max_len, device, dtype = cache_args(config, batch_size, max_len, device, dtype)
        self._allocate(config, batch_size, max_len, device, dtype, torch.zeros)
        self.pos = torch.zeros((), dtype=torch.long, device=self.k.device)
        self._key_pos = torch.arange(max_len, device=self.k.device)   # made once: no per-step arange
        self.batch_size, self.max_len = batch_size, max_len
        self.mask: torch.Tensor | None = None
        self._write_at: torch.Tensor | None = None

    def check_fits(self, batch_size: int, n_new: int) -> None:
        """Validation for GPT.forward(check=True). It reads `pos`, a host sync: never call it per token."""
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} sequences does not match the cache's batch_size={self.batch_size}")
        used = int(self.pos)
        if used + n_new > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; {used} used, {n_new} more do not fit. "
                             "Make a larger StaticKVCache (max_len) or reset() it")

    def begin(self, n_new: int) -> torch.Tensor:
        """Called once per forward, before any layer: positions [n_new] of the new tokens, on the device.

        It also prepares this forward's write index and mask, so the layers share one of each.
        """
        positions = self.pos + self._key_pos[:n_new]
        self._write_at = positions
        self.mask = self._key_pos[None, :] <= positions[:, None]    # key j is visible from query i
        return positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this forward's keys/values at begin()'s positions; return the whole buffers [batch, n_kv, max_len, hd]."""
        keys, values = self.k[layer], self.v[layer]      # each view made once: every op is host time on a GPU
        keys.index_copy_(2, self._write_at, k)
        values.index_copy_(2, self._write_at, v)
        return keys, values

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """model.cache.Cache's attend: write k, v at begin()'s positions, then q over the whole buffer, begin()'s
        mask hiding the keys not written yet (the same shapes every step, so a graph can replay it)."""
        keys, values = self.update(layer, k, v)
        return attention(q, keys, values, impl=impl, mask=self.mask)

    def advance(self, n: int) -> None:
        """Called once per forward, after every layer: `pos += n` on the device, with no host check."""
        self.pos.add_(n)

    def reset(self) -> None:
        """Back to an empty cache; zeroed again, so nothing from an earlier request (inf, NaN) can leak."""
        self.pos.zero_()
        self.k.zero_()
        self.v.zero_()


__all__ = ["StaticKVCache"]
