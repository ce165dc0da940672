"""The static KV cache, and the calculator for how many bytes a cache takes."""
from __future__ import annotations

import numbers

import torch

from .presets import PRESETS, get_shape

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


def _shape(config_or_preset):
    """A preset name, a ModelShape or a GPTConfig: anything with n_layer, n_kv_head and head_dim."""
    return get_shape(config_or_preset) if isinstance(config_or_preset, str) else config_or_preset


def check_count(name: str, value, minimum: int) -> None:
    """Refuse a token count, length or batch that is not an integer >= minimum."""
    # bool is an int subclass; True tokens is a typo, not 1.
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):   # numpy ints are fine
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def kv_bytes_per_token(config_or_preset, dtype=torch.float16) -> int:
    """Cache bytes one token adds to one sequence: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    shape = _shape(config_or_preset)
    return 2 * shape.n_layer * shape.n_kv_head * shape.head_dim * dtype_bytes(dtype)


def kv_cache_bytes(config_or_preset, seq_len: int, batch_size: int = 1, dtype=torch.float16) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes x seq_len x batch."""
    check_count("seq_len", seq_len, 0)
    check_count("batch_size", batch_size, 1)
    return kv_bytes_per_token(config_or_preset, dtype) * seq_len * batch_size


def weight_bytes(preset, dtype=torch.float16) -> int:
    """Bytes of the parameters at `dtype`: what every decode step must read.

    A preset uses its published parameter count; a GPTConfig counts its own.
    """
    shape = _shape(preset)
    n_params = shape.n_params if hasattr(shape, "n_params") else shape.num_params()
    return n_params * dtype_bytes(dtype)


def tokens_where_cache_exceeds_weights(preset, batch_size: int = 1, dtype=torch.float16,
                                       weight_dtype=torch.float16) -> int:
    """The smallest context (tokens per sequence) at which the batch's cache holds more bytes than the weights.

    It can lie beyond the model's context length: then the cache never overtakes the weights for
    one request, and only a larger batch makes it.
    """
    check_count("batch_size", batch_size, 1)
    per_step = kv_bytes_per_token(preset, dtype) * batch_size
    return weight_bytes(preset, weight_dtype) // per_step + 1


class KVCache:
    """Preallocated keys and values for every layer: [n_layer, batch, n_kv_head, max_len, head_dim].

    Static shapes, written in place: nothing is allocated while decoding, which is what later
    makes CUDA graphs possible. `pos` counts the positions already written.
    """

    # update() hands back only the written prefix, so attention masks by offset (cache.pos), not by a mask.
    mask = None

    def __init__(self, config, batch_size: int = 1, max_len: int | None = None,
                 device=None, dtype=torch.float32):
        max_len = config.context_length if max_len is None else max_len
        if not isinstance(max_len, int) or not 1 <= max_len <= config.context_length:
            raise ValueError(f"max_len={max_len} must be between 1 and the context length {config.context_length}")
        check_count("batch_size", batch_size, 1)
        shape = (config.n_layer, batch_size, config.n_kv_head, max_len, config.head_dim)
        # empty, not zeros: attention only ever reads positions < pos, which have been written.
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self.batch_size, self.max_len = batch_size, max_len
        self.pos = 0

    @property
    def nbytes(self) -> int:
        """Bytes of both buffers: kv_cache_bytes(config, max_len, batch_size, dtype)."""
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
        self.k[layer, :, :, self.pos:end] = k
        self.v[layer, :, :, self.pos:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Called once per forward, after every layer has written its entries."""
        if n < 0 or self.pos + n > self.max_len:
            raise ValueError(f"cannot advance the cache by {n} from pos={self.pos}: it holds {self.max_len} positions")
        self.pos += n

    def reset(self) -> None:
        self.pos = 0


__all__ = ["DTYPE_BYTES", "KVCache", "PRESETS", "dtype_bytes", "kv_bytes_per_token", "kv_cache_bytes",
           "tokens_where_cache_exceeds_weights", "weight_bytes"]
