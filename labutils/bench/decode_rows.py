"""Bench rows for one request's decode: the KV cache, long vs short context, int8, the fast loop against
Hugging Face, decode bandwidth and prefill throughput."""
from __future__ import annotations

import copy
import functools
import statistics
import tempfile
from typing import Callable

import torch

from labutils.decode import quant
from labutils.perf import timing
from labutils.decode.loop import decode_step, generate, prefill
from labutils.core.dtypes import dtype_name, torch_dtype
from labutils.measure.request import contender_dtypes, timed_generate
from labutils.core.draw import random_ids
from labutils.core.devices import default_dtype
from labutils.decode.kvcache import KVCache
from labutils.bench.common import (MAX_CONTEXT, BenchRow, BenchSettings, bench_dtype, bench_layout, bench_model,
                                   bench_request, fast_model, interleaved)


def recompute_vs_cached(s: BenchSettings) -> BenchRow:
    """End to end: generate() recomputing the whole sequence each step vs decoding from the KV cache."""
    model = bench_model(s.preset, str(s.device))
    # On a GPU a 256-token pass of a 7B model is set by its launches as much as by its FLOPs; at 2,048 tokens
    # recomputing is 28 TFLOP a step (36 ms at an H200's 776 TFLOP/s) against a cached step's 14.3 GB (3.4 ms).
    prompt_len, new = (32, 8) if s.quick else (2048, 16) if s.device.type == "cuda" else (256, 48)
    ids = random_ids(model.config.vocab_size, (1, prompt_len))
    generate(model, ids, 2, use_cache=True)      # warm-up, untimed
    generate(model, ids, 2, use_cache=False)
    t = interleaved({"recompute": lambda: generate(model, ids, new, use_cache=False),
                      "cached": lambda: generate(model, ids, new, use_cache=True)}, s)
    return BenchRow("recompute / cached, end to end", t["recompute"] / t["cached"], ">= 3",
                    f"{s.preset} shape, random {dtype_name(bench_dtype(s))}, {s.device.type}, {prompt_len}-token "
                    f"prompt + {new} new",
                    f"recompute {t['recompute']:.2f} s, cached {t['cached']:.2f} s (median of {s.rounds})")


def tpot_long_vs_short(s: BenchSettings) -> BenchRow:
    """A decode step with the full context in the cache vs one with 64 positions: is TPOT flat in position?"""
    model = bench_model(s.preset, str(s.device))
    ctx = min(model.config.context_length, MAX_CONTEXT)
    short, long = (8, ctx) if s.quick else (64, ctx)
    ids = random_ids(model.config.vocab_size, (1, long - 1), 0, s.device)
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
        t = interleaved(fns, s, repeats=2 if s.quick else 6)
    return BenchRow(f"TPOT {long} / TPOT {short} tokens in context", t["long"] / t["short"], "<= 1.3",
                    f"{s.preset} shape, random {dtype_name(bench_dtype(s))}, {s.device.type}; decode step reading "
                    f"{long} vs {short} cached positions",
                    f"{long}: {t['long'] * 1e3:.1f} ms, {short}: {t['short'] * 1e3:.1f} ms "
                    f"(median of {s.rounds} x {2 if s.quick else 6} steps)")


