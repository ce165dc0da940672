"""Which device we measure on, how fast it really is, and what its datasheet promises."""
from __future__ import annotations

import gc
import os
import platform
import re
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from . import fake_cuda
from .timing import time_fn
from .validate import check_count, check_device, check_positive, device_available

MiB = 1 << 20
GiB = 1 << 30
T = TypeVar("T")


def pick_device(prefer: str | None = None) -> torch.device:
    """cuda, then mps, then cpu; `prefer` forces one and says clearly when it is not available."""
    if prefer is not None:
        return check_device("device", prefer)
    return torch.device(next(kind for kind in ("cuda", "mps", "cpu") if device_available(kind)))


def _resolve(device: torch.device | str | None) -> torch.device:
    device = pick_device() if device is None else check_device("device", device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must share one cache entry in measured_peaks.
        device = torch.device("cuda", 0 if fake_cuda.active() else torch.cuda.current_device())
    return device


# ---------------------------------------------------------------------------------------------
# What the machine is
# ---------------------------------------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=2).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe_device(device: torch.device | str | None = None) -> str:
    """A human name for the device: the GPU's name, or the CPU model and its core count."""
    device = _resolve(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return _cpu_model()  # on Apple silicon the chip name ("Apple M2 Max") names the GPU too
    return f"{_cpu_model()} ({os.cpu_count()} cores)"


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
    device = _resolve(device)
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
    if _resolve(device).type == "cpu" and in_virtual_machine():
        # A hypervisor often passes the host's L3 through unchanged; the guest may own only a slice of it.
        label += "; in a VM this may be the host's whole L3"
    return label


def free_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes we could still allocate on `device`, or None where the platform does not say."""
    device = _resolve(device)
    if device.type == "cuda":
        return None if fake_cuda.active() else torch.cuda.mem_get_info(device)[0]
    if device.type == "mps":
        try:
            return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
        except (AttributeError, RuntimeError):
            return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# Measurements that must never take the kernel down
# ---------------------------------------------------------------------------------------------

class MeasurementError(RuntimeError):
    """A probe did not fit in memory (or could not run); the message says how to shrink it."""


def is_oom(err: BaseException) -> bool:
    """True for any device's out-of-memory error (CUDA, MPS, or a host allocation that failed)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err).lower()
    return "out of memory" in text or "can't allocate memory" in text or "failed to allocate" in text


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


# ---------------------------------------------------------------------------------------------
# Bandwidth: a large copy
# ---------------------------------------------------------------------------------------------

def default_copy_bytes(device: torch.device | str | None = None) -> int:
    """Buffer size for the bandwidth probe: several times the last-level cache, so we time DRAM/HBM.

    GPU: 1 GiB (an H100's L2 is 50 MB). CPU: 4x the last-level cache, between 256 MiB and 2 GiB.
    """
    device = _resolve(device)
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
    device = _resolve(device)
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
    return (2, 9) if nbytes <= 64 * MiB else (1, 3) if nbytes <= 512 * MiB else (1, 2)


def measure_bandwidth_sweep(sizes, device: torch.device | str | None = None, progress_desc: str = "") -> list[float]:
    """measure_bandwidth (bytes/s) at each buffer size, with sweep_repeats; a progress bar when a name is given."""
    from .progress import progress
    device = _resolve(device)
    sizes = [check_count("size", s, 4096) for s in sizes]
    return [measure_bandwidth(device, nbytes=s, warmup=warmup, repeats=repeats)
            for s in (progress(sizes, desc=progress_desc) if progress_desc else sizes)
            for warmup, repeats in [sweep_repeats(s)]]


# ---------------------------------------------------------------------------------------------
# FLOP/s: a large square GEMM
# ---------------------------------------------------------------------------------------------

def default_matmul_n(device: torch.device | str | None = None) -> int:
    """Matrix side for the GEMM probe: big enough to be compute-bound, small enough to be quick."""
    kind = _resolve(device).type
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


def check_dtype(dtype: torch.dtype, device: torch.device | str | None = None) -> None:
    """Raise a clear error when `device` cannot multiply matrices of `dtype`."""
    device = _resolve(device)
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
    device = _resolve(device)
    check_dtype(dtype, device)
    if n is None:
        n = default_matmul_n(device)
        if device.type == "cpu" and dtype != torch.float32:
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


# ---------------------------------------------------------------------------------------------
# One weight matrix, from GEMV to GEMM
# ---------------------------------------------------------------------------------------------

def measure_linear_sweep(n_out: int = 3072, n_in: int = 768, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         repeats: int = 5, warmup: int = 2, seed: int = 0) -> list[dict]:
    """Time y = x @ W.T for one [n_out, n_in] weight at each batch (rows of x): the GEMV -> GEMM walk.

    The default is gpt2-small's MLP weight. Returns one plain row per batch, for a table or a plotly
    line: batch, seconds (median), bytes and flops (roofline.linear_bytes / linear_flops),
    bytes_per_s, flops_per_s and intensity (FLOP/byte). At batch 1 every weight byte serves two
    FLOPs, so bandwidth sets the time; each extra row reuses the same bytes, until FLOP/s does.
    """
    from . import roofline
    device = _resolve(device)
    check_dtype(dtype, device)
    batches = list(batches)
    for name, value in (("n_out", n_out), ("n_in", n_in), ("repeats", repeats), *(("batch", b) for b in batches)):
        check_count(name, value, 1)
    if not batches:
        raise ValueError("batches is empty; pass the batch sizes to time, e.g. (1, 8, 64)")
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g).to(device=device, dtype=dtype)
    rows = []
    for batch in batches:
        x = torch.randn(batch, n_in, generator=g).to(device=device, dtype=dtype)
        out = torch.empty(batch, n_out, device=device, dtype=dtype)
        seconds = time_fn(lambda: torch.matmul(x, w.t(), out=out), device=device, warmup=warmup,
                          repeats=repeats).median_s
        nbytes, flops = roofline.linear_bytes(n_out, n_in, batch, dtype), roofline.linear_flops(n_out, n_in, batch)
        rows.append(dict(batch=batch, seconds=seconds, bytes=nbytes, flops=flops, bytes_per_s=nbytes / seconds,
                         flops_per_s=flops / seconds, intensity=roofline.arithmetic_intensity(flops, nbytes)))
    return rows


# ---------------------------------------------------------------------------------------------
# The dtype models run in, and the ridge point (labutils.peaks keeps the measured ceilings)
# ---------------------------------------------------------------------------------------------

def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The dtype models run in on `device`: bf16 (or fp16 before Ampere) on CUDA, fp32 elsewhere."""
    device = _resolve(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.float32


def ridge_point(flops: float, bandwidth_Bps: float) -> float:
    """Arithmetic intensity (FLOP/byte) at which compute time equals memory time: flops / bandwidth."""
    return check_positive("flops", flops) / check_positive("bandwidth_Bps", bandwidth_Bps)


# ---------------------------------------------------------------------------------------------
# What the datasheets promise
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceSpec:
    """One row of vendor numbers. TFLOP/s are dense (no 2:4 sparsity); None where the vendor gives none."""

    name: str
    tflops_16: float | None     # fp16/bf16 tensor-core matmul, fp32 accumulate, dense
    tflops_32: float | None     # plain fp32 (no TF32)
    bandwidth_GBps: float       # memory bandwidth, 1 GB = 1e9 bytes
    memory_GB: float
    source: str
    match: str                  # regex matched against describe_device()'s name, lowercased

    @property
    def bandwidth_Bps(self) -> float:
        return self.bandwidth_GBps * 1e9

    @property
    def flops_16(self) -> float | None:
        return None if self.tflops_16 is None else self.tflops_16 * 1e12

    @property
    def ridge(self) -> float | None:
        """fp16/bf16 ridge point in FLOP/byte, or None when no 16-bit figure is published."""
        return None if self.flops_16 is None else ridge_point(self.flops_16, self.bandwidth_Bps)


# NVIDIA datasheets quote tensor-core figures "with sparsity"; the dense figure is half of it.
SPECS: dict[str, DeviceSpec] = {s.name: s for s in [
    DeviceSpec("A100 80GB SXM", 312, 19.5, 2039, 80,
               "NVIDIA A100 Tensor Core GPU datasheet (FP16 Tensor Core 312 TFLOPS dense; HBM2e 2,039 GB/s)",
               r"a100.*sxm.*80"),
    DeviceSpec("H100 SXM", 989, 67, 3350, 80,
               "NVIDIA H100 Tensor Core GPU datasheet (BF16 Tensor Core 1,979 TFLOPS with sparsity; 3.35 TB/s)",
               r"h100.*(sxm|hbm3)"),
    DeviceSpec("H100 PCIe", 756, 51, 2000, 80,
               "NVIDIA H100 Tensor Core GPU datasheet (BF16 Tensor Core 1,513 TFLOPS with sparsity; 2 TB/s)",
               r"h100.*pcie"),
    DeviceSpec("H200 SXM", 989, 67, 4800, 141,
               "NVIDIA H200 Tensor Core GPU datasheet (BF16 Tensor Core 1,979 TFLOPS with sparsity; 4.8 TB/s)",
               r"h200(?!.*nvl)"),
    DeviceSpec("L4", 121, 30.3, 300, 24,
               "NVIDIA L4 Tensor Core GPU datasheet (FP16 Tensor Core 242 TFLOPS with sparsity; 300 GB/s)",
               r"\bl4\b"),
    DeviceSpec("RTX 4090", 165.2, 82.6, 1008, 24,
               "NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: FP16 Tensor with FP32 accumulate "
               "165.2 TFLOPS dense; 1,008 GB/s GDDR6X",
               r"rtx 4090(?!.*laptop)"),
    DeviceSpec("Apple M1", None, 2.6, 68.25, 16,
               "Apple newsroom, Nov 2020 (GPU 2.6 TFLOPS); LPDDR4X-4266 x 128 bit = 68.25 GB/s",
               r"apple m1$"),
    DeviceSpec("Apple M2", None, None, 100, 24,
               "Apple newsroom, Jun 2022 (100GB/s unified memory bandwidth)", r"apple m2$"),
    DeviceSpec("Apple M1 Max", None, None, 400, 64,
               "Apple newsroom, Oct 2021 (up to 400GB/s)", r"apple m1 max"),
    DeviceSpec("Apple M2 Max", None, None, 400, 96,
               "Apple newsroom, Jan 2023 (400GB/s)", r"apple m2 max"),
    DeviceSpec("Apple M3 Max", None, None, 400, 128,
               "Apple newsroom, Oct 2023 (up to 400GB/s)", r"apple m3 max"),
]}


def match_spec(device_name: str) -> DeviceSpec | None:
    """The SPECS row whose pattern matches a device name (as from describe_device), or None."""
    name = device_name.lower().strip()
    for spec in SPECS.values():
        if re.search(spec.match, name):
            return spec
    return None
