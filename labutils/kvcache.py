"""The lesson-06 KV cache: preallocated keys and values, one position for the whole batch.

Its byte counts live in labutils.roofline (kv_cache_bytes, kv_bytes_per_token).
"""
from __future__ import annotations

import torch

from .validate import DEVICE_KINDS, check_count, check_device, check_torch_dtype


class KVCache:
    """Preallocated keys and values for every layer: [n_layer, batch, n_kv_head, max_len, head_dim].

    Static shapes, written in place: nothing is allocated while decoding, which is what later
    makes CUDA graphs possible. `pos` counts the positions already written.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None,
                 device=None, dtype=torch.float32):
        max_len = config.context_length if max_len is None else max_len
        max_len = check_count("max_len", max_len, 1, config.context_length,
                              hint=f"a cache holds at most the context length {config.context_length}")
        batch_size = check_count("batch_size", batch_size, 1)
        device = None if device is None else check_device("device", device, DEVICE_KINDS + ("meta",))
        dtype = check_torch_dtype("dtype", dtype)
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        _check_room(config, batch_size, max_len, device, dtype)
        try:
            # empty, not zeros: attention only ever reads positions < pos, which have been written.
            self.k = torch.empty(shape, device=device, dtype=dtype)
            self.v = torch.empty(shape, device=device, dtype=dtype)
        except (RuntimeError, MemoryError) as err:
            from .hardware import is_oom
            if not is_oom(err):
                raise
            raise ValueError(_too_big(config, batch_size, max_len, device, dtype, None)) from None
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers: roofline.kv_cache_bytes(config, max_len, batch_size, dtype)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def __repr__(self) -> str:
        n_layer, B, n_kv, L, hd = self.k.shape
        return (f"KVCache(n_layer={n_layer}, batch_size={B}, n_kv_head={n_kv}, max_len={L}, head_dim={hd}, "
                f"pos={self.pos}, dtype={self.dtype}, nbytes={self.nbytes:,})")

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

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's keys/values at [pos, pos+T) and return all of them so far."""
        end = self.pos + k.shape[2]
        # Plain ints, no host sync: cheap enough for every step. A batch-1 k would otherwise
        # broadcast silently into every row of a larger cache.
        if end > self.max_len or k.shape[0] != self.batch_size:
            self.check_fits(k.shape[0], k.shape[2])
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Called once per forward, after every layer has written its entries."""
        n = check_count("n", n, 0)
        if self.pos + n > self.max_len:
            raise ValueError(f"cannot advance the cache by {n} from pos={self.pos}: it holds {self.max_len} positions")
        self.pos += n

    def reset(self) -> None:
        self.pos = 0


def _cache_bytes(config, batch_size: int, max_len: int, dtype: torch.dtype) -> int:
    from .dtypes import TORCH_DTYPES
    from .roofline import kv_cache_bytes
    if dtype in TORCH_DTYPES.values():
        return kv_cache_bytes(config, max_len, batch_size, dtype)
    # float64 (precision checks) is outside the course's dtype table: the same count at its element size.
    return kv_cache_bytes(config, max_len, batch_size, "fp32") // 4 * dtype.itemsize


def _too_big(config, batch_size, max_len, device, dtype, free) -> str:
    need = _cache_bytes(config, batch_size, max_len, dtype)
    room = f", and {torch.device(device or 'cpu')} has {free / 2**30:,.1f} GiB free" if free is not None else ""
    return (f"a KV cache of batch_size={batch_size} x max_len={max_len} in {dtype} needs {need / 2**30:,.1f} GiB "
            f"for keys and values{room}; ask for a smaller batch_size or max_len, or a 2-byte dtype")


def _check_room(config, batch_size, max_len, device, dtype) -> None:
    """Refuse a cache that cannot exist before torch tries: more than free memory, or more elements than int64."""
    need = _cache_bytes(config, batch_size, max_len, dtype)
    if need >= 2 ** 62:
        raise ValueError(_too_big(config, batch_size, max_len, device, dtype, None))
    if device is not None and torch.device(device).type == "meta":
        return
    from .hardware import free_memory_bytes
    free = free_memory_bytes(device or "cpu")
    if free is not None and need > free:
        raise ValueError(_too_big(config, batch_size, max_len, device, dtype, free))


__all__ = ["KVCache"]
