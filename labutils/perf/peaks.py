"""One set of measured peaks per machine: copy bandwidth and matmul FLOP/s, saved once and read by every lesson.

MBU and MFU divide by these ceilings, so they must be the same in every lesson, widget and benchmark row. Lesson 00
measures them (best of several runs) and saves them in a per-user cache file, keyed by the device's name, the torch
version and the dtype; everyone else reads that file and says so. A measurement taken while other processes held
the machine (`labutils.perf.quiet`) is never saved, and the file is measured again when it is missing, older than
MAX_AGE_DAYS, or asked for (`refresh=True`).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from labutils.perf import quiet
from labutils.core.devices import resolve_device, default_dtype, describe_device
from labutils.perf.probes import measure_bandwidth, measure_matmul_flops
from labutils.perf.roofline import ridge_point
from labutils.core.progress_bar import Steps
from labutils.perf.timing import torch_threads
from labutils.core.validate import describe

RUNS = 3                      # each probe is already a median; the best of three ignores a run a neighbour spoiled
MAX_AGE_DAYS = 30
FILE_NAME = "peaks.json"
# The thread count torch starts with. A lesson that drops to one thread for steady timings (lesson 10) must not
# measure, and save, a one-thread "peak" for the whole machine.
THREADS = torch.get_num_threads()


def cache_dir() -> Path:
    """Where per-user course state lives: $LABUTILS_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, /prefill-decode-lab."""
    if os.environ.get("LABUTILS_CACHE_DIR"):
        return Path(os.environ["LABUTILS_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefill-decode-lab"


def cache_file() -> Path:
    return cache_dir() / FILE_NAME


def _short(path: Path) -> str:
    home = str(Path.home())
    return "~" + str(path)[len(home):] if str(path).startswith(home + os.sep) else str(path)


def _rate(value: float, unit: str) -> str:
    """A rate with a prefix that keeps it short: GB/s and GFLOP/s below a thousand giga, T above."""
    return f"{value / 1e12:,.1f} T{unit}" if value >= 1e12 else f"{value / 1e9:,.1f} G{unit}"


@dataclass(frozen=True)
class Peaks:
    """This machine's measured ceilings: copy bandwidth and GEMM FLOP/s for one dtype, and where they came from."""

    bandwidth_Bps: float
    flops: float
    device_name: str
    dtype: str = "float32"
    source: str = field(default="", compare=False)

    @property
    def ridge(self) -> float:
        """FLOP per byte where the roofline bends: below it a kernel waits on memory."""
        return ridge_point(self.flops, self.bandwidth_Bps)

    def line(self) -> str:
        """The one printed form of the peaks; tests compare it across every lesson's stored output."""
        return (f"peaks of {self.device_name}, {self.dtype}: copy {_rate(self.bandwidth_Bps, 'B/s')}, "
                f"matmul {_rate(self.flops, 'FLOP/s')}, ridge {self.ridge:,.1f} FLOP/byte")

    def __str__(self) -> str:
        return self.line() + (f"\n  ({self.source})" if self.source else "")


def check_peaks(peaks, name: str = "peaks") -> Peaks:
    """Peaks passed in by hand: a Peaks, in bytes/s and FLOP/s (20 GB/s is 20e9, not 20.0)."""
    if not isinstance(peaks, Peaks):
        raise TypeError(f"{name} must be a labutils.perf.peaks.Peaks (measured_peaks(device)), got {describe(peaks)}")
    for field_, value, unit in (("bandwidth_Bps", peaks.bandwidth_Bps, "bytes/s"), ("flops", peaks.flops, "FLOP/s")):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1e8):
            raise ValueError(f"{name}.{field_}={value!r} is not a plausible peak in {unit}: peaks are in {unit}, so "
                             f"20 GB/s is 20e9, not 20.0; pass measured_peaks(device)")
    return peaks


def _key(device_name: str, what: str) -> str:
    return f"{device_name} | torch {torch.__version__} | {what}"


