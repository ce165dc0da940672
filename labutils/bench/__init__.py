"""python -m labutils.bench: the performance table, each row a ratio of two things measured side by side.

Both sides of a ratio are timed in the same run, interleaved, so load from other programs hits both.
A row that misses its target prints FAIL; a row that cannot run on this machine prints SKIP and why.
The exit code is non-zero only when a row errors.
The rows live in decode_rows, serving_rows and speculative_rows; this module holds the table (ROWS) and its
one runner. A new row is `def my_row(s: BenchSettings) -> BenchRow` in one of those files, appended to ROWS.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
import traceback
from typing import Callable

import torch

from labutils.bench.common import BenchRow, BenchSettings
from labutils.bench.decode_rows import (decode_bandwidth, fast_vs_hf_gpt2_small, fast_vs_hf_tiny, int8_vs_16_32,
                                        prefill_throughput, recompute_vs_cached, tpot_long_vs_short)
from labutils.bench.serving_rows import (chunked_vs_whole_prefill_itl, continuous_vs_one_at_a_time, engine_vs_vllm,
                                         packed_token_rows, vllm_budget_itl)
from labutils.bench.speculative_rows import SPEC_PROMPTS  # noqa: F401  (lesson 10 shows the bench's prompts)
from labutils.bench.speculative_rows import speculative_draft_vs_greedy, speculative_lookup_vs_greedy
from labutils.perf import quiet


# The table, in order. Later lessons append their rows here. The four rows with a GPU target of their own (issue 27)
# come first: a GPU check's time limit (--max-seconds) skips the rows at the end, and the decode row compiles a step.
ROWS: list[Callable[[BenchSettings], BenchRow]] = [decode_bandwidth, prefill_throughput, int8_vs_16_32,
                                                   chunked_vs_whole_prefill_itl, recompute_vs_cached,
                                                   tpot_long_vs_short, fast_vs_hf_tiny, fast_vs_hf_gpt2_small,
                                                   speculative_draft_vs_greedy, speculative_lookup_vs_greedy,
                                                   continuous_vs_one_at_a_time, packed_token_rows, engine_vs_vllm,
                                                   vllm_budget_itl]


def run(settings: BenchSettings, rows: list[Callable[[BenchSettings], BenchRow]] | None = None,
        log: Callable[[str], None] = print, max_seconds: float | None = None,
        on_row: Callable[[list[BenchRow]], None] | None = None) -> list[BenchRow]:
    """Measure every row, logging a progress line per row; an error becomes an ERROR row, not a crash.

    max_seconds: once the rows so far took that long, the rest are SKIP rows that say so (a GPU check's time limit).
    on_row: called with the rows so far after each one (the command writes its JSON there, so a run stopped from
    outside keeps the rows it finished).
    """
    rows = ROWS if rows is None else rows
    out, start = [], time.perf_counter()
    for i, fn in enumerate(rows, 1):
        log(f"[{i}/{len(rows)}] {fn.__name__} ...")
        t0 = time.perf_counter()
        if max_seconds is not None and t0 - start > max_seconds:
            out.append(BenchRow(fn.__name__, float("nan"), "", "", f"not run: the bench's {max_seconds:.0f} s "
                                "limit was spent on the rows before it", status="SKIP"))
            log(f"      SKIP: {out[-1].detail}")
            continue
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
        row.seconds = round(time.perf_counter() - t0, 1)
        out.append(row)
        if on_row is not None:
            on_row(out)
    return out


def format_table(rows: list[BenchRow]) -> str:
    header = ("row", "ratio", "target", "status", "time", "machine", "measured", "setup")
    lines = [(r.name, f"{r.ratio:.2f}", r.target, r.status, f"{r.seconds:.0f} s", r.machine, r.detail, r.setup)
             for r in rows]
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
    p.add_argument("--max-seconds", type=float, default=None,
                   help="skip the rows that would start after this many seconds (a GPU check's time limit)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            p.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    from labutils.core.devices import pick_device
    from labutils.core.emulated_cuda import enter_if_asked
    enter_if_asked()          # LABUTILS_EMULATE_CUDA=1: --device cuda on emulated CUDA (gpu_check --dry-run)
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
    t0 = time.perf_counter()
    def save(done: list[BenchRow]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(to_json(done, settings), f, indent=2)
    results = run(settings, rows, max_seconds=args.max_seconds, on_row=save)
    print(f"\n{len(results)} rows in {time.perf_counter() - t0:.0f} s")
    print(format_table(results))
    busy = [r.name for r in results if r.machine == "busy"]
    if busy:
        print(f"\n{quiet.MARKER} {len(busy)} of {len(results)} rows ran while other processes held the CPU "
              f"({', '.join(busy)}); timings are unreliable: close other programs and run the bench again")
    if args.json:
        print(f"\nwrote {args.json}")
    return 1 if any(r.status == "ERROR" for r in results) else 0
