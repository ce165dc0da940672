"""Measure real passes on random-weight models of preset shapes: one request, or one prefill / decode pass."""
from __future__ import annotations

import dataclasses
import gc
import statistics
import warnings
from collections import OrderedDict
from typing import Callable, NamedTuple

import torch

from labutils.perf import quiet, roofline
from labutils.core.dtypes import COMPUTE_DTYPES, dtype_name
from labutils.decode.fastgen import capture_graph, fast_generate
from labutils.decode.loop import generate
from labutils.core.devices import default_dtype, free_memory_bytes, graphs_unavailable, is_oom, pick_device
from labutils.decode.kvcache import KVCache
from labutils.perf.timing import time_fn
from labutils.model.build import build
from labutils.model.gpt import GPT, GPTConfig
from labutils.perf.peaks import Peaks, check_peaks, measured_peaks
from labutils.model.presets import PRESETS
from labutils.core.progress_bar import Steps
from labutils.core.validate import (check_choice, check_count, check_device, check_seed, describe, model_device,
                                    parse_dtype)
from labutils.core.draw import random_ids

# On a CPU, building a multi-billion-parameter model means minutes of random initialisation,
# so the bigger shapes are offered only on a GPU.
CPU_PRESETS = ("tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")

_MODELS: "OrderedDict[tuple[str, torch.dtype, str, int | None], GPT]" = OrderedDict()
MAX_CACHED_MODELS = 2        # models are large; keep the two most recently used


def available_devices() -> list[str]:
    """Device names this machine can measure on, best first ("cuda", "mps", "cpu")."""
    names = []
    for name in ("cuda", "mps", "cpu"):
        try:
            pick_device(name)
            names.append(name)
        except ValueError:          # validate.DeviceUnavailableError: not on this machine
            pass
    return names


def dtype_choices(device) -> list[str]:
    """Weight dtypes worth offering on `device`. CPUs run bf16/fp16 too, often slower than fp32."""
    kind = check_device("device", device).type
    if kind == "cuda":
        bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
        return ["fp32", "bf16", "fp16"] if bf16 else ["fp32", "fp16"]
    if kind == "mps":
        return ["fp32", "fp16"]
    return ["fp32", "bf16", "fp16"]


def contender_dtypes(device) -> list[str]:
    """The float weight dtypes int8 weights are timed against on `device`: fp32 and bf16 on a CPU, where either can be
    the faster; on a GPU its 16-bit dtype alone (fp32 is no contender there, and a 7B model in fp32 is 27 GB)."""
    return ["fp32", "bf16"] if check_device("device", device).type == "cpu" else [default_dtype_name(device)]


def default_dtype_name(device) -> str:
    """The dtype name models run in on `device` (core.devices.default_dtype): "fp32" on a CPU, "bf16" on a recent GPU."""
    return dtype_name(default_dtype(device))


def free_bytes(device) -> float:
    """Memory free for a new model on `device` (models this module caches count as free: they can be evicted)."""
    device = check_device("device", device)
    cached = sum(roofline.weight_bytes(m) for (_, _, dev, _), m in _MODELS.items()
                 if torch.device(dev).type == device.type)
    free = free_memory_bytes(device)
    if free is None:           # the platform does not say (some Apple GPUs): do not block, OOM is still caught
        return float("inf")
    return free + cached


def model_config(preset: str, context_length: int | None = None) -> GPTConfig:
    """The preset's shape; `context_length` gives the random-weight model a longer (or shorter) position table."""
    if context_length is None:
        return GPTConfig.preset(preset)
    return GPTConfig.preset(preset, context_length=check_count("context_length", context_length, 1))


def _parse_dtype(dtype) -> torch.dtype:
    """The one parse of a learner's dtype in this module: a name ("bf16") or torch dtype a model computes in."""
    return parse_dtype("dtype", dtype, COMPUTE_DTYPES)


