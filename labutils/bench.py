"""python -m labutils.bench: the performance table, each row a ratio of two things measured side by side.

Both sides of a ratio are timed in the same run, interleaved, so load from other programs hits both.
A row that misses its target prints FAIL; the exit code is non-zero only when a row errors.
Later lessons add rows: write `def my_row(s: BenchSettings) -> BenchRow` and append it to ROWS.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from . import timing
from .generate import decode_step, generate, prefill
from .kvcache import KVCache
from .model import GPT, GPTConfig


@dataclass
class BenchSettings:
    """What every row is measured on. quick=True shrinks every row to a smoke test (seconds, not minutes)."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    rounds: int = 3          # interleaved rounds per side; each row reports medians over them

    @property
    def preset(self) -> str:
        return "bench-quick" if self.quick else "gpt2-small"


@dataclass
class BenchRow:
    """One line of the table: a measured ratio, its target, and the two numbers behind it."""

    name: str
    ratio: float
    target: str                 # ">= 3" or "<= 1.3"
    setup: str                  # shape, dtype, device, lengths: enough to reproduce the row
    detail: str                 # the two measured sides
    status: str = ""            # PASS / FAIL / ERROR

    def __post_init__(self):
        if not self.status:
            op, value = self.target.split()
            ok = self.ratio >= float(value) if op == ">=" else self.ratio <= float(value)
            self.status = "PASS" if ok else "FAIL"


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
                decode_step(model, tok, cache)
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


# Docstring openers: the trained models' own kind of text. Greedy continuations of them repeat
# themselves, as a tiny model's do, which is what prompt lookup feeds on.
SPEC_PROMPTS = ("Return the number of", "If the file does not exist,", "This module provides", "Raise ValueError if")


@functools.lru_cache(maxsize=2)
def trained_pair(device: str):
    """The course's trained target and draft: fp32 on CPU, bf16 on a GPU (where decode is bandwidth-bound)."""
    from .model import load_pretrained
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    target, enc = load_pretrained("tiny")
    draft, _ = load_pretrained("draft")
    return target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype), enc


def _speculative_row(s: BenchSettings, use_lookup: bool) -> BenchRow:
    """Greedy end to end over a few prompts: generate() vs speculative_generate() at the best k, same tokens."""
    from .speculative import PROMPT_LOOKUP, speculative_generate
    target, draft_model, enc = trained_pair(str(s.device))
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

    # Pick k on one timed run each, then time the winner against plain decoding afresh, interleaved,
    # so the reported ratio is not the luckiest of several noisy ones.
    sweep = {}
    for k in ks:
        spec(k)                                                # warm-up, untimed
        sweep[k] = timing.time_fn(lambda: spec(k), device=s.device, warmup=0, repeats=1).median_s
    best = min(sweep, key=sweep.get)
    t = _interleaved({"greedy": lambda: [generate(target, ids, new) for ids in prompts],
                      "speculative": lambda: spec(best)}, s)
    stats = spec(best)
    accepted, rejected = sum(r.accepted for r in stats), sum(r.rejected for r in stats)
    alpha = accepted / max(1, accepted + rejected)
    per_step = sum(r.tokens.shape[1] for r in stats) / sum(r.steps for r in stats)
    what = "prompt lookup" if use_lookup else f"{draft_model.config.n_layer}-layer draft"
    return BenchRow(f"speculative ({what}) / greedy, end to end", t["greedy"] / t["speculative"], ">= 1.3",
                    f"trained tiny target + {what}, {next(target.parameters()).dtype}, {s.device.type}, "
                    f"{len(prompts)} prompts x {new} new tokens, greedy, identical tokens asserted",
                    f"greedy {t['greedy']:.2f} s, speculative {t['speculative']:.2f} s at best k={best} "
                    f"(alpha {alpha:.2f}, {per_step:.2f} tokens/pass; sweep "
                    + ", ".join(f"k={k}: {v:.2f} s" for k, v in sweep.items()) + f"; median of {s.rounds})")


def speculative_draft_vs_greedy(s: BenchSettings) -> BenchRow:
    return _speculative_row(s, use_lookup=False)


def speculative_lookup_vs_greedy(s: BenchSettings) -> BenchRow:
    return _speculative_row(s, use_lookup=True)


# The table, in order. Later lessons append their rows here.
ROWS: list[Callable[[BenchSettings], BenchRow]] = [recompute_vs_cached, tpot_long_vs_short,
                                                   speculative_draft_vs_greedy, speculative_lookup_vs_greedy]


def run(settings: BenchSettings, rows: list[Callable[[BenchSettings], BenchRow]] | None = None,
        log: Callable[[str], None] = print) -> list[BenchRow]:
    """Measure every row, logging a progress line per row; an error becomes an ERROR row, not a crash."""
    rows = ROWS if rows is None else rows
    out = []
    for i, fn in enumerate(rows, 1):
        log(f"[{i}/{len(rows)}] {fn.__name__} ...")
        t0 = time.perf_counter()
        try:
            row = fn(settings)
        except Exception as err:   # keep measuring the other rows; report this one
            traceback.print_exc()
            row = BenchRow(fn.__name__, float("nan"), "", "", f"{type(err).__name__}: {err}", status="ERROR")
        log(f"      {row.status} {row.ratio:.2f} (target {row.target}) in {time.perf_counter() - t0:.0f} s")
        out.append(row)
    return out


def format_table(rows: list[BenchRow]) -> str:
    header = ("row", "ratio", "target", "status", "measured", "setup")
    lines = [(r.name, f"{r.ratio:.2f}", r.target, r.status, r.detail, r.setup) for r in rows]
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
    from .hardware import pick_device
    settings = BenchSettings(device=pick_device(args.device), quick=args.quick, rounds=args.rounds)
    rows = [fn for fn in ROWS if args.only is None or args.only in fn.__name__]
    if not rows:
        p.error(f"no row matches --only {args.only!r}; rows: {[fn.__name__ for fn in ROWS]}")
    print(f"device {settings.device}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
          f"{', quick shapes' if settings.quick else ''}")
    results = run(settings, rows)
    print()
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(results, settings), f, indent=2)
        print(f"\nwrote {args.json}")
    return 1 if any(r.status == "ERROR" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
