"""How fast this machine really is: a large copy (bandwidth), a large matmul (FLOP/s), one weight from
GEMV to GEMM; probes that never take the kernel down."""
from __future__ import annotations

import gc
import re
import warnings
from pathlib import Path
from typing import Callable, TypeVar

import torch

from labutils.core import emulated_cuda, fake_cuda
from labutils.perf.timing import time_fn
from labutils.core.validate import check_count, check_seed
from labutils.core.devices import GiB, MiB, resolve_device, describe_device, free_memory_bytes, is_oom


T = TypeVar("T")


def last_level_cache() -> tuple[int, int] | None:
    """(level, bytes) of the CPU's largest cache as Linux sysfs reports it for cpu0, or None."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        m = re.fullmatch(r"(\d+)([KMG]?)", size)
        if m:
            nbytes = int(m.group(1)) * {"": 1, "K": 1 << 10, "M": MiB, "G": GiB}[m.group(2)]
            if best is None or level > best[0]:
                best = (level, nbytes)
    return best


def last_level_cache_bytes() -> int | None:
    """Size of the CPU's largest cache (Linux sysfs), or None where we cannot tell."""
    found = last_level_cache()
    return found[1] if found else None


def in_virtual_machine() -> bool:
    """True when the CPU says it runs under a hypervisor (the x86 "hypervisor" flag in /proc/cpuinfo)."""
    try:
        return any(line.startswith("flags") and " hypervisor" in line
                   for line in Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return False


def device_cache(device: torch.device | str | None = None) -> tuple[str, int] | None:
    """("L2", bytes) of a GPU's last-level cache, ("L3", bytes) or so of the CPU's; None where unknown (mps)."""
    device = resolve_device(device)
    if device.type == "cuda":
        nbytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        return ("L2", nbytes) if nbytes else None
    if device.type == "cpu":
        found = last_level_cache()
        return (f"L{found[0]}", found[1]) if found else None
    return None


def cache_label(device: torch.device | str | None = None) -> str:
    """How a plot should name the cache line: its level and size, and a warning where the size is doubtful."""
    found = device_cache(device)
    if found is None:
        return "last-level cache: size unknown"
    level, nbytes = found
    label = f"last-level cache ({level}, {_fmt_bytes(nbytes)} as reported)"
    if resolve_device(device).type == "cpu" and in_virtual_machine():
        # A hypervisor often passes the host's L3 through unchanged; the guest may own only a slice of it.
        label += "; in a VM this may be the host's whole L3"
    return label


def weight_rows_beyond_cache(n_in: int, dtype: torch.dtype, device: torch.device | str | None = None) -> int:
    """Rows of an [n_out, n_in] weight as large as the copy probe's buffer (default_copy_bytes), or a quarter of the
    free memory where that is less: a weight that no cache holds, so a GEMV on it streams from memory."""
    device = resolve_device(device)
    nbytes, free = default_copy_bytes(device), free_memory_bytes(device)
    if free is not None:
        nbytes = min(nbytes, free // 4)
    return nbytes // (check_count("n_in", n_in, 1) * dtype.itemsize)


class MeasurementError(RuntimeError):
    """A probe did not fit in memory (or could not run); the message says how to shrink it."""


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        torch.mps.empty_cache()


def _guarded(fn: Callable[[], T], what: str, hint: str) -> T:
    """Run fn(); turn an out-of-memory failure into MeasurementError after freeing its tensors."""
    reason = None
    try:
        return fn()
    except (MemoryError, RuntimeError, TypeError) as err:
        # A size past int64 is refused by torch with an "overflow" TypeError/RuntimeError: it does not fit either.
        if not (is_oom(err) or "overflow" in str(err).lower()):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    # Raised outside the except block on purpose: the old traceback (whose frames hold the
    # half-built tensors) is gone, so _free_memory() can actually give the memory back.
    _free_memory()
    raise MeasurementError(f"{what} does not fit in memory ({reason}). {hint}")


def _fmt_bytes(nbytes: float) -> str:
    return f"{nbytes / GiB:,.1f} GiB" if nbytes >= GiB else f"{nbytes / MiB:,.0f} MiB"


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # One allocation point, so a test can make it fail.
    return torch.empty(numel, dtype=dtype, device=device)


def default_copy_bytes(device: torch.device | str | None = None) -> int:
    """Buffer size for the bandwidth probe: several times the last-level cache, so we time DRAM/HBM.

    GPU: 1 GiB (an H100's L2 is 50 MB). CPU: 4x the last-level cache, between 256 MiB and 2 GiB.
    """
    device = resolve_device(device)
    if device.type != "cpu":
        return GiB
    llc = last_level_cache_bytes()
    return 256 * MiB if llc is None else min(max(4 * llc, 256 * MiB), 2 * GiB)


def measure_bandwidth(device: torch.device | str | None = None, nbytes: int | None = None,
                      repeats: int = 5, warmup: int = 2) -> float:
    """Memory bandwidth in bytes/s from a large device copy, `dst.copy_(src)`.

    A copy of N bytes reads N and writes N, so we count 2 * N bytes per copy and report
    2 * N / median time. With `nbytes=None` the buffer is `default_copy_bytes(device)`, shrunk
    (with a warning that says so) when free memory is short. A buffer that does not fit raises
    MeasurementError naming the size; pass a smaller `nbytes`.
    """
    device = resolve_device(device)
    if nbytes is None:
        nbytes = default_copy_bytes(device)
        free = free_memory_bytes(device)
        if free is not None and 2 * nbytes > free // 2:
            shrunk = max((free // 4) // MiB * MiB, MiB)
            warnings.warn(f"measure_bandwidth: only {free / GiB:.1f} GiB free on {device}, so the copy buffer "
                          f"shrank from {nbytes // MiB} MiB to {shrunk // MiB} MiB; a buffer close to the "
                          f"cache size overstates DRAM bandwidth. Free memory, or pass nbytes= yourself.",
                          stacklevel=2)
            nbytes = shrunk
    nbytes = check_count("nbytes", nbytes, 4096, hint="a copy of under 4 KiB measures the call, not the memory")
    numel = nbytes // 4

    def run() -> float:
        src = _empty(numel, torch.float32, device)
        dst = _empty(numel, torch.float32, device)
        # Touch every page of src first: reading never-written memory maps the shared zero
        # page on Linux, which would be served from cache and flatter the result.
        src.fill_(1.0)
        timing = time_fn(lambda: dst.copy_(src), device=device, warmup=warmup, repeats=repeats)
        return 2 * numel * 4 / timing.median_s

    return _guarded(run, f"a {_fmt_bytes(2 * numel * 4)} copy (two {_fmt_bytes(numel * 4)} buffers) "
                         f"on {device}", "Pass a smaller nbytes= to measure_bandwidth, or free memory first.")


def bandwidth_sweep_sizes(device: torch.device | str | None = None, *, reach: int = 4,
                          cache_bytes: int | None = -1, free_bytes: int | None = -1,
                          smallest: int = 64 << 10) -> list[int]:
    """Buffer sizes for the copy sweep: powers of two from `smallest`, then a top past `reach` x the cache.

    The top is max(reach x cache, default_copy_bytes(device)), so main memory shows beyond the cache;
    it is halved while the two buffers would take over half the free memory (the rule measure_bandwidth
    applies), so a small machine may stop short of it. cache_bytes / free_bytes default (-1) to this machine's.
    """
    reach = check_count("reach", reach, 1, 64, hint="4 x the cache is enough to see main memory")
    smallest = check_count("smallest", smallest, 4096, hint="a copy of under 4 KiB measures the call")
    if cache_bytes == -1:
        found = device_cache(device)
        cache_bytes = found[1] if found else None
    elif cache_bytes is not None:
        cache_bytes = check_count("cache_bytes", cache_bytes, 0, hint="pass None when the cache size is unknown")
    if free_bytes == -1:
        free_bytes = free_memory_bytes(device)
    elif free_bytes is not None:
        free_bytes = check_count("free_bytes", free_bytes, 0, hint="pass None when free memory is unknown")
    # The top is the target itself (rounded up to whole MiB), not the next power of two: past 1 GiB every
    # doubling costs seconds on a small machine.
    top = -(-max(reach * (cache_bytes or 0), default_copy_bytes(device), smallest) // MiB) * MiB
    while free_bytes is not None and top > smallest and 2 * top > free_bytes // 2:
        top = max(top // 2 // MiB * MiB, smallest)
    # Powers of two up to 3/4 of the top: a point just below it (1,024 MiB next to 1,040) adds time, not shape.
    sizes = [1 << k for k in range((smallest - 1).bit_length(), top.bit_length()) if 4 * (1 << k) <= 3 * top]
    return sizes + [top]


def sweep_repeats(nbytes: int) -> tuple[int, int]:
    """(warmup, repeats) for one sweep point: a large copy is slow and steady, so it needs fewer of both.

    A small copy takes microseconds, so one descheduled thread on a busy machine can make a single call
    1,000x slower; nine repeats let the median ignore up to four such calls at almost no cost.
    """
    nbytes = check_count("nbytes", nbytes, 1, hint="the size of one copy in bytes")
    return (2, 9) if nbytes <= 64 * MiB else (1, 3) if nbytes <= 512 * MiB else (1, 2)


def measure_bandwidth_sweep(sizes, device: torch.device | str | None = None, progress_desc: str = "") -> list[float]:
    """measure_bandwidth (bytes/s) at each buffer size, with sweep_repeats; a progress bar when a name is given."""
    from labutils.core.progress_bar import progress
    device = resolve_device(device)
    sizes = [check_count("size", s, 4096) for s in sizes]
    return [measure_bandwidth(device, nbytes=s, warmup=warmup, repeats=repeats)
            for s in (progress(sizes, desc=progress_desc) if progress_desc else sizes)
            for warmup, repeats in [sweep_repeats(s)]]


def default_matmul_n(device: torch.device | str | None = None) -> int:
    """Matrix side for the GEMM probe: big enough to be compute-bound, small enough to be quick."""
    kind = resolve_device(device).type
    return {"cuda": 8192, "mps": 4096}.get(kind, 2048)


def _affordable_n(dtype: torch.dtype, device: torch.device, n_max: int, budget_s: float = 1.0) -> int:
    """n (a multiple of 256, at most n_max) whose GEMM a 512 x 512 probe says takes at most ~budget_s.

    A CPU without 16-bit units emulates fp16/bf16 and can be 50x slower than fp32; this keeps
    measured_peaks quick there instead of stalling a lesson for a minute.
    """
    probe = 512
    a = torch.randn(probe, probe, device=device).to(dtype)
    rate = 2 * probe ** 3 / max(time_fn(lambda: a @ a, device=device, warmup=1, repeats=2).min_s, 1e-9)
    if 2 * n_max ** 3 / rate <= budget_s:
        return n_max
    return max(probe, int((budget_s * rate / 2) ** (1 / 3)) // 256 * 256)


def cpu_multiplies_bf16() -> bool:
    """True where this CPU has bf16 matrix instructions (AVX512-BF16 or AMX tiles), as torch's own CPU kernels ask:
    only there do bf16 matmuls and the fused int8 kernel (which computes in bf16) run at full speed."""
    return any(getattr(torch.cpu, name, lambda: False)()
               for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))


def check_can_multiply(dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """Raise a clear error when `device` cannot multiply matrices of `dtype`."""
    device = resolve_device(device)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype.itemsize < 2:
        raise TypeError(f"measure_matmul_flops needs a float dtype (float32, float16, bfloat16), got {dtype!r}")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise ValueError(f"{describe_device(device)} has no bfloat16 tensor cores (needs compute capability "
                         f">= 8.0); use dtype=torch.float16")
    if device.type == "mps" and dtype == torch.float64:
        raise ValueError("Apple GPUs (mps) have no float64; use dtype=torch.float32")
    try:  # the last word: can this build of torch do it at all?
        a = torch.ones(8, 8, dtype=dtype, device=device)
        a @ a
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"{device} cannot multiply {dtype} matrices here ({str(err).splitlines()[0]}); "
                         f"use dtype=torch.float32") from None


def measure_matmul_flops(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         n: int | None = None, repeats: int = 3, warmup: int = 1) -> float:
    """Matrix-multiply throughput in FLOP/s: an n x n by n x n product costs 2 * n**3 FLOPs.

    n defaults to `default_matmul_n(device)` (2048 on CPU, 8192 on GPU); for 16-bit dtypes on a
    CPU it is lowered until one product takes about a second, since CPUs without 16-bit units
    emulate them slowly; and it is halved (with a warning) while three n x n matrices would
    not fit in free memory. Use
    float16/bfloat16 on a GPU to reach its tensor cores. On NVIDIA, float32 uses TF32 tensor
    cores only if `torch.backends.cuda.matmul.allow_tf32` is set; we report whatever torch does.
    """
    device = resolve_device(device)
    check_can_multiply(dtype, device)
    if n is None:
        n = default_matmul_n(device)
        if (device.type == "cpu" or emulated_cuda.active()) and dtype != torch.float32:   # a CPU multiplies it
            n = _affordable_n(dtype, device, n)
        free = free_memory_bytes(device)
        while free is not None and n > 256 and 3 * n * n * dtype.itemsize > free // 2:
            n //= 2
            warnings.warn(f"measure_matmul_flops: not enough free memory on {device}; shrinking n to {n}",
                          stacklevel=2)
    n = check_count("n", n, 1)

    def run() -> float:
        a = _empty(n * n, dtype, device).view(n, n).normal_()
        b = _empty(n * n, dtype, device).view(n, n).normal_()
        out = _empty(n * n, dtype, device).view(n, n)
        timing = time_fn(lambda: torch.matmul(a, b, out=out), device=device, warmup=warmup, repeats=repeats)
        return 2 * n ** 3 / timing.median_s

    size = _fmt_bytes(3 * n * n * dtype.itemsize)
    return _guarded(run, f"a {n} x {n} {str(dtype).removeprefix('torch.')} matmul ({size} for three "
                         f"matrices) on {device}", "Pass a smaller n= to measure_matmul_flops.")


def measure_linear_sweep(n_out: int | None = None, n_in: int = 4096, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256),
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         repeats: int = 3, warmup: int = 1, seed: int = 0) -> list[dict]:
    """Time y = x @ W.T for one [n_out, n_in] weight at each batch (rows of x): the GEMV -> GEMM walk.

    Returns one plain row per batch, for a table or a plotly line: n_out, n_in, batch, seconds (median), bytes and
    flops (roofline.linear_bytes / linear_flops), bytes_per_s, flops_per_s and intensity (FLOP/byte). At batch 1
    every weight byte serves two FLOPs, so bandwidth sets the time; each extra row reuses the same bytes, until
    FLOP/s does.

    By default the weight is n_in = 4,096 wide (a 7-8B model's width) with as many rows as make it as large as the
    copy probe's buffer (default_copy_bytes): larger than any cache, so the GEMV reads from the memory the copy
    bandwidth was measured on. A weight of a few megabytes stays in a CPU's cache and outruns that bandwidth.
    """
    from labutils.perf import roofline
    device = resolve_device(device)
    check_can_multiply(dtype, device)
    seed = check_seed(seed)
    batches = list(batches)
    if n_out is None:
        n_out = max(weight_rows_beyond_cache(n_in, dtype, device), 1)
    for name, value in (("n_out", n_out), ("n_in", n_in), ("repeats", repeats), *(("batch", b) for b in batches)):
        check_count(name, value, 1)
    if not batches:
        raise ValueError("batches is empty; pass the batch sizes to time, e.g. (1, 8, 64)")
    g = torch.Generator().manual_seed(seed)
    # Drawn on the device in its dtype: a host fp32 draw of a 2 GiB weight takes seconds and doubles its memory.
    w = torch.empty(n_out, n_in, device=device, dtype=dtype).normal_(generator=fake_cuda.generator(device, seed))
    rows = []
    for batch in batches:
        x = torch.randn(batch, n_in, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(batch, n_out, device=device, dtype=dtype)
        seconds = time_fn(lambda: torch.matmul(x, w.t(), out=out), device=device, warmup=warmup,
                          repeats=repeats).median_s
        nbytes, flops = roofline.linear_bytes(n_out, n_in, batch, dtype), roofline.linear_flops(n_out, n_in, batch)
        rows.append(dict(n_out=n_out, n_in=n_in, batch=batch, seconds=seconds, bytes=nbytes, flops=flops,
                         bytes_per_s=nbytes / seconds, flops_per_s=flops / seconds,
                         intensity=roofline.arithmetic_intensity(flops, nbytes)))
    return rows


__all__ = ['MeasurementError', 'bandwidth_sweep_sizes', 'cache_label', 'check_can_multiply', 'cpu_multiplies_bf16', 'default_copy_bytes', 'default_matmul_n', 'device_cache', 'in_virtual_machine', 'last_level_cache', 'last_level_cache_bytes', 'measure_bandwidth', 'measure_bandwidth_sweep', 'measure_linear_sweep', 'measure_matmul_flops', 'sweep_repeats', 'weight_rows_beyond_cache']