def memory_needed(preset: str, prompt_len: int, new_tokens: int, batch: int = 1, dtype: str = "fp32",
                  context_length: int | None = None) -> int:
    """Rough peak bytes of one request: weights + KV cache + the prefill's largest activations."""
    cfg = model_config(preset, context_length)
    prompt_len, new_tokens = check_count("prompt_len", prompt_len, 1), check_count("new_tokens", new_tokens, 1)
    batch, dtype = check_count("batch", batch, 1), _parse_dtype(dtype)
    return _memory_needed(cfg, prompt_len, new_tokens, batch, dtype)


def _memory_needed(cfg: GPTConfig, prompt_len: int, new_tokens: int, batch: int, dtype: torch.dtype) -> int:
    elem = dtype.itemsize
    weights = roofline.weight_bytes(cfg, dtype)         # model.build allocates them once, in this dtype
    kv = roofline.kv_cache_bytes(cfg, prompt_len + new_tokens, batch, dtype)
    tokens = batch * prompt_len
    logits = batch * cfg.vocab_size * (elem + 4)        # the last position only (GPT.forward(last_only=True))
    scratch = tokens * (cfg.n_inner + 4 * cfg.n_embd) * elem * 2 + batch * cfg.n_head * prompt_len ** 2 * 4
    return weights + kv + logits + scratch


def preset_choices(device) -> tuple[list[str], list[str]]:
    """(presets whose weights fit on `device`, one note per preset left out and why)."""
    device = check_device("device", device)
    free = free_bytes(device)
    offered, notes = [], []
    for name, shape in PRESETS.items():
        if device.type == "cpu" and name not in CPU_PRESETS:
            continue
        smallest = torch.float16 if device.type != "cpu" else torch.float32   # on a CPU fp32 is worth timing
        need = _memory_needed(model_config(name), 1, 1, 1, smallest)
        if need < 0.8 * free:
            offered.append(name)
        else:
            notes.append(f"{name}: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free on {device.type}")
    if device.type == "cpu":
        notes.append("7B+ shapes: GPU only (random initialisation of billions of weights takes minutes on a CPU)")
    return offered, notes


def check_preset_request(preset: str, prompt_len: int, new_tokens: int, batch: int = 1, dtype: str = "fp32",
                         device="cpu", context_length: int | None = None) -> None:
    """Raise a ValueError that names the problem and the way out, before anything is allocated.

    A request described by a preset and its lengths, before any model exists: the preset, the lengths against its
    context, the dtype on this device, the memory it needs. (decode.loop.check_request checks a built model and its
    ids.)"""
    cfg = model_config(preset, context_length)      # unknown preset -> ValueError listing the names
    batch = check_count("batch", batch, 1)
    prompt_len, new_tokens = _check_lengths(prompt_len, new_tokens)
    _check_request(preset, cfg, prompt_len, new_tokens, batch, _parse_dtype(dtype), device, context_length)


def _check_lengths(prompt_len, new_tokens) -> tuple[int, int]:
    return (check_count("prompt_len", prompt_len, 1),
            check_count("new_tokens", new_tokens, 2, hint="TPOT needs at least two output tokens"))


def _check_request(preset: str, cfg: GPTConfig, prompt_len: int, new_tokens: int, batch: int, dtype: torch.dtype,
                   device, context_length: int | None) -> None:
    name = dtype_name(dtype)
    if name not in dtype_choices(device):
        raise ValueError(f"{name} is not supported on {torch.device(device).type}; "
                         f"choose one of {dtype_choices(device)}")
    if prompt_len + new_tokens > cfg.context_length:
        raise ValueError(f"prompt ({prompt_len}) + output ({new_tokens}) = {prompt_len + new_tokens} tokens exceed "
                         f"{preset}'s context length {cfg.context_length}; shorten one of them"
                         + ("" if context_length else " (or pass context_length= for a longer position table)"))
    need = _memory_needed(cfg, prompt_len, new_tokens, batch, dtype)
    free = free_bytes(device)
    if need > 0.9 * free:
        raise ValueError(f"{preset} in {name} with batch {batch} and {prompt_len}+{new_tokens} tokens needs about "
                         f"{need / 1e9:.1f} GB, but only {free / 1e9:.1f} GB is free on {torch.device(device).type}; "
                         "choose a smaller preset, a 2-byte dtype, a smaller batch or fewer tokens"
                         + (f" (context_length={context_length} sets the position table)" if context_length else ""))


