"""Generation in two phases: prefill() fills the KV cache, decode_step() adds one token at a time."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from labutils.core import fake_cuda
from labutils.perf import timing
from labutils.decode.kvcache import KVCache
from labutils.model.cache import Cache
from labutils.decode.sampling import check_sampling, sample
from labutils.core.validate import (check_cache, check_count, check_device, check_flag, check_seed, describe,
                                    model_device, model_dtype)


def check_stop_token(stop_token, vocab_size: int) -> int | None:
    """None, or a token id in [0, vocab_size) at which generate() stops; returns it as an int."""
    if stop_token is None:
        return None
    return check_count("stop_token", stop_token, 0, vocab_size - 1,
                       hint="pass an id from the tokenizer, e.g. enc.eot_token, or None to never stop early")


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "generator")


def _check_sampling_options(sampling: dict) -> None:
    """prefill's and decode_step's sampling keywords, refused before the forward writes the cache: a refused
    call must leave the cache as it was."""
    unknown = sorted(set(sampling) - set(SAMPLING_OPTIONS))
    if unknown:
        raise TypeError(f"unknown sampling option(s) {unknown}; the options are {', '.join(SAMPLING_OPTIONS)}")
    check_sampling(**{k: v for k, v in sampling.items() if k != "generator"})


def prefill(model, ids: torch.Tensor, cache, *, check: bool = True, noise: torch.Tensor | None = None,
            **sampling) -> torch.Tensor:
    """One forward pass over the whole prompt [batch, T]: writes T cache entries, returns token [batch].

    The request's checks run here, once: the sampling options, ids against the vocab and context, the
    cache against the model (GPT.forward(check=True)), all before the cache is written; then the logits
    for NaN (sample). check=False skips the ids and cache checks (host syncs) for a caller that has run
    check_request already, as the fast loop has; the logits are checked either way, once per request.
    `noise` is sample()'s: the fast loop's pre-drawn noise for the exponential race.
    """
    _check_sampling_options(sampling)
    logits = model(ids, cache, check=check, last_only=True)
    return sample(logits[:, -1], noise=noise, **sampling)


def decode_step(model, token: torch.Tensor, cache, *, check: bool = True, noise: torch.Tensor | None = None,
                **sampling) -> torch.Tensor:
    """One forward pass over one new token [batch]: reads the cache, appends one entry, returns the next.

    The one one-token step: generate() runs it, and so does the fast loop (FastDecoder.step), eagerly,
    captured in a CUDA graph or compiled, with `noise` for sample()'s exponential race.
    With check=True (the default, for a call by hand) the token ids and the cache are checked against
    the model and the logits for NaN: host syncs. generate() and the fast loop check once per request,
    in prefill, and pass check=False: the step then reads nothing back from the device, so a graph can
    hold it, and only the token's shape (known on the host) is checked.
    """
    if not isinstance(token, torch.Tensor) or token.dim() != 1:
        raise ValueError("decode_step takes the newest token of each sequence as a 1-D tensor [batch], got "
                         f"{tuple(token.shape) if isinstance(token, torch.Tensor) else describe(token)}")
    if check:
        _check_sampling_options(sampling)
        if not isinstance(cache, Cache):
            check_cache(cache, model)          # refuses what is no cache, by name
        cache.check(model, token[:, None])     # the cache's own checks; a StaticKVCache reads its position: a sync
    logits = model(token[:, None], cache, check=False, last_only=True)
    return sample(logits[:, -1], check=check, noise=noise, **sampling)


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
    device = check_device("device", device)
    if isinstance(ids, (list, tuple)):
        try:
            ids = torch.tensor(ids)      # keeps the element type, so floats are caught below
        except (TypeError, ValueError, RuntimeError):
            raise TypeError("ids must be a list of ints (or a list of equal-length lists for a batch)") from None
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"ids must be a list of ints or a LongTensor, got {describe(ids)}; "
                        "encode text first, e.g. encode(enc, text)")
    if ids.numel() == 0:
        raise ValueError("ids is empty: the prompt is empty; encode at least one token")
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise TypeError(f"ids must be integer token ids, got dtype {ids.dtype}; "
                        "encode text with the tokenizer, or use torch.tensor(ids, dtype=torch.long)")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise ValueError(f"ids must be [T] or [batch, T] with T >= 1, got shape {tuple(ids.shape)}")
    return ids.to(device=device, dtype=torch.long)


def check_request(model, ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, min_p: float | None = None) -> torch.Tensor:
    """Refuse a request that cannot run, before any forward pass; returns ids as [batch, T] on the model's device."""
    ids = as_batch(ids, model_device(model))
    max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
    check_sampling(temperature, top_k, top_p, min_p)
    T, ctx = ids.shape[1], model.config.context_length
    if T + max_new_tokens > ctx:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {T + max_new_tokens} tokens "
                         f"exceed the context length {ctx}; shorten one of them")
    model.check_ids(ids)
    return ids


@torch.inference_mode()
def generate(model, ids, max_new_tokens: int, *, use_cache: bool = True, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             min_p: float | None = None, stop_token: int | None = None, on_token=None) -> GenerationResult:
    """Prefill, then decode until max_new_tokens. With use_cache=False every step recomputes the
    whole sequence: the baseline that shows what the cache saves.

    stop_token (e.g. the tokenizer's end-of-text id) ends the request early, once every sequence has
    produced it; the result then ends with that token. In a batch, a sequence that stopped first keeps
    stop_token in its later places, so each row reads up to its first stop_token. on_token(tokens) is called
    with each step's tokens [batch] once they are on the host and stamped, as fast_generate's is.
    """
    t0 = time.perf_counter()   # the request starts now: validation and cache allocation count toward TTFT
    device = model_device(model)
    ids = check_request(model, ids, max_new_tokens, temperature, top_k, top_p, min_p)
    stop_token = check_stop_token(stop_token, model.config.vocab_size)
    if on_token is not None and not callable(on_token):
        raise TypeError(f"on_token must be a function of one step's tokens, got {type(on_token).__name__}")
    T, max_new_tokens = ids.shape[1], int(max_new_tokens)
    use_cache = check_flag("use_cache", use_cache)
    seed = None if seed is None else check_seed(seed)
    generator = fake_cuda.generator(device, seed)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, generator=generator)

    tokens, stamps = [], []
    stopped = torch.zeros(ids.shape[0], dtype=torch.bool)    # on the host: which rows have said stop_token

    def emit(tok) -> bool:
        """Record a token; True when every row has now produced stop_token (the request is done)."""
        host = tok.cpu()                    # the token is on the host only after this copy
        timing.synchronize(device)
        stamps.append(time.perf_counter() - t0)
        if stop_token is not None:
            host = host.masked_fill(stopped, stop_token)   # a finished row stays finished
            stopped.logical_or_(host == stop_token)
        tokens.append(host)
        if on_token is not None:
            on_token(host)
        return stop_token is not None and bool(stopped.all())

    if use_cache:
        cache = KVCache(model.config, ids.shape[0], T + max_new_tokens, device=device, dtype=model_dtype(model))
        tok = prefill(model, ids, cache, **sampling)
        done = emit(tok)
        for _ in range(max_new_tokens - 1):
            if done:
                break
            tok = decode_step(model, tok, cache, check=False, **sampling)
            done = emit(tok)
    else:
        seq = ids
        for i in range(max_new_tokens):
            tok = sample(model(seq, check=False, last_only=True)[:, -1], check=i == 0, **sampling)
            if emit(tok):
                break
            seq = torch.cat([seq, tok[:, None]], dim=1)
    return GenerationResult(torch.stack(tokens, dim=1), stamps, T)
