"""The lesson-06 KV cache: preallocated keys and values, one position for the whole batch.

Its byte counts live in labutils.perf.roofline (kv_cache_bytes, kv_bytes_per_token).
"""
from __future__ import annotations

import dataclasses

import torch

from labutils.core.validate import (DEVICE_KINDS, DoesNotFitError, check_cache, check_count, check_device,
                                    describe, parse_dtype)
from labutils.model.kernels.attention import attention


def cache_args(config, batch_size, max_len, device, dtype):
    """Check a cache's arguments, one rule for every cache: (batch_size, max_len, device, dtype), normalized.

    A cache that could never be allocated (more bytes than free memory, or than int64 counts) is
    refused here, by name, before torch tries.
    """
    if not hasattr(config, "context_length"):
        got = "a model: pass its .config" if hasattr(config, "config") else describe(config)
        raise TypeError(f"a KV cache takes the model's config, KVCache(model.config, batch_size, max_len), got {got}")
    max_len = config.context_length if max_len is None else max_len
    max_len = check_count("max_len", max_len, 1, config.context_length,
                          hint=f"it exceeds the context length {config.context_length}; the position table "
                               "has no row for later positions")
    batch_size = check_count("batch_size", batch_size, 1)
    device = None if device is None else check_device("device", device, DEVICE_KINDS + ("meta",))
    dtype = parse_dtype("dtype", dtype)
    need = _cache_bytes(config, batch_size, max_len, dtype)
    free = None
    if need < 2 ** 62 and (device is None or device.type != "meta"):
        from labutils.core.devices import free_memory_bytes
        free = free_memory_bytes(device or "cpu")
    if need >= 2 ** 62 or (free is not None and need > free):
        raise DoesNotFitError(does_not_fit(config, batch_size, max_len, device, dtype, free))
    return batch_size, max_len, device, dtype


def _cache_bytes(config, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
    from labutils.perf.roofline import kv_cache_bytes
    if getattr(config, "sliding_window", None) is not None:
        # These buffers keep all max_len positions (no rolling buffer: the course's GPT attends to every one),
        # so a preset's sliding window does not shrink them.
        config = dataclasses.replace(config, sliding_window=None)
    return kv_cache_bytes(config, max_len, batch_size, dtype)      # any dtype a cache takes counts at its itemsize


def does_not_fit(config, batch_size, max_len, device, dtype, free=None) -> str:
    """The message for a cache that memory cannot hold: its size, what is free, and what to shrink."""
    need = _cache_bytes(config, batch_size, max_len, dtype)
    size = f"{need / 2**30:,.1f} GiB" if need >= 2**30 else f"{need / 2**20:,.1f} MiB"
    room = f" ({free / 2**30:,.1f} GiB free)" if free is not None else ""
    return (f"a KV cache of {size} (batch_size={batch_size} x max_len={max_len}, {dtype}) does not "
            f"fit on {torch.device(device or 'cpu')}{room}. Ask for a smaller batch_size or max_len (fewer new "
            "tokens), or a 16-bit dtype")


class KVBuffers:
    """What every cache with k and v buffers [n_layer, batch, n_kv_head, max_len, head_dim] shares."""

    k: torch.Tensor
    v: torch.Tensor

    def _allocate(self, config, batch_size: int, max_len: int, device, dtype, make=torch.empty) -> None:
        """Both buffers, made with `make` (torch.empty or torch.zeros); out of memory says what to shrink."""
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        try:
            self.k = make(shape, device=device, dtype=dtype)
            self.v = make(shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as err:
            from labutils.core.devices import is_oom
            if not is_oom(err):
                raise
            raise DoesNotFitError(does_not_fit(config, batch_size, max_len, device, dtype)) from None

    def check(self, model, ids: torch.Tensor) -> None:
        """model.cache.Cache's check: built for this model (layers, heads, dtype, device), ids in its vocab, and
        room for them. It reads `pos`, a host sync for a static cache: once per request, never per token."""
        check_cache(self, model)
        model.check_ids(ids, int(self.pos))
        self.check_fits(ids.shape[0], ids.shape[1])

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers: roofline.kv_cache_bytes(config, max_len, batch_size, dtype), every position kept."""
        return self.k.nbytes + self.v.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def __repr__(self) -> str:
        n_layer, B, n_kv, L, hd = self.k.shape
        # A position kept on the device is not printed: reading it would be a host sync.
        pos = f"pos={self.pos}, " if isinstance(self.pos, int) else ""
        return (f"{type(self).__name__}(n_layer={n_layer}, batch_size={B}, n_kv_head={n_kv}, max_len={L}, "
                f"head_dim={hd}, {pos}dtype={self.dtype}, nbytes={self.nbytes:,})")


class KVCache(KVBuffers):
    """Preallocated keys and values for every layer: [n_layer, batch, n_kv_head, max_len, head_dim].

    Static shapes, written in place: nothing is allocated while decoding, which is what later
    makes CUDA graphs possible. `pos` counts the positions already written.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None,
                 device=None, dtype=torch.float32):
        batch_size, max_len, device, dtype = cache_args(config, batch_size, max_len, device, dtype)
        # empty, not zeros: attention only ever reads positions < pos, which have been written.
        self._allocate(config, batch_size, max_len, device, dtype, torch.empty)
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0

    def clone(self) -> "KVCache":
        """An independent copy (buffers and position), e.g. to try a step without touching this cache."""
        other = object.__new__(KVCache)
        other.k, other.v = self.k.clone(), self.v.clone()
        other.batch_size, other.max_len, other.pos = self.batch_size, self.max_len, self.pos
        return other

    def check_fits(self, batch_size: int, n_new: int) -> None:
        """Refuse a forward whose batch differs from the cache's, or whose new tokens do not fit."""
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} sequences does not match the cache's batch_size={self.batch_size}")
        if self.pos + n_new > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; {self.pos} used, {n_new} more do not fit. "
                             "Make a larger KVCache (max_len) or reset() it")

    def begin(self, n_new: int) -> torch.Tensor:
        """Called once per forward, before any layer: the absolute positions [n_new] of the new tokens."""
        return torch.arange(self.pos, self.pos + n_new, device=self.device)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's keys/values at [pos, pos+T) and return all of them so far."""
        end = self.pos + k.shape[2]
        # Plain ints, no host sync: cheap enough for every step. A batch-1 k would otherwise
        # broadcast silently into every row of a larger cache.
        if end > self.max_len or k.shape[0] != self.batch_size:
            self.check_fits(k.shape[0], k.shape[2])
        keys, values = self.k[layer, :, :, :end], self.v[layer, :, :, :end]   # each view made once
        keys[:, :, self.pos:] = k
        values[:, :, self.pos:] = v
        return keys, values

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """model.cache.Cache's attend: write k, v at pos, then q over the written prefix, causal by offset (the new
        queries sit at pos onwards; no mask is built, the slice grows each step)."""
        offset = self.pos
        keys, values = self.update(layer, k, v)
        return attention(q, keys, values, q_offset=offset, impl=impl)

    def advance(self, n: int) -> None:
        """Called once per forward, after every layer has written its entries."""
        n = check_count("n", n, 0)
        if self.pos + n > self.max_len:
            raise ValueError(f"cannot advance the cache by {n} from pos={self.pos}: it holds {self.max_len} positions")
        self.pos += n

    def reset(self) -> None:
        self.pos = 0


__all__ = ["KVBuffers", "KVCache", "cache_args", "does_not_fit"]
