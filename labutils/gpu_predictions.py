"""What the GPU-shaped lessons and the bench should measure on an H200, from the roofline's formulas and that
machine's peaks.

A claim about a GPU checked only on a CPU rests on arithmetic; this module writes that arithmetic down, so a reader
can check each figure and the next `make gpu-check` can be read against it. Every number comes from
labutils.perf.roofline and shape_choice, fed the peaks the H200 run measured (docs/gpu/h200-2026-12-04: copy
4,158.7 GB/s as lesson 08 printed it, 775.8 TFLOP/s in bf16 matmuls) and its 139 GB. A floor is the least time the
bytes or FLOPs allow; a measured time sits above it, by the share of the peak reached. `python -m labutils.gpu_predictions` prints docs/gpu/predictions.md;
tests/test_gpu_predictions.py checks the file is current.
"""
from __future__ import annotations

import functools

import torch

from labutils.core.devices import GiB
from labutils.figures.roofline import measured_knee
from labutils.measure.request import BASE_PROMPTS, BaselinePrompt, first_compute_bound, floor_sets_time
from labutils.model.presets import get_shape
from labutils.perf import roofline
from labutils.perf.datasheets import SPECS
from labutils.perf.peaks import Peaks
from labutils.serving.step_graphs import MOST_CHUNK
from labutils.perf.shape_choice import LONG_PROMPT_MOST, MEMORY_SHARE, largest_fitting, long_prompt_tokens

H200 = Peaks(bandwidth_Bps=4158.7e9, flops=775.8e12, device_name="NVIDIA H200", dtype="bfloat16",
             source="measured by lesson 00 on the H200 run of 2026-12-04 (docs/gpu/h200-2026-12-04)")
H200_FREE_BYTES = 139e9
BF16 = torch.bfloat16
# Lesson 10's eager one-token pass of the tiny model on the H200 run (docs/gpu/h200-2026-12-04): a pass that small is
# all host, so its time over its op count is what the host spends on each op it queues (Python, dispatch, launch).
# The ops are those the pass queued in the code that run ran (commit 6d9c04b, counted as _decode_ops counts): the
# model has shed some since, and the time was that many ops'.
H200_TINY_EAGER_PASS_S = 1.53e-3
H200_TINY_EAGER_PASS_OPS = 115
# Lesson 08's graph stage of the tiny model on the H200 run: 65 kernels in 0.16 ms, a replayed kernel's fixed cost.
H200_GRAPH_KERNEL_S = 2.5e-6
# The compiled decode step's kernels: per layer, and once a step (the embedding, the output layer, the argmax). Counted
# in the code inductor writes for the skeleton's step on a CPU, 23 calls for 2 layers and 43 for 4 (TORCH_LOGS=
# output_code, FastDecoder(..., mode="compile")); Triton's fusion on a GPU may split a fused CPU loop in two.
COMPILED_STEP_KERNELS = (10, 3)
# Ops that only make a view of a tensor (or check one): the host pays for them, a GPU runs no kernel.
VIEWS = {"aten::view", "aten::transpose", "aten::unsqueeze", "aten::select", "aten::slice", "aten::split_with_sizes",
         "aten::split", "aten::flatten", "aten::to", "aten::promote_types", "aten::reshape", "aten::lift_fresh",
         "aten::detach_", "aten::detach", "aten::t", "aten::expand", "aten::as_strided", "aten::alias",
         "aten::empty", "aten::result_type", "aten::_unsafe_view"}


def _ops(run, kernels_only: bool = False) -> int:
    """How many ops `run()` queues from Python (top-level aten calls); with kernels_only, those a GPU runs a kernel
    for: not views, and a `to` only where it copies (a cast)."""
    with torch.inference_mode(), torch.profiler.profile() as prof:
        run()
    return sum(1 for e in prof.events() if e.cpu_parent is None and not (kernels_only and _no_kernel(e)))


def _no_kernel(event) -> bool:
    return event.name in VIEWS and not any(c.name == "aten::_to_copy" for c in event.cpu_children)


@functools.lru_cache(maxsize=None)
def _decode_ops(shape: str, kernels_only: bool = False) -> int:
    """The ops (or kernels) one eager batch-1 decode step of `shape` queues, on its skeleton (the same ops at toy
    width) after a 128-token prompt."""
    from labutils.decode.kvcache import KVCache
    from labutils.measure.request import skeleton_config
    from labutils.model.build import build
    from labutils.model.gpt import GPTConfig
    model = build(skeleton_config(GPTConfig.preset(shape)), dtype=BF16)    # a GPU's dtype: a cast there is a kernel
    cache = KVCache(model.config, 1, 129, dtype=BF16)
    ids = torch.zeros(1, 129, dtype=torch.long)
    with torch.inference_mode():
        model(ids[:, :128], cache)
    return _ops(lambda: model(ids[:, 128:], cache, check=False), kernels_only)