def int8_vs_16_32(s: BenchSettings) -> BenchRow:
    """Decode TPOT with int8 weights vs the faster of the float dtypes worth comparing here (measure.contender_dtypes),
    each through this device's decode loop (measure.timed_generate): generate() on a CPU; on CUDA a graphed step,
    compiled for int8 so the int8-to-16-bit cast fuses into each matmul's loads (as gpt-fast measures)."""
    base = bench_model(s.preset, str(s.device))
    # int8 weights with activations in the dtype this device runs models in (fp32 on a CPU, whose int8 kernel computes
    # in bf16 anyway; bf16 on a recent GPU). On a GPU bf16 against int8, target 1.3x (gpt-fast: 155.6 against 104.9
    # tokens/s for Llama-2-7B on an A100, 1.48x; the bytes allow at most 2x).
    on_gpu = s.device.type == "cuda"
    own = dtype_name(next(base.parameters()).dtype)
    floats = {name: base if name == own else copy.deepcopy(base).to(torch_dtype(name))
              for name in contender_dtypes(s.device)}
    models = {**floats, "int8": quant.quantize_(copy.deepcopy(base).to(default_dtype(s.device)))}
    prompt_len, new = (16, 8) if s.quick else (128, 32)
    ids = random_ids(base.config.vocab_size, (1, prompt_len))
    loops = {name: functools.partial(timed_generate, m) for name, m in models.items()}
    for run in loops.values():
        run(ids, 2)                               # warm-up, untimed
    tpots: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(s.rounds):                     # interleaved, so drifting load hits every model
        for name, run in loops.items():
            tpots[name].append(run(ids, new).tpot_s)
    t = {name: statistics.median(v) for name, v in tpots.items()}
    best = min(floats, key=t.get)
    return BenchRow(f"best of {'/'.join(floats)} TPOT / int8 TPOT", t[best] / t["int8"], "> 1.3" if on_gpu else "> 1",
                    f"{s.preset} shape, random weights, {s.device.type}, batch 1, {prompt_len}-token prompt + "
                    f"{new} new, " + ("a graphed step each, int8's compiled" if on_gpu else "generate()"),
                    ", ".join(f"{name} {t[name] * 1e3:.2f} ms" for name in models)
                    + f" (median of {s.rounds}); best 16/32-bit: {best}")


