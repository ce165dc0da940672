"""Lesson 06's sweep: the time of one decode step with and without the KV cache, position by position."""
from __future__ import annotations

import torch

from labutils.decode.loop import decode_step, prefill
from labutils.decode.kvcache import KVCache
from labutils.core.progress_bar import progress
from labutils.perf.timing import time_fn, torch_threads
from labutils.core.validate import check_count, check_device, check_model, check_seed
from labutils.core.draw import random_ids
from labutils.measure.request import without_launches


def check_positions(positions, context_length: int) -> list[int]:
    """Positions to time, each a token count in [1, context_length], as a non-empty list of ints."""
    try:
        positions = list(positions)
    except TypeError:
        positions = None
    if not positions:
        raise ValueError("positions must be a non-empty list of token counts, e.g. range(16, 257, 16)")
    return [check_count("positions", p, 1, context_length,
                        hint=f"each position is a token count within the context length {context_length}")
            for p in positions]


def step_cost_ms(model, positions, *, device="cpu", repeats: int = 5, threads: int = 1,
                 seed: int = 0) -> dict[str, list[float]]:
    """Median milliseconds of one step at each position p: "recompute" runs the p tokens so far through the
    model (what generate(..., use_cache=False) does every step); "cached" is decode_step() with p - 1 tokens
    already in the cache.

    The cache is filled once with real keys and values; rewinding cache.pos to p - 1 before each cached step
    makes it see exactly p - 1 earlier tokens. The two kinds alternate at every position, so a slow patch of
    the machine hits both. On CUDA each step at each position replays as one CUDA graph (time_pass's way): the
    lesson's point is the bytes and FLOPs of the two kinds, and a 7B model's eager step would be its host's
    queueing of some 1,200 ops, the same at every position (lesson 08 times those launches).
    """
    cfg, device = check_model("model", model).config, check_device("device", device)
    positions = check_positions(positions, cfg.context_length)
    repeats, threads = check_count("repeats", repeats, 1, 1000), check_count("threads", threads, 1, 1024)
    ids = random_ids(cfg.vocab_size, (1, max(positions)), check_seed(seed), device)
    cache = KVCache(cfg, 1, max(positions), device=device, dtype=model.tok_emb.weight.dtype)

    def recompute(p):
        return model(ids[:, :p], check=False, last_only=True)[:, -1].argmax(-1)   # as generate(use_cache=False)

    def cached(p):
        cache.pos = p - 1
        return decode_step(model, ids[:, p - 1], cache, check=False)   # no host read: a graph can replay it

    out = {"recompute": [], "cached": []}
    with torch_threads(threads), torch.inference_mode():
        if max(positions) > 1:
            prefill(model, ids[:, :-1], cache)         # real keys and values for every position
        for p in progress(positions, desc="positions"):
            for name, step in (("recompute", recompute), ("cached", cached)):
                t = time_fn(without_launches(lambda: step(p), device), device=device, warmup=1, repeats=repeats)
                out[name].append(1e3 * t.median_s)
    return out


__all__ = ["check_positions", "step_cost_ms"]