def _host_s(ops: int) -> float:
    """What the H200 run's host spends queueing `ops` eager ops: its tiny pass's time per op."""
    return H200_TINY_EAGER_PASS_S / H200_TINY_EAGER_PASS_OPS * ops


@functools.lru_cache(maxsize=1)       # rows() and markdown() both read it; the profiling builds a model
def engine_step_costs() -> tuple[float, float, int, int]:
    """(host seconds of one eager engine decode step of 8 streams on Llama-2-7B, the fixed seconds of the same step
    replayed as a graph, its ops, its kernels), from the H200 run's tiny passes and op counts taken here:
    Llama-2-7B's skeleton runs the same ops as the model."""
    from labutils.measure.request import skeleton_config
    from labutils.model.build import build
    from labutils.model.gpt import GPTConfig
    from labutils.serving.engine import Engine
    engine = Engine(build(skeleton_config(GPTConfig.preset("llama-2-7b")), dtype=BF16), 8)
    for i in range(8):
        engine.submit(list(range(1, 17 + i)), 8)
    engine.step()                                             # the prompts; then decode steps only
    engine.step()
    step_ops = _ops(engine.step)
    kernels = _ops(engine.step, kernels_only=True)
    return _host_s(step_ops), H200_GRAPH_KERNEL_S * kernels, step_ops, kernels


def _shape(cache_tokens: int, batch: int = 1) -> str:
    """The shape shape_for gives a lesson on the H200 (shape_choice.largest_fitting, on its free memory)."""
    return largest_fitting(H200_FREE_BYTES, BF16, cache_tokens, batch)


