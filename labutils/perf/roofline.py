"""The one place for FLOPs and bytes: weights, KV cache, each phase; intensity, floors, MBU and MFU."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from labutils.model.presets import ModelShape, get_shape
from labutils.core.validate import check_count, check_flag, check_number, check_positive, describe, parse_dtype

# Conventions (one place, so every lesson counts the same way):
# - A token's forward multiplies by every weight in the blocks and by the output layer: 2 FLOPs per weight
#   (a multiply and an add). Norm weights and biases ride along with the block weights (a few per mille).
# - The embedding lookup reads one row per token and does no arithmetic (lesson 02). The tables count as bytes
#   stored, never as FLOPs, and a step reads one row of each table per token. GPT-2's output layer *is* its
#   token table (tied), and the output layer is always counted in full: it is a real matmul.
# - Generation asks for the last position's logits only (GPT.forward(last_only=True)), so prefill applies
#   the output layer once per sequence, not once per prompt token.
# - Attention adds 4 x n_layer x n_embd FLOPs per key a token attends to (2 for q.k, 2 for p.v). With a sliding
#   window (Mistral-7B) a token attends to, and the cache keeps, at most that many keys: kv_positions.
# - The prefill floor and MFU use the same FLOPs (prefill_flops / decode_flops, attention included).
# - Bytes count weights, embedding rows and the KV cache. Activations are left out; `linear_bytes` shows
#   what they add to one matmul, which is why prefill's real intensity is below "prompt length x".


@dataclass(frozen=True)
class Counts:
    """What a model reads and multiplies per token, split the way the conventions above need."""

    n_params: int          # every parameter stored
    body_params: int       # block weights (+ final norm): read once per step, 2 FLOPs each per token
    head_params: int       # the output layer, vocab x n_embd, tied or not
    row_params: int        # embedding elements one token looks up (token row + position row)
    n_layer: int
    n_embd: int
    kv_shape: object       # anything with n_layer, n_kv_head, head_dim (for the KV-cache bytes)


def counts(x) -> Counts:
    """Counts for a GPT model, a GPTConfig, a ModelShape or a preset name."""
    if isinstance(x, str):
        x = get_shape(x)
    cfg = getattr(x, "config", x)          # a GPT model carries its GPTConfig
    if isinstance(cfg, ModelShape):
        n_params, learned_pos = cfg.n_params, cfg.learned_positions
    elif hasattr(cfg, "num_params") and hasattr(cfg, "n_layer"):
        n_params, learned_pos = cfg.num_params(), getattr(cfg, "learned_positions", True)   # none with RoPE
    else:
        raise TypeError(f"x (the model) must be a GPT model, a GPTConfig, a ModelShape or a preset name, "
                        f"got {describe(x)}; e.g. roofline.decode_bytes('gpt2-small', pos=128)")
    C, V = cfg.n_embd, cfg.vocab_size
    tables = V * C + (cfg.context_length * C if learned_pos else 0)
    head = V * C
    body = n_params - tables - (0 if cfg.tie_weights else head)
    if body <= 0:
        raise ValueError(f"{getattr(cfg, 'name', 'config')}: {n_params:,} parameters cannot hold its embedding "
                         f"tables ({tables:,}) and output layer; check n_params")
    return Counts(n_params, body, head, C * (2 if learned_pos else 1), cfg.n_layer, C, cfg)


def _tensor_bytes(tensors) -> int:
    unique = {id(t): t for t in tensors}            # a tied tensor is counted once
    return sum(t.numel() * t.element_size() for t in unique.values())


def _is_model(x) -> bool:
    return isinstance(x, torch.nn.Module)


def _model_tensors(module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _embedding_table(model) -> torch.Tensor:
    """The token-embedding table: the embedding's weight, or, with int8 weights (decode.quant.Int8Embedding), the
    tied output layer's int8 table it reads its rows from."""
    emb = model.tok_emb
    return emb.weight if hasattr(emb, "weight") else emb.table.weight


def _float_dtype(model) -> torch.dtype:
    # Activations (and the KV cache) run in the embedding's dtype; an int8 embedding keeps it in a buffer.
    emb = model.tok_emb
    return emb.weight.dtype if hasattr(emb, "weight") else emb._dtype.dtype


def weight_bytes(x, dtype=None) -> int:
    """Bytes of every weight stored.

    A model: its real tensors (parameters and buffers), a tied tensor once, each at its own element size,
    so int8 weights and their scales count as what they are (gpt-fast's _get_model_size does the same).
    A GPTConfig, ModelShape or preset name: its parameter count (published, for a preset) x `dtype`
    bytes (default fp16).
    """
    if _is_model(x):
        if dtype is not None:
            raise ValueError("a model's weight bytes are its tensors' own; pass dtype only with a config or preset")
        return _tensor_bytes(_model_tensors(x))
    return counts(x).n_params * parse_dtype("dtype", torch.float16 if dtype is None else dtype).itemsize


