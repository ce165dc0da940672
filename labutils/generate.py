"""Generation in two phases: prefill() fills the KV cache, decode_step() adds one token at a time."""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch

from . import timing
from .kvcache import KVCache


def check_sampling(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None) -> None:
    """Refuse sampling settings that mean nothing, before any forward pass is spent on them."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def sampling_probs(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The distribution sample() draws from, [batch, vocab] in float32: temperature, then top-k, then top-p.

    temperature=0 puts all mass on the argmax. top_k keeps every token tied with the k-th.
    top_p keeps the smallest set of most likely tokens whose probabilities add up to at least top_p.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p; the first always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row of logits [batch, vocab], on the logits' device. temperature=0 is greedy."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def prefill(model, ids: torch.Tensor, cache: KVCache, **sampling) -> torch.Tensor:
    """One forward pass over the whole prompt [batch, T]: writes T cache entries, returns token [batch]."""
    logits = model(ids, cache, last_only=True)
    return sample(logits[:, -1], **sampling)


def decode_step(model, token: torch.Tensor, cache: KVCache, **sampling) -> torch.Tensor:
    """One forward pass over one new token [batch]: reads the cache, appends one entry, returns the next."""
    # Shape checks only: reading token values would cost a host sync on every step.
    if not isinstance(token, torch.Tensor) or token.dim() != 1:
        raise ValueError("decode_step takes the newest token of each sequence as a 1-D tensor [batch], got "
                         f"{tuple(token.shape) if isinstance(token, torch.Tensor) else type(token).__name__}")
    cache.check_fits(token.shape[0], 1)
    logits = model(token[:, None], cache, check=False, last_only=True)
    return sample(logits[:, -1], **sampling)


@dataclass
class GenerationResult:
    """What one request produced, with a host timestamp per token (seconds since the request began)."""

    tokens: torch.Tensor                  # [batch, new_tokens], on the CPU
    timestamps: list[float]               # when each token was available on the host
    prompt_len: int
    ttft_s: float = field(init=False)
    tpot_s: float = field(init=False)

    def __post_init__(self):
        self.ttft_s = timing.ttft_s(self.timestamps)
        self.tpot_s = timing.tpot_s(self.timestamps)

    @property
    def itl_s(self) -> list[float]:
        return timing.itl_s(self.timestamps)

    @property
    def latency_s(self) -> float:
        return self.timestamps[-1]


def as_batch(ids, device) -> torch.Tensor:
    """Accept a list of ids, a 1-D tensor (batch 1) or a [batch, T] tensor; refuse anything else."""
    if isinstance(ids, (list, tuple)):
        try:
            ids = torch.tensor(ids)      # keeps the element type, so floats are caught below
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("ids must be a list of ints (or a list of equal-length lists for a batch)") from None
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a list of ints or a LongTensor, got {type(ids).__name__}")
    if ids.numel() == 0:
        raise ValueError("the prompt is empty; encode at least one token")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TypeError(f"ids must be integer token ids, got dtype {ids.dtype}; "
                        "encode text with the tokenizer, or use torch.tensor(ids, dtype=torch.long)")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"the prompt must be [batch, T] with T >= 1, got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def check_request(model, ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None) -> torch.Tensor:
    """Refuse a request that cannot run, before any forward pass; returns ids as [batch, T] on the model's device."""
    ids = as_batch(ids, next(model.parameters()).device)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__} {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_sampling(temperature, top_k, top_p)
    T, ctx = ids.shape[1], model.config.context_length
    if T + max_new_tokens > ctx:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} tokens "
                         f"exceed the context length {ctx}; shorten one of them")
    model.check_ids(ids)
    return ids


@torch.inference_mode()
def generate(model, ids, max_new_tokens: int, *, use_cache: bool = True, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None) -> GenerationResult:
    """Prefill, then decode until max_new_tokens. With use_cache=False every step recomputes the
    whole sequence: the baseline that shows what the cache saves."""
    t0 = time.perf_counter()   # the request starts now: validation and cache allocation count toward TTFT
    device = next(model.parameters()).device
    ids = check_request(model, ids, max_new_tokens, temperature, top_k, top_p)
    T, max_new_tokens = ids.shape[1], int(max_new_tokens)
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)

    tokens, stamps = [], []

    def emit(tok):
        tokens.append(tok.cpu())            # the token is on the host only after this copy
        timing.synchronize(device)
        stamps.append(time.perf_counter() - t0)

    if use_cache:
        dtype = next(model.parameters()).dtype
        cache = KVCache(model.config, ids.shape[0], T + max_new_tokens, device=device, dtype=dtype)
        tok = prefill(model, ids, cache, **sampling)
        emit(tok)
        for _ in range(max_new_tokens - 1):
            tok = decode_step(model, tok, cache, **sampling)
            emit(tok)
    else:
        seq = ids
        for _ in range(max_new_tokens):
            tok = sample(model(seq, check=False, last_only=True)[:, -1], **sampling)
            emit(tok)
            seq = torch.cat([seq, tok[:, None]], dim=1)
    return GenerationResult(torch.stack(tokens, dim=1), stamps, T)