def rows() -> list[tuple[str, str, str, str]]:
    """(lesson, what the lesson claims, the arithmetic, what it predicts on the H200)."""
    bw, flops = H200.bandwidth_Bps, H200.flops
    out = []
    decode_ai = roofline.decode_flops("llama-2-7b", 1) / roofline.decode_bytes("llama-2-7b", 1)
    lowest = min([H200.ridge] + [s.ridge for s in SPECS.values() if s.ridge is not None])
    out.append(("00", "batch-1 decode sits left of every ridge, this machine's and every datasheet GPU's (at least 2x)",
                f"the lowest of the H200's measured ridge ({H200.ridge:.0f}) and the datasheets' ({lowest:.0f}) / "
                f"Llama-2-7B's batch-1 decode, {decode_ai:.1f} FLOP/byte", f"{lowest / decode_ai:.0f}x"))
    m = _shape(1200)                                          # lesson 05: its longest request, 1,000 + 200 tokens
    w = roofline.weight_bytes(m, BF16)
    cache = roofline.kv_cache_bytes(m, 1200, 1, BF16)
    out.append(("05", "the lesson's shape", f"{m}: {w / 1e9:.2f} GB of bf16 weights + {cache / 1e9:.2f} GB of cache "
                f"for 1,200 tokens <= {MEMORY_SHARE:.0%} of {H200_FREE_BYTES / 1e9:.0f} GB", m))
    pos = roofline.mean_decode_pos(1000, 200)
    step = roofline.decode_floor_s(m, pos, 1, BF16, bandwidth_Bps=bw)
    pre = roofline.prefill_floor_s(m, 1000, peak_flops=flops)
    out.append(("05", "a decode step's floor (batch 1)", f"{roofline.decode_bytes(m, pos, 1, BF16) / 1e9:.2f} GB "
                f"read at position {pos} / {bw / 1e12:.1f} TB/s", f"{step * 1e3:.2f} ms"))
    out.append(("05", "a 1,000-token prefill's floor", f"{roofline.prefill_flops(m, 1000) / 1e12:.1f} TFLOP / "
                f"{flops / 1e12:.0f} TFLOP/s", f"{pre * 1e3:.1f} ms"))
    a100 = SPECS["A100 80GB SXM"]
    a100_ratio = (200 * roofline.decode_floor_s(m, pos, 1, BF16, bandwidth_Bps=a100.bandwidth_Bps)
                  / roofline.prefill_floor_s(m, 1000, peak_flops=a100.flops_16))
    out.append(("05", "decode takes several times as long as prefill (the seed's chart: 15x)",
                f"200 x {step * 1e3:.2f} ms / {pre * 1e3:.1f} ms (A100 datasheet: {a100_ratio:.0f}x)",
                f"{200 * step / pre:.0f}x at both floors"))
    out.append(("05", "per token, prefill costs a small fraction of a decode step",
                f"{step * 1e3:.2f} ms / ({pre * 1e3:.1f} ms / 1,000)", f"{step / (pre / 1000):.0f}x"))
    # What an eager prefill costs besides its FLOPs: its host's queueing (the skeleton's TTFT; a prefill queues about
    # a decode step's ops), and its kernels' own start-up (the skeleton's pass replayed as a graph).
    pass_host = _host_s(_decode_ops(m))
    pass_fixed = _decode_ops(m, kernels_only=True) * H200_GRAPH_KERNEL_S
    out.append(("05", "an eager prefill's host time (the skeleton's TTFT)", f"{_decode_ops(m):,} ops an eager pass of "
                f"{m} queues x {_host_s(1) * 1e6:.1f} us of host each (the H200 run's eager tiny pass: "
                f"{H200_TINY_EAGER_PASS_S * 1e3:.2f} ms for {H200_TINY_EAGER_PASS_OPS} ops)", f"{pass_host * 1e3:.1f} ms"))
    out.append(("05", "its kernels' fixed costs (the skeleton's prefill pass, replayed as a graph)",
                f"{_decode_ops(m, kernels_only=True)} kernels x {H200_GRAPH_KERNEL_S * 1e6:.1f} us",
                f"{pass_fixed * 1e3:.2f} ms"))
    verdict = (f"expected, with {pre / pass_host - 1:.0%} to spare over the host's time: on a host that much slower "
               "the three (the roofline's ratio, prefill's share of the matmul peak, every position's logits) would "
               "print [not expected here]" if floor_sets_time(pre, pass_fixed, pass_host) else "not expected")
    out.append(("05", "section 3's roof claims are expected (the 1,000-token prefill's floor at least twice its "
                "kernels' fixed costs and at least its host's time)",
                f"{pre * 1e3:.1f} ms against 2 x {pass_fixed * 1e3:.2f} ms and {pass_host * 1e3:.1f} ms", verdict))

    def all_logits_x(shape: str) -> float:                     # the output layer at every position but the last
        return 1 + 999 * 2 * roofline.counts(shape).head_params / roofline.prefill_flops(shape, 1000)
    out.append(("05", "every position's logits slow prefill by about their extra FLOPs (0.8-1.25 of the FLOP ratio)",
                f"the output layer at 999 more positions against the 1,000-token prefill (gpt2-small on a CPU: "
                f"{all_logits_x('gpt2-small'):.2f}x)", f"{all_logits_x(m):.2f}x, where section 3's roof claims are "
                "expected"))
    shortest, longest = BASE_PROMPTS
    base = first_compute_bound(lambda n: BaselinePrompt(n, roofline.prefill_floor_s(m, n, peak_flops=flops),
                                                        pass_fixed, pass_host)).tokens
    ratio = roofline.prefill_flops(m, 2 * base) / roofline.prefill_flops(m, base)
    out.append(("05", f"twice the prompt about doubles TTFT ({base:,} -> {2 * base:,} tokens)",
                f"compute_bound_prompt: the shortest of {shortest:,}, {2 * shortest:,}, ... {longest:,} tokens whose "
                f"floor is at least twice {pass_fixed * 1e3:.2f} ms and at least {pass_host * 1e3:.1f} ms "
                f"({roofline.prefill_floor_s(m, base, peak_flops=flops) * 1e3:.1f} ms); then "
                f"prefill FLOPs({2 * base}) / prefill FLOPs({base}): attention's share grows with the square",
                f"{ratio:.2f}x"))
    grown = (roofline.decode_bytes(m, roofline.mean_decode_pos(2 * base, 16), 1, BF16)
             / roofline.decode_bytes(m, roofline.mean_decode_pos(base, 16), 1, BF16))
    out.append(("05", "twice the prompt moves TPOT only by the cache bytes it adds (TPOT ratio / bytes ratio, "
                "0.85-1.25)",
                f"a decode step's bytes after {2 * base:,} prompt tokens / after {base:,}: the cache grows beside "
                f"{roofline.weight_bytes(m, BF16) / 1e9:.1f} GB of weights", f"the bytes grow {grown:.2f}x; 1.00 "
                "where attention reads the cache as fast as the GEMVs read the weights"))
    pre_i = roofline.prefill_flops(m, 1000) / roofline.prefill_bytes(m, 1000, 1, BF16)
    for name, p in (("decode", roofline.decode_flops(m, pos) / roofline.decode_bytes(m, pos, 1, BF16)),
                    ("a 1,000-token prefill", pre_i)):
        out.append(("05", f"{name}'s intensity against the ridge point", f"{p:.1f} FLOP/byte against "
                    f"{H200.ridge:.0f}", f"{H200.ridge / p:.0f}x below" if p < H200.ridge else f"{p / H200.ridge:.1f}x above"))
    out.append(("05", "decode's share of the copy bandwidth is at least twice prefill's",
                "prefill's intensity / the ridge point, where both phases reach the same share of their roofs",
                f"{pre_i / H200.ridge:.1f}x; it holds while decode's share of its roof is at least "
                f"{2 * H200.ridge / pre_i:.0%} of prefill's share of its own"))
    m6 = _shape(4096)                                         # lesson 06: steps over its first 4,096 positions
    recompute = roofline.prefill_floor_s(m6, 4096, peak_flops=flops)
    cached = roofline.decode_floor_s(m6, 4096, 1, BF16, bandwidth_Bps=bw)
    out.append(("06", "at 4,096 tokens a recompute step costs several cached steps", f"{m6}: a 4,096-token pass's "
                f"{roofline.prefill_flops(m6, 4096) / 1e12:.1f} TFLOP / {flops / 1e12:.0f} TFLOP/s against a cached "
                f"step's {roofline.decode_bytes(m6, 4096, 1, BF16) / 1e9:.1f} GB / {bw / 1e12:.1f} TB/s",
                f"{recompute * 1e3:.0f} ms against {cached * 1e3:.2f} ms: {recompute / cached:.0f}x at the floors"))
    growth = roofline.decode_bytes(m6, 4096, 1, BF16) / roofline.decode_bytes(m6, 256, 1, BF16)
    out.append(("06", "with the cache the cost per step stays about flat from 256 to 4,096 tokens",
                "bytes a cached step reads at 4,096 / at 256", f"{growth:.2f}x"))
    m8 = _shape(128 + 32)                                     # lesson 08: the ladder at lesson 05's shape
    kernels8 = _decode_ops(m8, kernels_only=True)
    floor8 = roofline.decode_floor_s(m8, roofline.mean_decode_pos(128, 32), 1, BF16, bandwidth_Bps=bw)
    out.append(("08", "at the GPU shape's size the fastest stage (the graph) streams at a fair share of copy "
                "bandwidth", f"{m8}'s floor {floor8 * 1e3:.2f} ms; expected where the skeleton's graph step is at most "
                "half of it: the tiny model's graph of 65 kernels took 0.16 ms on the H200, about 2.5 us a kernel",
                f"expected if the skeleton's step has fewer than {floor8 / 2 / H200_GRAPH_KERNEL_S:.0f} kernels; "
                f"its eager step queues {kernels8} ops that run a kernel: "
                + ("expected" if 2 * kernels8 * H200_GRAPH_KERNEL_S <= floor8 else
                   "close: the claim may print [not expected here]")))
    tiny_ops, small_ops = (_decode_ops(p) for p in ("tiny", "gpt2-small"))
    out.append(("08", "time above the floor grows with the layers: at least twice for three times the layers",
                f"an eager step on a GPU is its host's queueing, one fixed cost per op: gpt2-small's {small_ops} ops a "
                f"step against the tiny model's {tiny_ops} (12 layers against 4; the embedding, the output layer and "
                "the loop's ops are paid once a step)", f"{small_ops / tiny_ops:.2f}x (the H200 run measured 2.61x)"))
    m7 = _shape(512 + 128, 64)                                # lesson 07: batch 64 at 128 positions, prefill of 512
    for batch in (1, 64):
        i = roofline.decode_flops(m7, 128, batch) / roofline.decode_bytes(m7, 128, batch, BF16)
        out.append(("07", f"a batch-{batch} decode step on the roofline", f"{m7}: {i:.1f} FLOP/byte, floor "
                    f"{roofline.decode_step_s(m7, 128, batch, BF16, bandwidth_Bps=bw, peak_flops=flops) * 1e3:.2f} ms",
                    "on the memory roof" if i < H200.ridge else "on the compute roof"))
    knee = roofline.knee_batch(m7, 128, BF16, bandwidth_Bps=bw, peak_flops=flops)
    one, many = (roofline.decode_step_s(m7, 128, b, BF16, bandwidth_Bps=bw, peak_flops=flops) for b in (1, 64))
    at_floors = [dict(phase="decode", n=b, seconds=roofline.decode_step_s(m7, 128, b, BF16, bandwidth_Bps=bw,
                                                                          peak_flops=flops)) for b in (1, 16, 32, 64)]
    out.append(("07", "the knee of throughput against batch", "batch-1 step / the time one more sequence costs",
                f"batch {knee:.0f}, beyond the slider's 64; at the floors batch 64 gives {64 * one / many:.0f}x "
                "batch 1's tokens/s"))
    out.append(("07", "the measured knee is within a factor of four of the predicted one",
                "the measured knee: the batch-1 step / the step's growth per sequence over batches 16 to 64 "
                "(figures.measured_knee), here at the floors", f"batch {measured_knee(at_floors):.0f}: "
                f"{measured_knee(at_floors) / knee:.2f}x the prediction"))
    out.append(("07", "throughput grows less than linearly: batch 64's gain over 64 (at most 0.9)",
                f"the batch-1 step's floor / the batch-64 step's: {one * 1e3:.2f} ms against {many * 1e3:.2f} ms, "
                "which adds 64 sequences' cache reads", f"{one / many:.2f} at the floors"))
    i512 = roofline.prefill_flops(m7, 512) / roofline.prefill_bytes(m7, 512, 1, BF16)
    out.append(("07", "a 512-token prefill on the roofline", f"{i512:.0f} FLOP/byte against {H200.ridge:.0f}",
                f"{roofline.prefill_floor_s(m7, 512, peak_flops=flops) * 1e3:.1f} ms floor, "
                + ("on the compute roof" if i512 > H200.ridge else "still below the ridge")))
    gemv = GiB                                                # lesson 07's GEMV: the copy probe's GPU buffer
    out.append(("07", "at one row the GEMV moves bytes at a large share of the copy bandwidth",
                f"a {gemv // (2 * 4096):,} x 4,096 bf16 weight ({gemv / 2**30:.0f} GiB, as large as the copy probe's "
                f"buffer) / {bw / 1e12:.1f} TB/s, against a launch of a few us", f"{gemv / bw * 1e3:.2f} ms a GEMV: "
                "a launch is a few percent of it at most, so the share is the kernel's own"))
    int8 = roofline.weight_bytes(m7, BF16) / (roofline.counts(m7).n_params * 1)
    out.append(("07", "int8 weights decode faster than bf16 (TPOT int8 / bf16, at most 0.9x)", "int8 bytes / bf16 "
                "bytes (one byte a weight against two), each through the graphed step, int8's compiled (gpt-fast: "
                "104.9 / 155.6 tokens/s = 0.67x on an A100)", f"{1 / int8:.2f}x at the floors (the bench's target: "
                "bf16 / int8 above 1.3x)"))
    m9 = _shape(128 + 1, 64)                                  # lesson 09 section 1: batch 1 to 64 at 128 positions
    tok = {b: b / roofline.decode_step_s(m9, 128, b, BF16, bandwidth_Bps=bw, peak_flops=flops) for b in (1, 2, 32, 64)}
    cache64 = roofline.kv_cache_bytes(m9, 128, 64, BF16)
    out.append(("09", "batching pays: batch 64 serves many times the tokens/s of batch 1 (at least 5x)",
                f"{m9}: batch / the step's floor, at 128 cached positions", f"{tok[64] / tok[1]:.0f}x at the floors"))
    out.append(("09", "the curve bends: batch 32 -> 64 gains less than 1 -> 2",
                f"tokens/s ratios at the floors; batch 64's cache is {cache64 / 1e9:.1f} GB beside "
                f"{roofline.weight_bytes(m9, BF16) / 1e9:.1f} GB of weights, read every step",
                f"{tok[64] / tok[32]:.2f}x against {tok[2] / tok[1]:.2f}x: "
                + ("holds, by the cache reads alone" if tok[64] / tok[32] < tok[2] / tok[1] else "does not hold")))
    host, fixed, step_ops, kernels = engine_step_costs()
    floor1 = roofline.decode_floor_s(m9, 128, 1, BF16, bandwidth_Bps=bw)
    kernels9 = _decode_ops(m9, kernels_only=True)
    skeleton = kernels9 * H200_GRAPH_KERNEL_S
    out.append(("09", "a step costs between the larger of its byte floor and its ops' fixed costs and their sum",
                f"{m9}, batch 1: the floor {floor1 * 1e3:.2f} ms; the skeleton's graphed step, "
                f"{kernels9} kernels x {H200_GRAPH_KERNEL_S * 1e6:.1f} us = "
                f"{skeleton * 1e3:.2f} ms; the window is 0.9 x the larger / the sum to 1.25",
                f"{0.9 * max(floor1, skeleton) / (floor1 + skeleton):.2f} to 1.25; a step at the floor, its kernels' "
                f"start-up hidden behind its bytes, gives {floor1 / (floor1 + skeleton):.2f}"))
    floor7 = roofline.decode_floor_s("llama-2-7b", 64, 8, BF16, bandwidth_Bps=bw)
    out.append(("09, 11", "the serving engine's steps (09 section 5, 11 sections 2, 3 and 5)",
                f"llama-2-7b: {step_ops:,} ops an eager decode step of 8 streams x "
                f"{_host_s(1) * 1e6:.1f} us (the H200 run's eager tiny pass: "
                f"{H200_TINY_EAGER_PASS_S * 1e3:.2f} ms for {H200_TINY_EAGER_PASS_OPS} ops); replayed as a graph (decode rows and at most one "
                f"chunk of up to {MOST_CHUNK} tokens), "
                f"{kernels:,} kernels x {H200_GRAPH_KERNEL_S * 1e6:.1f} us",
                f"eager {host * 1e3:.0f} ms of host a step, {host / floor7:.0f}x the {floor7 * 1e3:.2f} ms read; "
                f"a graphed decode step {(floor7 + fixed) * 1e3:.1f} ms. Each serving claim below also gives its "
                "ratio on the engine: steps with a long prefill eager, the others graphed"))

    def eager(t):                                             # a step with a long prefill: queued from Python
        return max(host, t)

    def graphed(t):                                           # decode rows and a short chunk, replayed: kernels' costs
        return t + fixed
    m9p = _shape(LONG_PROMPT_MOST + 32, 4)                    # lesson 09 section 5: a long system prompt, then a hit
    system = long_prompt_tokens(get_shape(m9p))
    miss = roofline.prefill_floor_s(m9p, system + 12, peak_flops=flops)
    hit = roofline.decode_step_s(m9p, system + 12, 1, BF16, bandwidth_Bps=bw, peak_flops=flops)   # few tokens: a read
    out.append(("09", "with caching on, the second request's TTFT is a small fraction of the first's (at most 0.25)",
                f"{m9p}: a {system + 12:,}-token prefill, {roofline.prefill_flops(m9p, system + 12) / 1e12:.0f} TFLOP, "
                f"against one forward of its 12-token question over the cached {system:,}, {hit * 1e3:.2f} ms",
                f"{hit / miss:.2f}x at the floors; {graphed(hit) / eager(miss):.2f}x on the engine"))
    chat = 2 * system // 3
    off = roofline.prefill_floor_s(m9p, chat + 36, peak_flops=flops)      # the workload's mean question: 36 tokens
    out.append(("09", "over the workload, prefix caching cuts the median TTFT (at most 0.5x)",
                f"a step holding a {chat + 36:,}-token prefill ({off * 1e3:.1f} ms) against one holding only its "
                f"question ({hit * 1e3:.2f} ms): the median request is not queued at 20 requests/s",
                f"{hit / (off + hit):.2f}x at the floors; {graphed(hit) / eager(off + hit):.2f}x on the engine"))
    out.append(("10", "the tiny target's passes: 4 tokens cost at most 2.5 one-token passes, under 1.5 in bf16, and "
                "a verify pass costs about one baseline step or more (at least 0.9)", "a pass of the tiny model is its "
                f"kernels' fixed costs ({tiny_ops} ops queued eagerly, about 65 kernels replayed at "
                f"{H200_GRAPH_KERNEL_S * 1e6:.1f} us each); 4 tokens add 4 x 0.03 GFLOP, nanoseconds at "
                f"{flops / 1e12:.0f} TFLOP/s", "about 1x each; the H200 run measured 1.40x, 1.33x and 1.36x"))
    m10 = _shape(128 + 512)                                   # lesson 10: verify passes of up to 512 tokens

    def verify(n):                                            # one sequence: the weights and its cache read once
        return max(roofline.decode_bytes(m10, 128, 1, BF16) / bw, roofline.decode_flops(m10, 128, n) / flops)
    out.append(("10", "one verify pass over 16 tokens costs at most a quarter of 16 one-token passes",
                f"{m10}: {roofline.decode_bytes(m10, 128, 1, BF16) / 1e9:.1f} GB read ({verify(1) * 1e3:.2f} ms) "
                f"against 16 x {roofline.decode_flops(m10, 128) / 1e9:.1f} GFLOP "
                f"({roofline.decode_flops(m10, 128, 16) / flops * 1e3:.2f} ms)", f"{verify(16) / verify(1):.2f}x"))
    out.append(("10", "past the ridge point 512 tokens cost at least twice what 64 do",
                f"{roofline.decode_flops(m10, 128, 512) / 1e12:.1f} TFLOP ({verify(512) * 1e3:.1f} ms) against the "
                f"read ({verify(64) * 1e3:.2f} ms)", f"{verify(512) / verify(64):.1f}x at the floors"))
    out.append(("10", "speculation pays more at batch 1 than at batch 128 (k = 3)",
                "a verify pass of B x 4 tokens in passes of B tokens, at the floors, for B = 1 and 128",
                f"{verify(4) / verify(1):.2f} against {verify(512) / verify(128):.2f} decode steps"))
    m11 = _shape(LONG_PROMPT_MOST + 64, 9)                    # lesson 11 section 2: 8 streams and one long prompt
    long = long_prompt_tokens(get_shape(m11))                 # the lesson's rule: 3,072 on a 4,096 context
    whole = roofline.prefill_floor_s(m11, long, peak_flops=flops)
    step8 = roofline.decode_step_s(m11, 64, 8, BF16, bandwidth_Bps=bw, peak_flops=flops)
    chunk = roofline.decode_step_s(m11, 64, 64, BF16, bandwidth_Bps=bw, peak_flops=flops)   # 8 decode + 56 prompt
    out.append(("11", "a whole prefill makes the streams' p99 ITL spike far above their median (at least 5x)",
                f"{m11}: a {long:,}-token prefill, {roofline.prefill_flops(m11, long) / 1e12:.0f} TFLOP / "
                f"{flops / 1e12:.0f} TFLOP/s, against a step of 8 streams, {step8 * 1e3:.2f} ms (its weights' read)",
                f"{(whole + step8) / step8:.0f}x at the floors (8 of the 376 gaps hold the stall: p99 is one); "
                f"{eager(whole + step8) / graphed(step8):.1f}x on the engine"))
    out.append(("11", "chunked prefill cuts that p99 ITL at least in half (budget 64)",
                f"a step of 64 tokens (8 decode + 56 prompt) at its floor, {chunk * 1e3:.2f} ms, against the stall",
                f"{chunk / (whole + step8):.2f}x at the floors; {graphed(chunk) / eager(whole + step8):.2f}x on the engine"))
    out.append(("11", "the price: the long prompt's TTFT grows (chunked / whole, at least 1x)",
                f"{-(-long // 56)} steps of {chunk * 1e3:.2f} ms against one of {(whole + step8) * 1e3:.0f} ms",
                f"{-(-long // 56) * chunk / (whole + step8):.1f}x at the floors; "
                f"{-(-long // 56) * graphed(chunk) / eager(whole + step8):.1f}x on the engine"))
    sweep = roofline.prefill_floor_s(m11, 768, peak_flops=flops)
    step32 = roofline.decode_step_s(m11, 64, 32, BF16, bandwidth_Bps=bw, peak_flops=flops)
    out.append(("11", "section 3: the smallest budget keeps p99 ITL well below whole prefills' (at most 0.5x)",
                f"a step of 32 tokens at its floor, {step32 * 1e3:.2f} ms, against one holding a 768-token prefill "
                f"({roofline.prefill_flops(m11, 768) / 1e12:.1f} TFLOP, {sweep * 1e3:.1f} ms)",
                f"{step32 / (sweep + step8):.2f}x at the floors, for the p99 gap that holds such a prefill; "
                f"{graphed(step32) / eager(sweep + step8):.2f}x on the engine"))
    def stall(n):                                             # a step holding an n-token whole prefill, at its floor
        return roofline.prefill_floor_s(m11, n, peak_flops=flops) + step8
    work = roofline.prefill_flops(m11, long) / roofline.prefill_flops(m11, long // 2)
    out.append(("11", "exercise 1: the spike grows with the prefill's work: at least half as fast, at most a tenth "
                "faster (0.5-1.1 of the work ratio)",
                f"{m11}: the step holding a {long:,}-token whole prefill over the "
                f"one holding {long // 2:,} tokens, against their work ratio, {work:.2f}x",
                f"{stall(long) / stall(long // 2) / work:.2f} at the floors; "
                f"{eager(stall(long)) / eager(stall(long // 2)) / work:.2f} on the engine"))
    m11s = _shape(768 + 64, 8)                                # lesson 11 section 5: section 3's shape, simulated
    decode16 = roofline.decode_step_s(m11s, 512, 16, BF16, bandwidth_Bps=bw, peak_flops=flops)
    stalled = roofline.prefill_floor_s(m11s, 640, peak_flops=flops) + decode16
    out.append(("11", "section 5: with long prompts the decode worker keeps TPOT below the mixed engines' (at most 0.9x)",
                f"{m11s}: the decode worker's step of 16 streams, {decode16 * 1e3:.2f} ms, against a mixed step that "
                f"also holds a 640-token prefill, {stalled * 1e3:.1f} ms", f"{decode16 / stalled:.2f}x for a step "
                "that holds a prefill; the mean over a stream's steps depends on how many prefills land among them; "
                f"{graphed(decode16) / eager(stalled):.2f}x on the engine"))
    prefills = 24 * roofline.decode_step_s(m11s, 40, 1, BF16, bandwidth_Bps=bw, peak_flops=flops)   # 16-64 tokens
    steps = 24 * 160 / 16 * roofline.decode_step_s(m11s, 200, 16, BF16, bandwidth_Bps=bw, peak_flops=flops)
    out.append(("11", "section 5, long answers: the decode worker steps nearly all the run (at least 90%), the prefill "
                "worker at most 25%", f"24 prompts of 16-64 tokens, each a read of the weights, {prefills * 1e3:.0f} ms,"
                f" against 24 x 160 new tokens in steps of 16 streams, {steps * 1e3:.0f} ms",
                f"the prefill worker {prefills / (prefills + steps):.0%} of the decode worker's time, at the floors"))
    out += bench_rows(fixed, host, kernels)
    return out


def bench_rows(step_fixed: float, step_host: float, step_kernels: int) -> list[tuple[str, str, str, str]]:
    """The bench's GPU targets on the H200 (issue 27), with the engine's step costs for the serving row."""
    from labutils.bench.common import MAX_CONTEXT, NEW_TOKENS, PROMPT_LEN
    bw, flops, m = H200.bandwidth_Bps, H200.flops, "llama-2-7b"
    pos = roofline.mean_decode_pos(PROMPT_LEN, NEW_TOKENS)
    floor = roofline.decode_floor_s(m, pos, 1, BF16, bandwidth_Bps=bw)
    kernels = _decode_ops(m, kernels_only=True)
    fixed = kernels * H200_GRAPH_KERNEL_S
    per_layer, once = COMPILED_STEP_KERNELS
    fused = per_layer * get_shape(m).n_layer + once
    out = [("bench", "decode bytes/s / copy bandwidth, batch 1, the graph loop (target at least 0.8), the faster of "
            "the eager step's graph and the compiled step's",
            f"{m}: the floor {floor * 1e3:.2f} ms; the eager step's graph replays {kernels} kernels at "
            f"{H200_GRAPH_KERNEL_S * 1e6:.1f} us each, {fixed * 1e3:.2f} ms; compiled, {per_layer} a layer (5 matmuls, "
            f"attention and 4 fused elementwise kernels, as inductor writes the skeleton's step for a CPU) and {once} "
            f"more, {fused} kernels, {fused * H200_GRAPH_KERNEL_S * 1e3:.2f} ms; 0.8 allows "
            f"{0.25 * floor / H200_GRAPH_KERNEL_S:.0f}",
            f"{floor / (floor + fixed):.2f} for the eager step's graph; "
            f"{floor / (floor + fused * H200_GRAPH_KERNEL_S):.2f} for the compiled step's, at the target with nothing "
            "to spare unless kernels start while their neighbours still stream (gpt-fast: 0.82 on an A100, whose "
            "floor is twice as long)")]
    pre = roofline.prefill_floor_s(m, 2048, peak_flops=flops)
    out.append(("bench", "prefill FLOP/s at 2,048 tokens / matmul FLOP/s (target at least 0.6)",
                f"{roofline.prefill_flops(m, 2048) / 1e12:.1f} TFLOP, {pre * 1e3:.1f} ms at the peak; eager, its "
                f"host queues about {_decode_ops(m):,} ops while the GPU runs them, and each kernel adds its start-up",
                f"{pre / (pre + fixed):.2f} at the peak with the kernels' start-up"))
    int8 = floor - roofline.step_weight_bytes(m, 1, 1, BF16) / 2 / bw     # the weights a step reads, at one byte
    out.append(("bench", "bf16 TPOT / int8 TPOT, batch 1 (target above 1.3x)",
                f"each step's bytes, int8 weights at one byte against two, the same cache; the compiled int8 step "
                f"fuses each cast into its matmul, so it starts no more kernels than the float graph's "
                f"{fixed * 1e3:.2f} ms", f"at least {(floor + fixed) / (int8 + fixed):.2f}x; {floor / int8:.2f}x at "
                "the floors"))
    long = MAX_CONTEXT - 512                                  # the row's long prompt on a GPU, and its budget of 256
    whole = roofline.prefill_floor_s(m, long, peak_flops=flops) + roofline.decode_floor_s(m, 64, 8, BF16,
                                                                                           bandwidth_Bps=bw)
    chunk = roofline.decode_step_s(m, 64, 256, BF16, bandwidth_Bps=bw, peak_flops=flops)
    out.append(("bench", "the longest stream gap, chunked / whole prefill (target at most 0.5)",
                f"a step holding a {long:,}-token prompt whole ({whole * 1e3:.0f} ms at the floors, eager: "
                f"{step_host * 1e3:.0f} ms of host runs behind it) against a step of a 256-token budget "
                f"({chunk * 1e3:.2f} ms, graphed: {step_kernels} kernels, {step_fixed * 1e3:.2f} ms)",
                f"{chunk / whole:.2f}x at the floors; "
                f"{(chunk + step_fixed) / max(whole, step_host):.2f}x on the engine"))
    return out


def markdown() -> str:
    host = engine_step_costs()[0]
    lines = ["# What the GPU-shaped lessons and the bench should measure on an H200", "",
             f"Written by `python -m labutils.gpu_predictions` from `labutils.perf.roofline` and the H200's peaks, "
             f"{H200.line()} ({H200.source}), and its {H200_FREE_BYTES / 1e9:.0f} GB. Floors are the least time the bytes or FLOPs allow; "
             "a lesson's claim holds when its measured times sit near them.", "",
             "The serving engine (lessons 09 and 11) adds its own cost to every step: a step replayed as a CUDA graph "
             f"(decode rows and at most one prefill chunk of up to {MOST_CHUNK} tokens) pays each kernel's fixed cost, "
             f"and an eager one (a longer prefill) pays the host for each op it queues, {host * 1e3:.0f} ms for "
             "Llama-2-7B (the row 'the serving engine's steps'). Each serving claim gives a second figure with those "
             "costs in; where it breaks the claim's bound, the claim is expected to fail on the H200.", "",
             "| lesson | claim | arithmetic | on the H200 |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