def get_model(preset: str, dtype: str = "fp32", device="cpu", context_length: int | None = None) -> GPT:
    """A random-weight GPT of the preset's shape, built once per (preset, dtype, device, context) and cached."""
    cfg = model_config(preset, context_length)    # the preset and context, checked before anything is built
    return _get_model(preset, cfg, _parse_dtype(dtype), check_device("device", device), context_length)


def _get_model(preset: str, cfg: GPTConfig, dtype: torch.dtype, device: torch.device,
               context_length: int | None) -> GPT:
    key = (preset, dtype, str(device), context_length)
    if key in _MODELS:
        _MODELS.move_to_end(key)
        return _MODELS[key]
    while len(_MODELS) >= MAX_CACHED_MODELS:
        clear_models(1)
    need = _memory_needed(cfg, 1, 1, 1, dtype)
    while _MODELS and need > 0.9 * (free_bytes(device) - sum(roofline.weight_bytes(m) for m in _MODELS.values())):
        clear_models(1)           # make room: drop the least recently used model
    free = free_bytes(device)
    if need > 0.9 * free:         # refused before anything is allocated: a 7B model in fp32 would kill the kernel
        raise ValueError(f"{preset} in {dtype_name(dtype)} needs about {need / 1e9:.1f} GB to build, but only "
                         f"{free / 1e9:.1f} GB is free on {device.type}; choose a smaller preset"
                         + (", or a 2-byte dtype on a GPU" if dtype == torch.float32 else ""))
    model = build(cfg, device, dtype, seed=0)    # on the device, in its dtype: no fp32 copy of a 7B model first
    # One short untimed request: the first call pays one-off costs (allocator, kernel selection).
    generate(model, torch.zeros(1, 4, dtype=torch.long), 2)
    _MODELS[key] = model
    return model


def clear_models(n: int | None = None) -> None:
    """Forget the n least recently used models (all when n is None) and give their memory back."""
    for _ in range(len(_MODELS) if n is None else min(n, len(_MODELS))):
        _MODELS.popitem(last=False)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_request(preset: str, prompt_len: int, new_tokens: int, batch: int = 1, dtype: str = "fp32",
                    device="cpu", *, repeats: int = 1, peaks=None, seed: int = 0,
                    context_length: int | None = None, progress_desc: str = "", skeleton: bool = False,
                    on_token=None) -> dict:
    """Run one real request (random prompt ids, greedy decode) and return its metrics as a plain row.

    With repeats > 1 the request runs that many times; TTFT and TPOT are medians and the timestamps
    come from the run with the median latency. `peaks` (peaks.measured_peaks) defaults to this
    device's measured bandwidth and FLOP/s, for MBU and MFU. `context_length` overrides the preset's
    position table (GPT-2's 1,024 positions cannot hold 1,000 + 200 tokens). With a `progress_desc`, a bar in
    the notebook counts the tokens of every run as they arrive. With skeleton=True the same request runs on the
    preset's skeleton (`skeleton_config`: its layers and ops at toy width), through the same loop: its TTFT and
    TPOT are what a prefill and a decode step cost besides their FLOPs and bytes (see floor_sets_time).
    `on_token(done, total)` is called as each token arrives (a widget's own progress bar).
    """
    repeats = check_count("repeats", repeats, 1, 1000)
    return measure_requests(preset, [(prompt_len, new_tokens)], batch, dtype, device, rounds=repeats, peaks=peaks,
                            seed=seed, context_length=context_length, progress_desc=progress_desc,
                            skeleton=skeleton, on_token=on_token)[0]


