"""Which device: pick one, name it, its free memory, its out-of-memory errors, the dtype models run in."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from labutils.core import emulated_cuda, fake_cuda
from labutils.core.validate import check_device, device_available


MiB = 1 << 20
GiB = 1 << 30


def pick_device(prefer: str | None = None) -> torch.device:
    """cuda, then mps, then cpu; `prefer` forces one and says clearly when it is not available."""
    if prefer is not None:
        return check_device("device", prefer)
    return torch.device(next(kind for kind in ("cuda", "mps", "cpu") if device_available(kind)))


def resolve_device(device: torch.device | str | None) -> torch.device:
    device = pick_device() if device is None else check_device("device", device)
    if device.type == "cuda" and device.index is None:
        # "cuda" and "cuda:0" must share one cache entry in measured_peaks.
        device = torch.device("cuda", 0 if fake_cuda.active() else torch.cuda.current_device())
    return device


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
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return _cpu_model()  # on Apple silicon the chip name ("Apple M2 Max") names the GPU too
    return f"{_cpu_model()} ({os.cpu_count()} cores)"


def free_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """Bytes we could still allocate on `device`, or None where the platform does not say."""
    device = resolve_device(device)
    if device.type == "cuda":
        return None if fake_cuda.shapes_only() else torch.cuda.mem_get_info(device)[0]
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


def is_oom(err: BaseException) -> bool:
    """True for any device's out-of-memory error (CUDA, MPS, or a host allocation that failed)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err).lower()
    return "out of memory" in text or "can't allocate memory" in text or "failed to allocate" in text


def default_dtype(device: torch.device | str | None = None) -> torch.dtype:
    """The dtype models run in on `device`: bf16 (or fp16 before Ampere) on CUDA, fp32 elsewhere."""
    device = resolve_device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    return torch.float32


__all__ = ['GiB', 'MiB', 'default_dtype', 'describe_device', 'free_memory_bytes', 'is_oom', 'pick_device',
           'resolve_device']


def graphs_unavailable(device: torch.device) -> str | None:
    """Why `device` replays no CUDA graphs (a reason to print), or None where it does: the one rule for the fast decode
    loop, the serving engine's steps and time_pass. The faked and the emulated CUDA of the tests have no graphs."""
    if device.type != "cuda":
        return f"CUDA graphs need an NVIDIA GPU and the model is on {device.type}"
    if emulated_cuda.active():              # (emulation fakes CUDA too: name the emulation)
        return "CUDA is emulated on the CPU here (labutils.core.emulated_cuda), which has no graphs"
    if fake_cuda.active():
        return "CUDA is faked here (labutils.core.fake_cuda), which has no graphs"
    return None