def _load() -> dict:
    try:
        data = json.loads(cache_file().read_text())
        return data["entries"] if isinstance(data.get("entries"), dict) else {}
    except (OSError, ValueError, AttributeError, KeyError):
        return {}           # missing or unreadable: measure again (a hand-broken file is simply replaced)


def _fresh(entry) -> bool:
    try:
        return (isinstance(entry["value"], (int, float)) and entry["value"] > 0
                and time.time() - entry["measured_at"] < MAX_AGE_DAYS * 86400)
    except (KeyError, TypeError):
        return False


def _save(new: dict) -> None:
    entries = _load()
    entries.update(new)
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": 1, "entries": entries}, indent=1, sort_keys=True))
    tmp.replace(path)       # atomic: a second kernel never reads half a file


def _measure_best(probe, what: str, bar: Steps) -> tuple[float, quiet.Window]:
    with quiet.watch() as window, torch_threads(THREADS):
        runs = []
        for i in range(RUNS):
            bar.show(f"{what}, run {i + 1} of {RUNS}")
            runs.append(probe())
            bar.step(f"{what}, run {i + 1} of {RUNS}")
    return max(runs), window


_SESSION: dict[tuple[str, str], float] = {}       # what this process measured but could not save (busy machine)


def measured_peaks(device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                   refresh: bool = False, progress_desc: str = "") -> Peaks:
    """This machine's peaks for `device` and `dtype` (default: `default_dtype(device)`), from the cache file.

    A missing, stale (older than MAX_AGE_DAYS) or refreshed entry is measured: `measure_bandwidth` and
    `measure_matmul_flops`, best of RUNS runs each at torch's starting thread count, and saved unless other
    processes were busy meanwhile. The bandwidth is one entry per device, shared by every dtype. With a
    `progress_desc`, a bar in the notebook counts the probe runs.
    """
    device = resolve_device(device)
    dtype = default_dtype(device) if dtype is None else dtype
    dtype_label = str(dtype).removeprefix("torch.")
    name = describe_device(device)
    entries = {} if refresh else _load()
    values, measured, busy = {}, [], False
    stale = [w for w in ("copy", dtype_label) if refresh or not (_fresh(entries.get(_key(name, w)))
                                                                 or (name, w) in _SESSION)]
    bar = Steps(RUNS * len(stale) if progress_desc else 0, progress_desc)
    for what, probe in (("copy", lambda: measure_bandwidth(device)),
                        (dtype_label, lambda: measure_matmul_flops(dtype, device))):
        key = _key(name, what)
        if not refresh and (name, what) in _SESSION:    # this session's own (busy, unsaved) figure wins: one set
            values[what] = {"value": _SESSION[name, what], "measured_at": None}
        elif _fresh(entries.get(key)):
            values[what] = entries[key]
        else:
            value, window = _measure_best(probe, "copy bandwidth" if what == "copy" else f"{what} matmul", bar)
            values[what] = {"value": value, "measured_at": time.time(), "runs": RUNS, "threads": THREADS}
            measured.append(what)
            busy |= window.busy
    bar.done()
    if measured and not busy:
        _save({_key(name, what): values[what] for what in measured})
    for what in measured:       # keep a busy measurement for this session only, so lessons still agree with each other
        if busy:
            _SESSION[name, what] = values[what]["value"]
        else:
            _SESSION.pop((name, what), None)
    where = _short(cache_file())
    if busy:
        source = f"measured now on a busy machine, best of {RUNS}; not saved, so the next call measures again"
    elif measured:
        source = f"measured now, best of {RUNS} runs; saved to {where} for every lesson"
    elif any(v["measured_at"] is None for v in values.values()):
        source = "measured earlier in this session on a busy machine; not saved"
    else:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(min(v["measured_at"] for v in values.values())))
        source = f"measured {when}, read from {where}; lesson 00 measures them again"
    return Peaks(bandwidth_Bps=values["copy"]["value"], flops=values[dtype_label]["value"], device_name=name,
                 dtype=dtype_label, source=source)
