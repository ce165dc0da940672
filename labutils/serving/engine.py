"""The course's serving engine: requests in, continuous batching over a paged KV cache, per-token timestamps out."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from labutils.core import fake_cuda
from labutils.perf import quiet
from labutils.core.progress_bar import Steps
from labutils.perf.roofline import kv_bytes_per_token
from labutils.core.validate import check_count, check_flag, check_model, check_number, check_prompt_ids, model_dtype
from labutils.serving.blocks import BlockManager
from labutils.serving.runner import ModelRunner
from labutils.serving.scheduler import Scheduler
from labutils.serving.sequence import Sequence
from labutils.serving.workload import (MAX_ARRIVAL_S, PromptKV, RequestResult, SamplingParams, Summary, Workload,
                                      summarize)


class Engine:
    """Serve many requests with one model: Engine(model, max_batch_size).submit(...) ... .run().

    Each step() reads as three verbs, as nano-vllm's does: the scheduler plans the step (serving.scheduler: which
    requests, how many tokens each, under the token budget `max_num_batched_tokens`, as vLLM V1 plans a step), the
    runner feeds the plan through the model in one packed forward (serving.runner), and the scheduler posts the
    step's results (positions, prefix-cache keys, tokens, finished requests). The engine itself checks requests,
    keeps the clock and records each step. With `chunked_prefill` (the default, as in vLLM V1) a prompt longer than
    what is left of the budget is split across steps, so a long prompt never stalls the running streams for longer
    than one budget's worth of tokens; without it a prompt runs whole. Times are seconds on the real clock since
    the workload started: the first step() after the engine was idle (run() starts with one).

    kv_limit_bytes bounds the paged KV cache: blocks held by running requests plus blocks kept for prefix reuse.
    None gives room for max_batch_size requests at the full context, so nothing is ever preempted. When running
    requests need more, the newest is preempted and recomputed later. A limit below one full-context request
    still serves every request: the pool always holds one such request, beyond the limit. A limit of 0 caches
    nothing.

    cuda_graphs: on a GPU a step of decode rows and at most one short prefill chunk replays as a CUDA graph
    (serving.step_graphs, as vLLM and nano-vllm replay decode steps), so its time is the kernels', not Python's. None
    (the default) uses them where the device has them; False runs every step eager.

    For a simulation of two machines in one process (serving.disagg): `clock` replaces the real clock
    (a function returning seconds since the workload started), `export_kv=True` makes each result carry
    its prompt's keys and values, and submit_prefilled() queues a request whose prompt another engine
    has prefilled.
    """

    def __init__(self, model, max_batch_size: int, *, block_size: int = 16, prefix_caching: bool = True,
                 kv_limit_bytes: int | None = None, batching: str = "continuous",
                 max_num_batched_tokens: int | None = None, chunked_prefill: bool = True, clock=None,
                 export_kv: bool = False, cuda_graphs: bool | None = None):
        self.config = check_model("model", model).config
        ctx = self.config.context_length
        max_batch_size = check_count("max_batch_size", max_batch_size, 1)
        block_size = check_count("block_size", block_size, 1, ctx, hint=f"a block holds at most the context ({ctx})")
        prefix_caching = check_flag("prefix_caching", prefix_caching)
        if kv_limit_bytes is not None:
            kv_limit_bytes = check_count("kv_limit_bytes", kv_limit_bytes, 0)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a function returning seconds, got {type(clock).__name__}")
        self._clock, self.export_kv = clock, check_flag("export_kv", export_kv)
        self.max_batch_size, self.block_size = max_batch_size, block_size
        per_request = -(-ctx // block_size)                       # blocks of one full-context request
        block_bytes = kv_bytes_per_token(self.config, model_dtype(model)) * block_size
        limit = max_batch_size * per_request if kv_limit_bytes is None else kv_limit_bytes // block_bytes
        n_blocks = max(limit, per_request)
        self.blocks = BlockManager(n_blocks, block_size, prefix_caching=prefix_caching, limit_blocks=limit)
        self.scheduler = Scheduler(self.blocks, max_batch_size, max_num_batched_tokens, context_length=ctx,
                                   chunked_prefill=chunked_prefill, batching=batching)
        self.runner = ModelRunner(model, block_size, n_blocks, cuda_graphs=cuda_graphs)
        self.finished: list[RequestResult] = []     # results of the current (or last) workload
        self.timeline: list[dict] = []              # one row per step: time, batch, queue, blocks
        self.wall_s = 0.0                           # the last workload's duration: start to the end of its last step
        self._pending: list[Sequence] = []          # submitted, not arrived yet
        self._rejected: dict[int, str] = {}
        self._next_id = 0
        self._t0: float | None = None
        self._setup_at_t0 = 0.0                     # runner.setup_s when the workload started (see clock)
        self.steps = 0
        self.peak_blocks = 0

    # -- requests in -------------------------------------------------------------------------------

    def submit(self, prompt_ids, max_new_tokens: int, arrival_s: float = 0.0, eos_id: int | None = None, *,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None) -> int:
        """Queue one request; returns its id. arrival_s: seconds after the workload starts (the first step).
        temperature, top_k, top_p and seed mean what they mean in generate(); a prompt longer than the token
        budget is chunked, never refused.

        A request longer than the context is not refused here: it comes back from run() with
        finish_reason "rejected" and the reason in `error`, and the others go on.
        """
        prompt = self._check_prompt(prompt_ids)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        # An hour at most: arrivals are waited for on the real clock.
        arrival_s = check_number("arrival_s", arrival_s, minimum=0, maximum=MAX_ARRIVAL_S,
                                 hint="seconds after the workload starts, on the real clock")
        eos_id = self._check_eos(eos_id)
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        if self._t0 is not None:             # the clock runs: a request cannot arrive in the past
            arrival_s = max(float(arrival_s), self.clock())
        generator = fake_cuda.generator(self.runner.device, sampling.seed) if sampling.temperature > 0 else None
        return self._queue(Sequence(self._next_id, prompt, max_new_tokens, arrival_s, eos_id, sampling, generator))

    def submit_prefilled(self, prompt_ids, first_token: int, first_token_s: float, kv, max_new_tokens: int, *,
                         arrival_s: float, ready_s: float, eos_id: int | None = None) -> int:
        """Queue a request another engine prefilled (export_kv=True): its prompt's keys and values `kv`, and
        the first token it made at first_token_s. It joins at ready_s (when the handover lands) and decodes
        greedily from there; its times still count from arrival_s. Returns its id here."""
        prompt = self._check_prompt(prompt_ids)
        first_token = check_count("first_token", first_token, 0, self.config.vocab_size - 1)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        if not (isinstance(kv, PromptKV) and all(isinstance(t, torch.Tensor) for t in kv)
                and kv.keys.shape[1] == len(prompt)):
            raise ValueError("kv must be the PromptKV a prefill worker's result carries (its .kv), one position "
                             "per prompt token")
        seq = Sequence(self._next_id, prompt, max_new_tokens, float(arrival_s), self._check_eos(eos_id),
                       ready_s=float(ready_s), kv=kv)
        seq.add_token(first_token, float(first_token_s))
        return self._queue(seq)

    def _queue(self, seq: Sequence) -> int:
        """Number a checked request and hold it until it may join; one longer than the context is marked for
        rejection at its arrival, so the others go on."""
        self._next_id += 1
        total, ctx = len(seq.prompt) + seq.max_new_tokens, self.config.context_length
        if total > ctx:
            self._rejected[seq.id] = (f"prompt ({len(seq.prompt)}) + max_new_tokens ({seq.max_new_tokens}) = {total} "
                                      f"tokens exceed the context length {ctx}; shorten one of them")
        self._pending.append(seq)
        return seq.id

    def _check_eos(self, eos_id) -> int | None:
        V = self.config.vocab_size
        if eos_id is None:
            return None
        return check_count("eos_id", eos_id, 0, V - 1, hint=f"a token id of this model's vocab (0..{V - 1}), or None")

    def _check_prompt(self, prompt_ids) -> list[int]:
        return list(check_prompt_ids("prompt_ids", prompt_ids, self.config.vocab_size))

    # -- the clock and the loop --------------------------------------------------------------------

    def clock(self) -> float:
        """Seconds since the current workload started (0 before it has)."""
        if self._clock is not None:
            return self._clock()
        if self._t0 is None:
            return 0.0
        return time.perf_counter() - self._t0 - (self.runner.setup_s - self._setup_at_t0)   # recording is setup

    @property
    def busy(self) -> bool:
        return bool(self._pending or self.scheduler.waiting or self.scheduler.running)

    @property
    def next_arrival_s(self) -> float | None:
        return min((s.ready_s for s in self._pending), default=None)

    @torch.inference_mode()
    def step(self) -> list[RequestResult]:
        """One iteration: arrivals join the queue, then schedule, run, postprocess. Returns the requests that finished."""
        if not self.busy:
            return []
        if self._t0 is None:                 # a new workload: a new clock and a fresh record
            self._t0, self._setup_at_t0 = time.perf_counter(), self.runner.setup_s
            self.finished, self.timeline = [], []
        start = self.clock()
        done = self._arrive(start)
        plan = self.scheduler.schedule(self.clock())
        if plan:
            tokens = self.runner.run(plan, self.blocks.high_water)
            done += self.scheduler.postprocess(plan, tokens, self.clock(),
                                               export=self.runner.read if self.export_kv else None)
        self._record(start, plan)
        self.finished += done
        if not self.busy:
            self.wall_s, self._t0 = self.timeline[-1]["t"], None
        elif not (plan or done) and not self.scheduler.running and self.scheduler.waiting:
            raise RuntimeError("the scheduler could not admit any waiting request into an empty batch; "
                               "this is a bug in labutils.serving")
        return done

    def run(self, on_step=None) -> list[RequestResult]:
        """Step until every submitted request has finished; their results, by id. Idle gaps sleep until the next
        arrival. on_step(finished) is called after each step with the requests that step finished."""
        while self.busy:
            if not (self.scheduler.waiting or self.scheduler.running) and self._t0 is not None:
                time.sleep(max(0.0, self.next_arrival_s - self.clock()))
            done = self.step()
            if on_step is not None:
                on_step(done)
        return sorted(self.finished, key=lambda r: r.id)

    # -- internals ---------------------------------------------------------------------------------

    def _arrive(self, now: float) -> list[RequestResult]:
        arrived = sorted((s for s in self._pending if s.ready_s <= now), key=lambda s: (s.ready_s, s.id))
        self._pending = [s for s in self._pending if s.ready_s > now]
        rejected = []
        for seq in arrived:
            if seq.id in self._rejected:
                rejected.append(seq.result("rejected", self._rejected.pop(seq.id)))
            else:
                self.scheduler.add(seq)
        return rejected

    def _record(self, start: float, plan) -> None:
        """One timeline row for the step that started at `start`: its time, batch, queue, blocks and tokens."""
        self.steps += 1
        self.peak_blocks = max(self.peak_blocks, self.blocks.used)
        now, running = self.clock(), self.scheduler.running
        self.timeline.append(dict(t=now, step_s=now - start, running=len(running), waiting=len(self.scheduler.waiting),
                                  blocks_used=self.blocks.used, blocks_cached=self.blocks.cached,
                                  kv_tokens=sum(s.n_computed for s in running),    # positions really stored
                                  decode_tokens=sum(1 for f in plan if f.n == 1),
                                  prefill_tokens=sum(f.n for f in plan if f.n > 1)))

    # -- what it did -------------------------------------------------------------------------------

    @property
    def counts(self) -> "EngineCounts":
        """Prefix-cache hits, preemptions, steps and KV-cache memory since the engine was made."""
        s, cache = self.scheduler, self.runner.cache
        return EngineCounts(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens, preemptions=s.preemptions,
                            steps=self.steps, token_rows=self.runner.token_rows, blocks_used=self.blocks.used,
                            blocks_cached=self.blocks.cached, peak_blocks=self.peak_blocks,
                            n_blocks=self.blocks.n_blocks, block_bytes=cache.block_bytes,
                            kv_bytes_allocated=cache.nbytes)


@dataclass(frozen=True)
class EngineCounts:
    """What an engine did since it was made, counted (not timed; a workload's times are in its Summary)."""

    prompt_tokens: int          # prompt tokens looked up in the prefix cache at admission
    cached_tokens: int          # ... and found there
    preemptions: int
    steps: int
    token_rows: int             # token rows the model computed, over every forward
    blocks_used: int            # KV blocks held by running requests now
    blocks_cached: int          # free blocks that still hold a known prefix
    peak_blocks: int            # the most blocks in use after any step
    n_blocks: int               # the pool's size in blocks
    block_bytes: int            # K and V of one block, every layer
    kv_bytes_allocated: int     # the pool's storage allocated now (it grows with the load)

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens found in the prefix cache."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_workload(engine: Engine, workload: Workload, progress_desc: str = "",
                 on_finished=None) -> tuple[list[RequestResult], float]:
    """Submit every request of `workload`, run them, return (results in workload order, wall seconds).

    Each result's id is its request's id, or its index in the workload, as a server client numbers them. With a
    `progress_desc`, a bar in the notebook counts the finished requests; `on_finished(finished, total)` is called
    after each step that finished some (a widget's own progress bar).
    """
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a serving.workload.Workload, got {type(workload).__name__}")
    if engine.busy:
        raise RuntimeError("the engine is still serving an earlier workload; call run() first")
    ids = [engine.submit(r.prompt_ids, r.max_new_tokens, r.arrival_s, r.eos_id, **dataclasses.asdict(r.sampling))
           for r in workload]
    bar = Steps(len(ids) if progress_desc else 0, progress_desc)

    def step(done):
        for _ in done:
            bar.step("requests finished")          # bar.count counts them, with or without a bar shown
        if done and on_finished is not None:
            on_finished(bar.count, len(ids))

    with quiet.watch():                         # one line if other processes were busy meanwhile
        by_id = {r.id: r for r in engine.run(on_step=step)}
    bar.done()
    results = [by_id[i] for i in ids]
    for index, (r, req) in enumerate(zip(results, workload)):
        r.id = index if req.id is None else req.id
    return results, engine.wall_s


@dataclass
class Served:
    """One workload served by a fresh Engine: every result, its summary and what the engine did."""

    results: list[RequestResult]
    wall_s: float
    summary: Summary
    counts: EngineCounts
    timeline: list[dict]


def serve(model, workload: Workload, max_batch_size: int, *, slo=None, progress_desc: str = "", on_finished=None,
          **engine_options) -> Served:
    """Serve `workload` on a new Engine(model, max_batch_size, **engine_options): the lessons' and the dashboard's
    one call. `progress_desc` shows a bar of finished requests in a notebook; `on_finished` see run_workload."""
    engine = Engine(model, max_batch_size, **engine_options)
    results, wall_s = run_workload(engine, workload, progress_desc, on_finished)
    return Served(results, wall_s, summarize(results, wall_s, slo), engine.counts, engine.timeline)


__all__ = ["Engine", "EngineCounts", "Served", "run_workload", "serve"]