def hf_pair(shape: str, s: BenchSettings):
    """Hugging Face GPT2LMHeadModel with seeded random weights, and the same weights loaded through load_hf_gpt2."""
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
    ids, new = bench_request(s, ours.config.vocab_size)
    hf, ours = hf.to(s.device), fast_model(ours.to(s.device), s)
    check_same_greedy_tokens(hf, ours, ids, new)
    hf, ours = hf.to(dtype=bench_dtype(s)), ours.to(dtype=bench_dtype(s))
    dec = FastDecoder(ours, 1, ids.shape[1] + new)      # mode="auto": CUDA graph on a GPU, eager on CPU
    hf_generate(hf, ids, new), dec.generate(ids, new)  # warm-up, untimed
    t = interleaved({"hf": lambda: hf_generate(hf, ids, new), "fast": lambda: dec.generate(ids, new)}, s)
    return BenchRow(f"HF generate / fast loop, {shape}, end to end", t["hf"] / t["fast"], target,
                    f"{'bench-quick' if s.quick else shape} GPT-2 shape, same random weights (greedy tokens checked "
                    f"equal in fp32), {dtype_name(bench_dtype(s))}, {s.device.type}, batch 1, "
                    f"{ids.shape[1]}-token prompt + {new} new; fast loop mode={dec.mode}{bench_layout(s)}",
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

    On a CPU the gpt2-small shape (target 0.7). On CUDA the lessons' GPU shape in 16 bits through the graph loop
    (target 0.8; gpt-fast reaches about 0.82 of an A100's measured bandwidth on Llama-2-7B), replaying the eager
    step's kernels or the compiled step's, whichever streams faster.
    """
    from labutils.decode.fastgen import FastDecoder
    from labutils.perf.probes import measure_bandwidth
    from labutils.decode.prepack import prepack_linears, prepack_unavailable
    from labutils.perf.roofline import decode_bytes, mean_decode_pos
    preset = s.preset
    base = bench_model(preset, str(s.device))
    base = base if s.device.type == "cuda" else copy.deepcopy(base).to(dtype=bench_dtype(s))   # CUDA's is 16-bit
    ids, new = bench_request(s, base.config.vocab_size)
    n = ids.shape[1] + new
    # This row compares no tokens, so it may take whichever way of running the step streams fastest on this machine.
    # On a CPU, the weight layout: row-major (nn.Linear), column-major, or oneDNN-prepacked (labutils.decode.prepack,
    # whose sums differ in the last bits). Which one wins depends on the CPU: prepacked won on an AMD EPYC and lost to
    # row-major on an Intel Xeon. On CUDA, the graph of the eager step's kernels or of the compiled step's: a graph
    # still pays each kernel's start-up, about 2.5 us on the H200 run: Llama-2-7B's eager step runs some 600 kernels,
    # 1.5 ms beside its 3.2 ms read, and 0.8 allows about 320 (docs/gpu/predictions.md), which only fusing the
    # elementwise ops into their neighbours reaches, as torch.compile does for gpt-fast.
    first = "the eager step's graph" if s.device.type == "cuda" else "row-major weights"
    ways = {first: (base, "auto")}                        # (model, FastDecoder's mode)
    if s.device.type == "cpu":
        ways["column-major weights"] = (fast_model(copy.deepcopy(base), s), "auto")
        if prepack_unavailable(base) is None:
            ways["prepacked weights"] = (prepack_linears(copy.deepcopy(base)), "auto")
    elif s.device.type == "cuda":
        ways["compiled step"] = (base, "compile")
    decoders = {name: FastDecoder(m, 1, n, mode=mode) for name, (m, mode) in ways.items()}
    for dec in decoders.values():
        dec.generate(ids, new)                             # warm-up, untimed
    trial = {name: min(dec.generate(ids, new).tpot_s for _ in range(2)) for name, dec in decoders.items()}
    layout = min(trial, key=trial.get)
    model, dec = ways[layout][0], decoders[layout]
    layout = f", {layout} (fastest of {len(trial)} here)"
    tpot, bw = [], []
    for _ in range(s.rounds):                              # interleaved: load hits both sides
        tpot.append(dec.generate(ids, new).tpot_s)
        bw.append(measure_bandwidth(s.device, nbytes=64 << 20 if s.quick else None, repeats=3, warmup=1))
    tpot_s, bw_Bps = statistics.median(tpot), statistics.median(bw)
    # Each step reads every weight and, on average, the cache up to the middle of the decode.
    nbytes = decode_bytes(model.config, mean_decode_pos(ids.shape[1], new), 1, bench_dtype(s))
    return BenchRow("decode bytes/s / copy bandwidth", nbytes / tpot_s / bw_Bps,
                    ">= 0.8" if s.device.type == "cuda" else ">= 0.7",
                    f"{preset} shape, random {dtype_name(bench_dtype(s))}, {s.device.type}, batch 1, "
                    f"{ids.shape[1]}-token prompt + {new} new; fast loop mode={dec.mode}{layout}",
                    f"{nbytes / 1e6:.0f} MB per step in {tpot_s * 1e3:.1f} ms = {nbytes / tpot_s / 1e9:.1f} GB/s; "
                    f"copy {bw_Bps / 1e9:.1f} GB/s (median of {s.rounds})")


def prefill_throughput(s: BenchSettings) -> BenchRow:
    """Prefill FLOP/s at 512 tokens (roofline.prefill_flops / measured time) against measured matmul FLOP/s."""
    from labutils.perf.probes import measure_matmul_flops
    from labutils.perf.roofline import prefill_flops
    from labutils.decode.static_cache import StaticKVCache
    base = bench_model(s.preset, str(s.device))
    model = base if s.device.type == "cuda" else fast_model(copy.deepcopy(base).to(dtype=bench_dtype(s)), s)
    prompt_len = 64 if s.quick else 2048 if s.device.type == "cuda" else 512
    ids = random_ids(model.config.vocab_size, (1, prompt_len), 0, s.device)
    cache = StaticKVCache(model.config, 1, prompt_len, device=s.device, dtype=bench_dtype(s))

    @torch.inference_mode()
    def prefill():
        cache.pos.zero_()           # the prompt overwrites every position it reads: no need to zero the buffers
        # Generation's prefill: logits for the last position only, as roofline.prefill_flops counts it.
        model(ids, cache, check=False, last_only=True)

    prefill()                                              # warm-up, untimed
    t, peak = [], []
    for _ in range(s.rounds):                              # interleaved: load hits both sides
        t.append(timing.time_fn(prefill, device=s.device, warmup=0, repeats=1).median_s)
        peak.append(measure_matmul_flops(bench_dtype(s), s.device, n=512 if s.quick else None))
    seconds, peak_flops = statistics.median(t), statistics.median(peak)
    flops = prefill_flops(model.config, prompt_len)
    return BenchRow(f"prefill FLOP/s at {prompt_len} tokens / matmul FLOP/s", flops / seconds / peak_flops, ">= 0.6",
                    f"{s.preset} shape, random {dtype_name(bench_dtype(s))}, {s.device.type}, batch 1, "
                    f"{prompt_len}-token prompt into a StaticKVCache, last-position logits{bench_layout(s)}",
                    f"{flops / 1e9:.1f} GFLOP (roofline.prefill_flops) in {seconds * 1e3:.0f} ms = "
                    f"{flops / seconds / 1e9:.0f} GFLOP/s; matmul {peak_flops / 1e9:.0f} GFLOP/s (median of {s.rounds})")