def step_weight_bytes(x, tokens_per_seq: int = 1, batch: int = 1, dtype=None) -> int:
    """Weight bytes one forward pass reads: every block weight and the output layer once, plus one
    embedding row per token (batch x tokens_per_seq of them). The rest of the tables stays unread."""
    tokens_per_seq = check_count("tokens_per_seq", tokens_per_seq, 1)
    batch = check_count("batch", batch, 1)
    c = counts(x)
    rows = batch * tokens_per_seq
    if _is_model(x):
        if dtype is not None:
            raise ValueError("a model's weight bytes are its tensors' own; pass dtype only with a config or preset")
        head = _tensor_bytes(_model_tensors(x.lm_head))
        tables = [_embedding_table(x)] + ([] if x.pos_emb is None else [x.pos_emb.weight])   # RoPE: no table
        head_ids = {id(t) for t in _model_tensors(x.lm_head)}
        table_bytes = _tensor_bytes(t for t in tables if id(t) not in head_ids)
        body = weight_bytes(x) - head - table_bytes
        return body + head + rows * c.row_params * _embedding_table(x).element_size()
    elem = parse_dtype("dtype", torch.float16 if dtype is None else dtype).itemsize
    return (c.body_params + c.head_params + rows * c.row_params) * elem


# ---- the KV cache ------------------------------------------------------------------------------------------

def kv_bytes_per_token(x, dtype=torch.float16) -> int:
    """Cache bytes one token adds to one sequence: 2 (K and V) x layers x kv_heads x head_dim x bytes."""
    shape = counts(x).kv_shape
    return 2 * shape.n_layer * shape.n_kv_head * shape.head_dim * parse_dtype("dtype", dtype).itemsize


def sliding_window(x) -> int | None:
    """The positions a model attends to (and caches) at most, or None for full attention.

    Only a ModelShape carries one (Mistral-7B: 4,096). The course's GPT attends to every position,
    so a GPTConfig, even GPTConfig.preset("mistral-7b"), has none and its KVCache holds them all.
    """
    return getattr(counts(x).kv_shape, "sliding_window", None)


def kv_positions(x, seq_len: int) -> int:
    """Positions a sequence of seq_len tokens keeps in its cache (and a step reads): all of them, or the
    last sliding_window of them, since older keys are never attended to again and their slots are reused."""
    seq_len = check_count("seq_len", seq_len, 0)
    window = sliding_window(x)
    return seq_len if window is None else min(seq_len, window)


