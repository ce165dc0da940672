"""Device-aware timing and the request metrics TTFT, TPOT and ITL, as vLLM's serving benchmark defines them."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from labutils.core import fake_cuda
from labutils.perf import quiet
from labutils.core.validate import check_count, check_device, check_timestamps, describe


MAX_REPEATS = 100_000


@contextlib.contextmanager
def torch_threads(n: int | None):
    """Run with n intra-op CPU threads (None: leave the count as it is), then restore the previous count.

    Models this small gain nothing from more cores, and one thread times steadily on a shared machine.
    """
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(check_count("threads", n, 1, 1024))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait until queued device work is done, so a host clock reading means something."""
    kind = check_device("device", device).type if device is not None else None
    if fake_cuda.active():                  # shapes only: there is no device to wait for
        return
    if kind == "cuda" or (kind is None and torch.cuda.is_available()):
        torch.cuda.synchronize()
    elif kind == "mps":
        torch.mps.synchronize()


@dataclass(frozen=True)
class Timing:
    """Seconds for each repeat of a timed call; the median is the number we report."""

    samples_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def min_s(self) -> float:
        return min(self.samples_s)


def time_fn(fn: Callable[[], object], *, device: torch.device | str = "cpu",
            warmup: int = 2, repeats: int = 5) -> Timing:
    """Time `fn()` after `warmup` untimed calls.

    On CUDA we bracket each call with CUDA events, which time the GPU's own work
    rather than the host's launch of it. Elsewhere we synchronize and read the host clock.
    When other processes were busy meanwhile, it prints labutils.perf.quiet's one-line warning.
    """
    # The bounds keep a typo (10**9 repeats) from stalling a notebook; a median needs a few dozen.
    repeats = check_count("repeats", repeats, 1, MAX_REPEATS, hint="a median needs a few dozen repeats")
    warmup = check_count("warmup", warmup, 0, MAX_REPEATS, hint="a few warm-up calls are enough")
    if not callable(fn):
        raise TypeError(f"fn must be a function of no arguments, got {describe(fn)}; wrap a call as lambda: f(x)")
    device = check_device("device", device)
    with quiet.watch():              # one line if other processes were busy meanwhile (outermost watch only)
        return _time(fn, device, warmup, repeats)


def _time(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> Timing:
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            samples.append(time.perf_counter() - t0)
    return Timing(tuple(samples))


def ttft_s(timestamps: Sequence[float]) -> float:
    """Time to first token: request start (time 0, queueing included) to the first token on the host."""
    return check_timestamps("timestamps", timestamps)[0]


def tpot_s(timestamps: Sequence[float]) -> float:
    """Time per output token: (end-to-end latency - TTFT) / (output tokens - 1).

    A single-token answer has no decode phase, so its TPOT is undefined; we return nan.
    """
    stamps = check_timestamps("timestamps", timestamps)
    if len(stamps) < 2:
        return float("nan")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def itl_s(timestamps: Sequence[float]) -> list[float]:
    """Inter-token latencies: each gap between consecutive tokens."""
    stamps = check_timestamps("timestamps", timestamps)
    return [b - a for a, b in zip(stamps, stamps[1:])]
