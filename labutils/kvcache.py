"""The static KV cache, and the calculator for how many bytes a cache takes."""
from __future__ import annotations

import torch

from .presets import PRESETS, ModelShape, get_shape

# Bytes per element for the cache dtypes the calculator offers. fp8 and int8 caches store one byte.
DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
_TORCH_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "int8"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _TORCH_NAMES[getattr(torch, _name)] = "fp8"


def dtype_bytes(dtype) -> int:
    """Bytes per element for a torch dtype or one of "fp32", "fp16", "bf16", "fp8", "int8"."""
    name = _TORCH_NAMES.get(dtype, dtype)
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown cache dtype {dtype!r}; choose one of {list(DTYPE_BYTES)} or a torch dtype")
    return DTYPE_BYTES[name]


def kv_cache_bytes(config_or_preset, seq_len: int, batch_size: int = 1, dtype=torch.float16) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes x seq_len x batch."""
    shape = get_shape(config_or_preset) if isinstance(config_or_preset, str) else config_or_preset
    if seq_len < 0 or batch_size < 1:
        raise ValueError(f"need seq_len >= 0 and batch_size >= 1, got seq_len={seq_len}, batch_size={batch_size}")
    return 2 * shape.n_layer * shape.n_kv_head * shape.head_dim * dtype_bytes(dtype) * seq_len * batch_size


def weight_bytes(preset: str | ModelShape, dtype=torch.float16) -> int:
    """Bytes of the published parameter count at `dtype`: what every decode step must read."""
    shape = get_shape(preset) if isinstance(preset, str) else preset
    return shape.n_params * dtype_bytes(dtype)


class KVCache:
    """Preallocated keys and values for every layer: [n_layer, batch, n_kv_head, max_len, head_dim].

    Static shapes, written in place: nothing is allocated while decoding, which is what later
    makes CUDA graphs possible. `pos` counts the positions already written.
    """

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None,
                 device=None, dtype=torch.float32):
        max_len = config.context_length if max_len is None else max_len
        if not 1 <= max_len <= config.context_length:
            raise ValueError(f"max_len={max_len} must be between 1 and the context length {config.context_length}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        # empty, not zeros: attention only ever reads positions < pos, which have been written.
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def check_fits(self, batch_size: int, n_new: int) -> None:
        if batch_size != self.batch_size:
            raise ValueError(f"batch of {batch_size} sequences does not match the cache's batch_size={self.batch_size}")
        if self.pos + n_new > self.max_len:
            raise ValueError(f"cache holds {self.max_len} positions; {self.pos} used, {n_new} more do not fit. "
                             "Make a larger KVCache (max_len) or reset() it")

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write this step's keys/values at [pos, pos+T) and return all of them so far."""
        end = self.pos + k.shape[2]
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Called once per forward, after every layer has written its entries."""
        self.pos += n

    def reset(self) -> None:
        self.pos = 0


__all__ = ["DTYPE_BYTES", "KVCache", "PRESETS", "dtype_bytes", "kv_cache_bytes", "weight_bytes"]