def kv_cache_bytes(x, seq_len: int, batch_size: int = 1, dtype=torch.float16) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes x cached positions x batch.

    Cached positions are seq_len, or at most the model's sliding window (kv_positions): Mistral-7B's
    cache at 32,768 tokens is its cache at 4,096.
    """
    batch_size = check_count("batch_size", batch_size, 1)
    return kv_bytes_per_token(x, dtype) * kv_positions(x, seq_len) * batch_size


def tokens_where_cache_exceeds_weights(x, batch_size: int = 1, dtype=torch.float16,
                                       weight_dtype=torch.float16) -> int | None:
    """The smallest context (tokens per sequence) at which the batch's cache holds more bytes than the weights.

    It can lie beyond the model's context length: then the cache never overtakes the weights for
    one request, and only a larger batch makes it. None when no context gets there: a sliding window
    stops the cache growing below the weights (Mistral-7B at batch 1).
    """
    batch_size = check_count("batch_size", batch_size, 1)
    dtype, weight_dtype = parse_dtype("dtype", dtype), parse_dtype("weight_dtype", weight_dtype)
    tokens = weight_bytes(x, weight_dtype) // (kv_bytes_per_token(x, dtype) * batch_size) + 1
    window = sliding_window(x)
    return None if window is not None and tokens > window else tokens


def _kv_dtype(x, dtype) -> torch.dtype:
    """The cache's dtype: the one given, else a model's float dtype, else fp16 (a config or preset)."""
    if dtype is not None:
        return parse_dtype("dtype", dtype)
    if not _is_model(x):
        return torch.float16
    counts(x)                                # a module that is not a GPT is refused by name before it is read
    return _float_dtype(x)


# ---- FLOPs and bytes per phase ------------------------------------------------------------------------------

def flops_per_token(x, pos: int = 0) -> int:
    """FLOPs of one decode token: 2 x (block + output-layer weights) + 4 x n_layer x pos x n_embd (attention).

    `pos` is how many keys the token attends to (its own included), capped at a sliding window. pos=0 gives
    the classic "2 FLOPs per parameter per token" with the attention term left out.
    """
    pos = check_count("pos", pos, 0)
    c = counts(x)
    return 2 * (c.body_params + c.head_params) + 4 * c.n_layer * kv_positions(x, pos) * c.n_embd


def prefill_flops(x, prompt_len: int, batch: int = 1) -> int:
    """FLOPs of one prefill pass: every prompt token through the blocks, token t attending to t keys
    (causal), and the output layer for the last position only."""
    prompt_len = check_count("prompt_len", prompt_len, 1)
    batch = check_count("batch", batch, 1)
    c = counts(x)
    full = kv_positions(x, prompt_len)              # token t attends to min(t, window) keys
    keys = full * (full + 1) // 2 + (prompt_len - full) * full      # 1 + 2 + ... + full, then full each
    return batch * (2 * c.body_params * prompt_len + 2 * c.head_params + 4 * c.n_layer * c.n_embd * keys)


def mean_decode_pos(prompt_len: int, new_tokens: int) -> int:
    """Cached positions the average decode step of a request reads: the steps read from prompt_len up to
    prompt_len + new_tokens - 1 keys, so per-step bytes and FLOPs are taken at the middle."""
    check_count("prompt_len", prompt_len, 1)
    check_count("new_tokens", new_tokens, 1)
    return prompt_len + new_tokens // 2


def decode_flops(x, pos: int, batch: int = 1) -> int:
    """FLOPs of one decode step: one new token per sequence, attending to `pos` cached keys."""
    batch = check_count("batch", batch, 1)
    return batch * flops_per_token(x, pos)


def prefill_bytes(x, prompt_len: int, batch: int = 1, dtype=None) -> int:
    """Bytes one prefill pass moves: the weights read once (shared by every prompt token) + the KV cache written.

    `dtype` is the weights' and cache's (default fp16) for a config or preset; a model's weights count as
    stored, and its cache in `dtype` (default: the model's float dtype).
    """
    prompt_len, dtype = check_count("prompt_len", prompt_len, 1), _kv_dtype(x, dtype)
    weights = step_weight_bytes(x, prompt_len, batch, None if _is_model(x) else dtype)
    return weights + kv_cache_bytes(x, prompt_len, batch, dtype)


def decode_bytes(x, pos: int, batch: int = 1, dtype=None) -> int:
    """Bytes one decode step reads: every weight once (shared by the batch) + `pos` KV-cache entries per sequence."""
    pos, dtype = check_count("pos", pos, 0), _kv_dtype(x, dtype)
    weights = step_weight_bytes(x, 1, batch, None if _is_model(x) else dtype)
    return weights + kv_cache_bytes(x, pos, batch, dtype)


def linear_flops(n_out: int, n_in: int, batch: int = 1) -> int:
    """FLOPs of y = x @ W.T for `batch` rows of x and W [n_out, n_in]: 2 x n_out x n_in per row."""
    n_out, n_in, batch = (check_count(name, v, 1) for name, v in (("n_out", n_out), ("n_in", n_in), ("batch", batch)))
    return 2 * n_out * n_in * batch


def linear_bytes(n_out: int, n_in: int, batch: int = 1, dtype=torch.float32) -> int:
    """Bytes one y = x @ W.T moves at least: W read once, `batch` rows of x read and of y written.

    At batch 1 (a GEMV) the weight is nearly all of it; as the batch grows the activations join in,
    which is why a GEMM's intensity stays below "batch FLOPs per weight byte".
    """
    n_out, n_in, batch = (check_count(name, v, 1) for name, v in (("n_out", n_out), ("n_in", n_in), ("batch", batch)))
    return (n_out * n_in + batch * (n_in + n_out)) * parse_dtype("dtype", dtype).itemsize


# ---- intensity, floors and utilization -------------------------------------------------------------------------

def _check_positive(**values):
    for name, value in values.items():
        check_positive(name, value)


def _utilization(what: str, value: float, inputs: str) -> float:
    """A utilization above 1 ran faster than the measured peak. Slightly above can be real (a decode step
    mostly reads, the peak's copy reads and writes; a small model can sit in a CPU cache); far above, an
    input is in the wrong unit. Either way the caller should know, so it warns instead of passing silently."""
    if value > 1 + 1e-9:
        warnings.warn(f"{what} = {value:.3g} is above 1: faster than the measured peak. Check the units of "
                      f"{inputs} (seconds, bytes/s and FLOP/s, not ms or GB/s); a small model held in a CPU "
                      "cache can also beat the DRAM peak", RuntimeWarning, stacklevel=3)
    return value


def ridge_point(flops: float, bandwidth_Bps: float) -> float:
    """Arithmetic intensity (FLOP/byte) at which compute time equals memory time: flops / bandwidth."""
    return check_positive("flops", flops) / check_positive("bandwidth_Bps", bandwidth_Bps)


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOPs per byte moved. Below the machine's ridge point (peak FLOP/s / bandwidth) bytes set the pace."""
    _check_positive(nbytes=nbytes)
    return check_number("flops", flops, minimum=0) / nbytes


def attainable_flops(intensity: float, peak_flops: float, bandwidth_Bps: float) -> float:
    """The roofline: min(peak FLOP/s, intensity x bandwidth). Left of the ridge memory limits, right of it compute."""
    _check_positive(intensity=intensity, peak_flops=peak_flops, bandwidth_Bps=bandwidth_Bps)
    return min(peak_flops, intensity * bandwidth_Bps)


def decode_step_s(x, pos: int, batch: int = 1, dtype=None, *, bandwidth_Bps: float, peak_flops: float) -> float:
    """The roofline's prediction for one decode step: the slower of moving its bytes and doing its FLOPs."""
    _check_positive(peak_flops=peak_flops)
    return max(decode_floor_s(x, pos, batch, dtype, bandwidth_Bps=bandwidth_Bps),
               decode_flops(x, pos, batch) / peak_flops)


def knee_batch(x, pos: int, dtype=None, *, bandwidth_Bps: float, peak_flops: float) -> float:
    """Where batching stops paying: the batch at which decode throughput's two asymptotes meet.

    Small batches: throughput ~ batch / (step time at batch 1), since the weights are read once for all.
    Large batches: each extra sequence costs its own time, the larger of its FLOPs / peak (the ridge is
    reached: compute-bound) and its KV-cache bytes / bandwidth (the cache reads dominate: still memory-bound),
    so throughput flattens at 1 / that. The knee is (step time at batch 1) / (time per extra sequence).
    """
    dtype = _kv_dtype(x, dtype)
    step_1 = decode_step_s(x, pos, 1, dtype, bandwidth_Bps=bandwidth_Bps, peak_flops=peak_flops)
    per_seq = max(decode_flops(x, pos, 1) / peak_flops, kv_cache_bytes(x, pos, 1, dtype) / bandwidth_Bps)
    return step_1 / per_seq


def decode_floor_s(x, pos: int, batch: int = 1, dtype=None, *, bandwidth_Bps: float) -> float:
    """The fastest one decode step can be: decode_bytes / bandwidth."""
    _check_positive(bandwidth_Bps=bandwidth_Bps)
    return decode_bytes(x, pos, batch, dtype) / bandwidth_Bps


def prefill_floor_s(x, prompt_len: int, batch: int = 1, *, peak_flops: float) -> float:
    """The fastest one prefill pass can be: prefill_flops / peak FLOP/s."""
    _check_positive(peak_flops=peak_flops)
    return prefill_flops(x, prompt_len, batch) / peak_flops


def mbu(x, pos: int, batch: int, dtype, tpot_s: float, bandwidth_Bps: float, *, warn: bool = True) -> float:
    """Model bandwidth utilization: (weight + KV-cache bytes read per decode step) / TPOT / peak bandwidth.

    Databricks defines MBU against the datasheet bandwidth; with a measured copy bandwidth (labutils.perf.peaks) the
    same formula gives the share "of measured copy bandwidth", and the lessons name it so. Above 1 it warns (see _utilization); `warn=False` is for callers whose inputs are all measured in the
    right units (measure, stages), where a small model in a CPU cache can really beat the DRAM peak.
    """
    _check_positive(tpot_s=tpot_s, bandwidth_Bps=bandwidth_Bps)
    value = decode_bytes(x, pos, batch, dtype) / tpot_s / bandwidth_Bps
    return _utilization("MBU", value, "tpot_s and bandwidth_Bps") if check_flag("warn", warn) else value


def mfu(flops: float, seconds: float, peak_flops: float, *, warn: bool = True) -> float:
    """Model FLOPs utilization: useful FLOPs / seconds / peak FLOP/s.

    PaLM defines MFU against the datasheet FLOP/s; with a measured matmul peak it is the share "of measured
    matmul FLOP/s". `flops` comes from prefill_flops or decode_flops (attention included), the same count the floors use.
    Above 1 it warns unless warn=False, as mbu does.
    """
    _check_positive(seconds=seconds, peak_flops=peak_flops)
    value = check_number("flops", flops, minimum=0) / seconds / peak_flops
    return _utilization("MFU", value, "flops, seconds and peak_flops") if check_flag("warn", warn) else value


__all__ = ["ridge_point", "Counts", "arithmetic_intensity", "attainable_flops", "counts", "decode_bytes", "decode_flops",
           "decode_floor_s", "decode_step_s", "flops_per_token", "knee_batch", "kv_bytes_per_token", "kv_cache_bytes",
           "kv_positions", "linear_bytes", "linear_flops", "mbu", "mean_decode_pos", "mfu", "prefill_bytes",
           "prefill_flops", "prefill_floor_s", "sliding_window", "step_weight_bytes",
           "tokens_where_cache_exceeds_weights", "weight_bytes"]
