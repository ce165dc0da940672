"""FLOPs and bytes per phase, arithmetic intensity, floor times, MBU and MFU."""
from __future__ import annotations

import torch

from .kvcache import check_count, dtype_bytes, kv_cache_bytes
from .presets import ModelShape

# Conventions (one place, so every lesson counts the same way):
# - "params" is every parameter the model holds, embeddings included (GPTConfig.num_params(), or the
#   published count of a ModelShape). GPT-2 ties its output layer to the token embedding, so the
#   table is read and multiplied once per token either way.
# - A matmul with a weight of N elements costs 2 x N FLOPs per token: one multiply and one add.
# - Attention adds 4 x n_layer x n_embd FLOPs per key a token attends to (2 for q.k, 2 for p.v).
# - Bytes count weights and KV cache only; activations are small next to them for the shapes here.


def _shape(config):
    """A GPTConfig, a ModelShape or a preset name -> (params, n_layer, n_embd, shape for kv_cache_bytes)."""
    if isinstance(config, str):
        from .model import GPTConfig
        config = GPTConfig.preset(config)
    if isinstance(config, ModelShape):
        return config.n_params, config.n_layer, config.n_embd, config
    if hasattr(config, "num_params") and hasattr(config, "n_layer"):
        return config.num_params(), config.n_layer, config.n_embd, config
    raise TypeError(f"expected a GPTConfig, a ModelShape or a preset name, got {type(config).__name__}")


def _check_counts(**counts):
    for name, value in counts.items():
        check_count(name, value, 0 if name == "pos" else 1)


def _check_positive(**values):
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def param_bytes(config, dtype=torch.float16) -> int:
    """Bytes of all weights at `dtype`: what one forward pass has to read at least once."""
    params, *_ = _shape(config)
    return params * dtype_bytes(dtype)


def weight_bytes(x, dtype=None) -> int:
    """Bytes of a model's weights.

    A model (nn.Module): its real tensors, parameters and buffers, each at its own element size;
    a tied tensor counts once (parameters() and buffers() yield a shared tensor once), so int8
    weights count 1 byte per element and their scales at the scales' dtype. `dtype` must be None.
    A GPTConfig or preset name: parameter count x bytes of `dtype` (default fp16), as param_bytes.
    """
    # NOTE for merge: the lead is consolidating weight bytes here; this is the model branch of it.
    if isinstance(x, torch.nn.Module):
        if dtype is not None:
            raise ValueError(f"weight_bytes(model) counts each tensor at its own dtype; got dtype={dtype!r}. "
                             "Cast the model instead (model.to(dtype)), or pass a config to count at a dtype")
        tensors = [*x.parameters(), *x.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
    return param_bytes(x, torch.float16 if dtype is None else dtype)


def linear_flops(n_out: int, n_in: int, batch: int = 1) -> int:
    """FLOPs of y = x @ W.T for `batch` rows of x and W [n_out, n_in]: 2 x n_out x n_in per row."""
    _check_counts(n_out=n_out, n_in=n_in, batch=batch)
    return 2 * n_out * n_in * batch


def linear_bytes(n_out: int, n_in: int, batch: int = 1, dtype=torch.float32) -> int:
    """Bytes one y = x @ W.T moves at least: W read once, `batch` rows of x read and of y written.

    At batch 1 (a GEMV) the weight is nearly all of it; as the batch grows the activations join in,
    which is why a GEMM's intensity stays below "batch FLOPs per weight byte".
    """
    _check_counts(n_out=n_out, n_in=n_in, batch=batch)
    return (n_out * n_in + batch * (n_in + n_out)) * dtype_bytes(dtype)


def flops_per_token(config, pos: int = 0) -> int:
    """FLOPs of one token's forward pass: 2 x params (matmuls) + 4 x n_layer x pos x n_embd (attention).

    `pos` is how many keys the token attends to (its own included). pos=0 gives the classic
    "2 FLOPs per parameter per token" with the attention term left out.
    """
    _check_counts(pos=pos)
    params, n_layer, n_embd, _ = _shape(config)
    return 2 * params + 4 * n_layer * pos * n_embd


def prefill_flops(config, prompt_len: int, batch: int = 1) -> int:
    """FLOPs of one prefill pass: every prompt token, token t attending to t keys (causal)."""
    _check_counts(prompt_len=prompt_len, batch=batch)
    params, n_layer, n_embd, _ = _shape(config)
    keys = prompt_len * (prompt_len + 1) // 2       # 1 + 2 + ... + prompt_len
    return batch * (2 * params * prompt_len + 4 * n_layer * n_embd * keys)


def decode_flops(config, pos: int, batch: int = 1) -> int:
    """FLOPs of one decode step: one new token per sequence, attending to `pos` cached keys."""
    _check_counts(pos=pos, batch=batch)
    return batch * flops_per_token(config, pos)


def prefill_bytes(config, prompt_len: int, batch: int = 1, dtype=torch.float16) -> int:
    """Bytes one prefill pass moves: the weights read once (shared by every prompt token) + the KV cache written."""
    _check_counts(prompt_len=prompt_len, batch=batch)
    *_, shape = _shape(config)
    return param_bytes(config, dtype) + kv_cache_bytes(shape, prompt_len, batch, dtype)


def decode_bytes(config, pos: int, batch: int = 1, dtype=torch.float16) -> int:
    """Bytes one decode step reads: every weight once (shared by the batch) + `pos` KV-cache entries per sequence."""
    _check_counts(pos=pos, batch=batch)
    *_, shape = _shape(config)
    return param_bytes(config, dtype) + kv_cache_bytes(shape, pos, batch, dtype)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved. Below the machine's ridge point (peak FLOP/s / bandwidth) bytes set the pace."""
    _check_positive(nbytes=nbytes)
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    return flops / nbytes


def decode_floor_s(config, pos: int, batch: int = 1, dtype=torch.float16, *, bandwidth_Bps: float) -> float:
    """The fastest one decode step can be: decode_bytes / bandwidth."""
    _check_positive(bandwidth_Bps=bandwidth_Bps)
    return decode_bytes(config, pos, batch, dtype) / bandwidth_Bps


def prefill_floor_s(config, prompt_len: int, batch: int = 1, *, peak_flops: float) -> float:
    """The fastest one prefill pass can be: prefill_flops / peak FLOP/s."""
    _check_positive(peak_flops=peak_flops)
    return prefill_flops(config, prompt_len, batch) / peak_flops


def mbu(config, pos: int, batch: int, dtype, tpot_s: float, bandwidth_Bps: float) -> float:
    """Model bandwidth utilization: (weight + KV-cache bytes read per decode step) / TPOT / peak bandwidth."""
    _check_positive(tpot_s=tpot_s, bandwidth_Bps=bandwidth_Bps)
    return decode_bytes(config, pos, batch, dtype) / tpot_s / bandwidth_Bps


def mfu(config, tokens: int, seconds: float, flops: float) -> float:
    """Model FLOPs utilization: (2 x params x tokens) / seconds / peak FLOP/s (`flops`, e.g. Peaks.flops)."""
    _check_counts(tokens=tokens)
    _check_positive(seconds=seconds, flops=flops)
    params, *_ = _shape(config)
    return 2 * params * tokens / seconds / flops


__all__ = ["arithmetic_intensity", "decode_bytes", "decode_flops", "decode_floor_s", "flops_per_token",
           "linear_bytes", "linear_flops", "mbu", "mfu", "param_bytes", "prefill_bytes", "prefill_flops",
           "prefill_floor_s", "weight_bytes"]