def measure_requests(preset: str, settings, batch: int = 1, dtype: str = "fp32", device="cpu", *, rounds: int = 1,
                     peaks=None, seed: int = 0, context_length: int | None = None, progress_desc: str = "",
                     skeleton: bool = False, on_token=None) -> list[dict]:
    """measure_request for several (prompt_len, new_tokens) settings of one model, run in turn, round after
    round (A B C A B C ...): a slow patch of a noisy machine then lands on every setting alike, so the
    ratios between their rows hold. One row per setting, as measure_request returns it."""
    # Every argument is parsed here, once; what follows takes the canonical values (a torch.dtype, a torch.device,
    # ints) as they are.
    device = check_device("device", device)
    given_peaks = peaks is not None
    if given_peaks:
        check_peaks(peaks)
    settings = [tuple(s) for s in settings]
    if not settings or any(len(s) != 2 for s in settings):
        raise ValueError(f"settings must be (prompt_len, new_tokens) pairs, got {settings!r}")
    cfg = model_config(preset, context_length)
    if skeleton:          # the same request on the preset's layers at toy width: a model of its own in the cache
        preset, cfg = f"{preset} skeleton", skeleton_config(cfg)
    batch = check_count("batch", batch, 1)
    settings = [_check_lengths(prompt_len, new_tokens) for prompt_len, new_tokens in settings]
    dtype = _parse_dtype(dtype)
    for prompt_len, new_tokens in settings:
        _check_request(preset, cfg, prompt_len, new_tokens, batch, dtype, device, context_length)
    rounds, seed = check_count("rounds", rounds, 1, 1000), check_seed(seed)
    try:
        model = _get_model(preset, cfg, dtype, device, context_length)
        ids = [random_ids(model.config.vocab_size, (batch, p), seed) for p, _ in settings]
        generate(model, ids[0][:, :min(settings[0][0], 16)], 2)     # warm this batch size up, untimed
        total = rounds * sum(n for _, n in settings)
        bar = Steps(total if progress_desc else 0, progress_desc)

        def token(text: str) -> None:
            bar.step(text)                                          # bar.count counts, with or without a bar shown
            if on_token is not None:
                on_token(bar.count, total)

        runs = [[] for _ in settings]
        with quiet.watch():                                         # one line if others were busy meanwhile
            for r in range(rounds):
                for i, ((prompt_len, new_tokens), prompt) in enumerate(zip(settings, ids)):
                    bar.show(f"round {r + 1} of {rounds}: prefill of {prompt_len} tokens x batch {batch}")
                    decoding = f"round {r + 1} of {rounds}, decoding"
                    runs[i].append(timed_generate(model, prompt, new_tokens,
                                                  on_token=lambda _, text=decoding: token(text)))
        bar.done()
    except (RuntimeError, MemoryError) as err:    # torch.OutOfMemoryError is a RuntimeError
        if not is_oom(err):
            raise
        clear_models()
        raise RuntimeError(f"{device.type} ran out of memory for {preset} in {dtype_name(dtype)}, batch {batch}, "
                           f"{max(p for p, _ in settings)}+{max(n for _, n in settings)} tokens; the cached models "
                           "were freed. Choose a smaller setting") from None
    peaks = measured_peaks(device, dtype) if peaks is None else peaks
    rows = [_request_row(preset, model.config, p, n, batch, dtype, device, mine, peaks)
            for (p, n), mine in zip(settings, runs)]
    if given_peaks:
        # A share above 1 of a peak passed in means the peaks are not this device's. Measured peaks can be beaten by
        # a little (a copy probe and a decode step meet a noisy machine at different moments), so allow a margin.
        worst = max(max(row["mbu"], row["mfu_prefill"], row["mfu_decode"]) for row in rows)
        if worst > MAX_SHARE_OF_GIVEN_PEAKS:
            raise ValueError(f"with the peaks passed in this request used {worst:.3g}x of a peak, more than all of "
                             f"it: peaks={peaks} cannot be this device's; pass measured_peaks(device) or leave "
                             "peaks out")
    return rows


MAX_SHARE_OF_GIVEN_PEAKS = 1.25


def timed_generate(model: GPT, prompt: torch.Tensor, new_tokens: int, on_token=None):
    """One timed request through this device's decode loop (a GenerationResult). On CUDA its decode steps replay a
    CUDA graph (fastgen's "auto": compiled too for int8 weights): a step then costs its bytes, not its launches, which
    lesson 08 measures on their own. Elsewhere lesson 05's loop: graphs exist only on CUDA, and a CPU runs each op on
    the calling thread, with no launch to save."""
    if next(model.parameters()).device.type == "cuda":
        return fast_generate(model, prompt, new_tokens, mode="auto", on_token=on_token)
    return generate(model, prompt, new_tokens, on_token=on_token)


def _request_row(preset, cfg, prompt_len: int, new_tokens: int, batch: int, dtype: torch.dtype, device, runs,
                 peaks) -> dict:
    """One setting's runs -> measure_request's row: medians of TTFT and TPOT, the median-latency run's timestamps."""
    ttft = statistics.median(r.ttft_s for r in runs)
    tpot = statistics.median(r.tpot_s for r in runs)
    typical = sorted(runs, key=lambda r: r.latency_s)[len(runs) // 2]
    pos = roofline.mean_decode_pos(prompt_len, new_tokens)
    step_bytes = roofline.decode_bytes(cfg, pos, batch, dtype)
    prefill_flops = roofline.prefill_flops(cfg, prompt_len, batch)    # the one count: floors and MFU use it
    decode_flops = roofline.decode_flops(cfg, pos, batch)
    # warn=False: roofline warns about a utilization above 1 (usually a unit typed by hand). Here every
    # input is measured in the right units, and a small model held in a CPU cache really can beat DRAM.
    utilization = dict(mbu=roofline.mbu(cfg, pos, batch, dtype, tpot, peaks.bandwidth_Bps, warn=False),
                       mfu_prefill=roofline.mfu(prefill_flops, ttft, peaks.flops, warn=False),
                       mfu_decode=roofline.mfu(decode_flops, tpot, peaks.flops, warn=False))
    return dict(
        preset=preset, dtype=dtype_name(dtype), device=str(device), device_name=peaks.device_name, batch=batch,
        prompt_len=prompt_len, new_tokens=new_tokens, context_length=cfg.context_length,
        ttft_s=ttft, tpot_s=tpot, latency_s=typical.latency_s, timestamps=list(typical.timestamps),
        throughput_tok_s=batch * new_tokens / typical.latency_s,     # output tokens/s over the request
        decode_tok_s=batch / tpot,
        decode_pos=pos, decode_bytes=step_bytes, achieved_Bps=step_bytes / tpot,
        prefill_flops=prefill_flops, achieved_flops=prefill_flops / ttft,          # MFU's numerator
        **utilization,
        peak_bandwidth_Bps=peaks.bandwidth_Bps, peak_flops=peaks.flops,
    )


# ---- one pass at a time, for the roofline (lesson 07) ------------------------------------------------------------

PASS_PHASES = ("prefill", "decode", "verify")


def time_pass(model: GPT, phase: str, n: int, *, pos: int = 128, repeats: int = 5) -> float:
    """Median seconds of one forward pass: phase "prefill" (a prompt of n tokens, batch 1), "decode" (one step for a
    batch of n sequences, each with `pos` cached positions) or "verify" (n new tokens of one sequence after `pos`
    cached ones, with logits at every one of them: speculative decoding's check of n - 1 proposals, lesson 10).

    A decode step reads a zeroed cache of the right size: the bytes and FLOPs are those of real keys
    and values (zeros neither speed up nor slow down a CPU or GPU matmul noticeably), and nothing has to be
    prefilled first, which at batch 64 would cost more than the step itself.
    """
    device = model_device(model)                  # a name or a number in the model's place is refused here, by name
    check_choice("phase", phase, PASS_PHASES)
    n, pos, repeats = check_count("n", n, 1), check_count("pos", pos, 0), check_count("repeats", repeats, 1)
    batch, T = (n, 1) if phase == "decode" else (1, n)
    start = 0 if phase == "prefill" else pos
    if start + T > model.config.context_length:
        raise ValueError(f"{start + T} positions exceed the model's context length {model.config.context_length}")
    dtype = model.tok_emb.weight.dtype
    cache = KVCache(model.config, batch, start + T, device=device, dtype=dtype)
    cache.k.zero_()
    cache.v.zero_()
    ids = torch.zeros(batch, T, dtype=torch.long, device=device)

    def one_pass():
        cache.pos = start
        model(ids, cache, check=False, last_only=phase != "verify")

    with torch.inference_mode():
        return time_fn(without_launches(one_pass, device), device=device, warmup=1, repeats=repeats).median_s


def without_launches(one_pass, device: torch.device):
    """On CUDA, the pass as one CUDA graph: its kernels replay back to back, with no Python or launch gap between
    them, so the time is the bytes' and FLOPs' (the launches are lesson 08's subject). Elsewhere the pass itself.

    The arithmetic: gpt2-small's batch-1 step reads 0.25 GB, 0.06 ms at an H200's 4.2 TB/s, less than launching its
    hundreds of kernels from Python takes (lesson 08 counts them); a 7B model's reads 13.5 GB, 3.2 ms."""
    if graphs_unavailable(device):
        return one_pass
    try:
        return capture_graph(one_pass, device, warm_up=lambda fn: [fn() for _ in range(2)])
    except Exception as err:         # a pass that cannot be captured is still worth timing: eager, and say so
        warnings.warn(f"timing a pass: CUDA graph capture failed ({type(err).__name__}: {err}); timing it eager, "
                      "with its launches", RuntimeWarning, stacklevel=3)
        return one_pass


SKELETON_HEAD_DIM = 8      # a head 8 wide: every op of the real pass runs, on a rounding error of its bytes and FLOPs


def skeleton_config(cfg: GPTConfig) -> GPTConfig:
    """`cfg` at toy width: the same layers, heads, norms, positions and ops, each head 8 wide, the MLP four times the
    width, a vocabulary of 256. Llama-2-7B's skeleton holds 0.5% of its bytes, gpt2-small's about 1%."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {describe(cfg)}; use GPTConfig.preset(name) or model.config")
    width = cfg.n_head * SKELETON_HEAD_DIM
    return dataclasses.replace(cfg, n_embd=width, n_inner=4 * width, vocab_size=256)


def fixed_pass_s(preset: str, phase: str, n: int, dtype: str = "fp32", device="cpu", *, pos: int = 128,
                 context_length: int | None = None, repeats: int = 5) -> float:
    """What one pass (time_pass's phase, n and pos) of `preset` costs besides its bytes and FLOPs: the same pass
    timed on its skeleton. That is Python and launches in eager mode, and on a GPU each kernel's few microseconds
    even inside a CUDA graph. A roof sets a pass's time only where its floor is well above it (floor_sets_time).
    """
    check_choice("phase", phase, ("prefill", "decode"))
    cfg = skeleton_config(model_config(preset, context_length))
    model = build(cfg, check_device("device", device), _parse_dtype(dtype), seed=0)
    return time_pass(model, phase, n, pos=pos, repeats=repeats)


FLOOR_OVER_FIXED = 2.0


def floor_sets_time(floor_s: float, fixed_s: float, host_s: float | None = None) -> bool:
    """True when a pass's floor (its bytes / bandwidth, or FLOPs / peak) is at least FLOOR_OVER_FIXED times its fixed
    costs (fixed_pass_s, or a request on the skeleton). A pass then takes about floor / efficiency + fixed, so the
    roof sets at least two thirds of it, and the claims that rest on a roof can hold: twice the work gives at least
    (4 + 1) / (2 + 1) = 1.67x the time, and a share of the roof stays above 30% down to a kernel efficiency of 40%.
    Below it the fixed costs set the time, and those claims are not expected.

    host_s, for an eager pass: what the host spends queueing it (a request's TTFT on the skeleton). On a CPU the host
    runs the pass itself, so that is fixed_s again. A GPU runs the kernels while the host queues the next ones: the
    pass takes about the larger of the host's time and the device's (floor / efficiency + its kernels' fixed costs,
    fixed_pass_s, a replayed graph), and the roof sets it only where the floor is also at least the host's time."""
    return floor_s >= FLOOR_OVER_FIXED * fixed_s and (host_s is None or floor_s >= host_s)


BASE_PROMPTS = (256, 4096)      # compute_bound_prompt's shortest and longest baseline prompt (lesson 05)


class BaselinePrompt(NamedTuple):
    """compute_bound_prompt's choice and its evidence: the prompt's floor, its pass's fixed costs, its host's time."""
    tokens: int
    floor_s: float
    fixed_s: float
    host_s: float

    @property
    def compute_bound(self) -> bool:
        return floor_sets_time(self.floor_s, self.fixed_s, self.host_s)


def first_compute_bound(costs: Callable[[int], BaselinePrompt], shortest: int = BASE_PROMPTS[0],
                        longest: int = BASE_PROMPTS[1]) -> BaselinePrompt:
    """The first of shortest, 2 x shortest, 4 x shortest, ... (at most `longest`) whose costs(n) is compute-bound;
    where none is, the last one, whose `compute_bound` says so. compute_bound_prompt measures the costs, and
    gpu_predictions computes an H200's: one rule for both."""
    n = check_count("shortest", shortest, 1)
    longest = check_count("longest", longest, n)
    while True:
        choice = costs(n)
        if choice.compute_bound or 2 * n > longest:
            return choice
        n *= 2


def compute_bound_prompt(preset: str, dtype: str, device, peak_flops: float, *, shortest: int = BASE_PROMPTS[0],
                         longest: int = BASE_PROMPTS[1]) -> BaselinePrompt:
    """The shortest prompt, doubling from `shortest`, whose prefill a roof sets (floor_sets_time, first_compute_bound).
    Its floor is its FLOPs at `peak_flops`; its fixed costs are its pass on the preset's skeleton (fixed_pass_s); its
    host's time is its TTFT on the skeleton (the median of three requests: one slow sample would double the prompt).
    A CPU's 256 tokens of gpt2-small qualify; on an H200 an eager prefill of Llama-2-7B queues about 1,000 ops, some
    13 ms of host, so it takes 1,024 (docs/gpu/predictions.md).
    """
    cfg = model_config(preset)

    def measured(n: int) -> BaselinePrompt:
        context = max(cfg.context_length, n + 16)              # a position table long enough (RoPE needs none)
        return BaselinePrompt(n, roofline.prefill_floor_s(cfg, n, peak_flops=peak_flops),
                              fixed_pass_s(preset, "prefill", n, dtype, device, context_length=context),
                              measure_request(preset, n, 16, dtype=dtype, device=device, context_length=context,
                                              repeats=3, skeleton=True)["ttft_s"])
    return first_compute_bound(measured, shortest, longest)


def roofline_point(preset: str, phase: str, n: int, dtype: str = "fp32", device="cpu", *, pos: int = 128,
                   repeats: int = 5) -> dict:
    """Time one pass (see time_pass) and place it on the roofline: FLOPs, bytes, intensity, achieved rates."""
    check_choice("phase", phase, ("prefill", "decode"))
    dtype = _parse_dtype(dtype)
    model = _get_model(preset, model_config(preset), dtype, check_device("device", device), None)
    seconds = time_pass(model, phase, n, pos=pos, repeats=repeats)
    cfg = model.config
    if phase == "prefill":
        flops, nbytes = roofline.prefill_flops(cfg, n), roofline.prefill_bytes(cfg, n, 1, dtype)
    else:
        flops, nbytes = roofline.decode_flops(cfg, pos, n), roofline.decode_bytes(cfg, pos, n, dtype)
    return dict(preset=preset, phase=phase, n=n, pos=pos, dtype=dtype_name(dtype), device=str(device), seconds=seconds,
                flops=flops, bytes=nbytes, intensity=roofline.arithmetic_intensity(flops, nbytes),
                achieved_flops=flops / seconds, achieved_Bps=nbytes / seconds,
                tokens_per_s=n / seconds)          # n prompt tokens, or one new token for each of n sequences


__all__ = ["PASS_PHASES", "roofline_point", "time_pass", "available_devices", "check_preset_request", "clear_models",
           "BASE_PROMPTS", "BaselinePrompt", "compute_bound_prompt", "contender_dtypes", "default_dtype_name",
           "dtype_choices", "first_compute_bound", "fixed_pass_s", "floor_sets_time", "free_bytes", "get_model",
           "measure_request", "measure_requests", "memory_needed", "model_config", "preset_choices", "skeleton_config",
           "timed_generate", "without_launches"]
