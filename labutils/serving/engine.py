"""The course's serving engine: requests in, continuous batching over a paged KV cache, per-token timestamps out."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from labutils.core import fake_cuda
from labutils.perf import quiet
from labutils.core.progress_bar import Steps
from labutils.decode.loop import check_logits, check_sampling, sample
from labutils.perf.roofline import kv_bytes_per_token
from labutils.core.validate import (check_choice, check_count, check_flag, check_number, check_seed, model_device,
                                    model_dtype)
from labutils.serving.blocks import BlockManager
from labutils.serving.paged_cache import PagedKVCache, Row
from labutils.serving.scheduler import MODES, Scheduler
from labutils.serving.sequence import Sequence
from labutils.serving.workload import MAX_ARRIVAL_S, RequestResult, Summary, Workload, summarize

# vLLM's default token budget for an online server (its API server's max_num_batched_tokens with chunked prefill).
DEFAULT_BATCHED_TOKENS = 2048


class Engine:
    """Serve many requests with one model: Engine(model, max_batch_size).submit(...) ... .run().

    Each step() is one forward over a plan the scheduler makes under a token budget,
    `max_num_batched_tokens`, as vLLM V1 plans a step: one token for every running request that is
    decoding, then prefill tokens of newcomers (reusing cached prefix blocks) in what is left. With
    `chunked_prefill` (the default, as in vLLM V1) a prompt longer than what is left is split across
    steps, so a long prompt never stalls the running streams for longer than one budget's worth of
    tokens; without it a prompt runs whole. The scheduled tokens go through the model packed end to
    end (serving.paged_cache.PackedBatch), not padded, each at its own position. Greedy requests get the
    tokens of their solo generate() run; a sampled one (temperature > 0) draws from its own seeded
    generator through generate()'s sampler, so its seed reproduces it. Times are seconds on the real
    clock since the workload started: the first step() after the engine was idle (run() starts with one).

    kv_budget_bytes bounds the paged KV cache: blocks held by running requests plus blocks kept
    for prefix reuse. None gives room for max_batch_size requests at the full context, so nothing
    is ever preempted. When running requests need more, the newest is preempted and recomputed
    later. A budget below one full-context request still serves every request: the pool always
    holds one such request, beyond the budget. A budget of 0 caches nothing.

    For a simulation of two machines in one process (serving.disagg): `clock` replaces the real clock
    (a function returning seconds since the workload started), `export_kv=True` makes each result carry
    its prompt's keys and values, and submit_prefilled() queues a request whose prompt another engine
    has prefilled.
    """

    def __init__(self, model, max_batch_size: int, *, block_size: int = 16, prefix_caching: bool = True,
                 kv_budget_bytes: int | None = None, mode: str = "continuous",
                 max_num_batched_tokens: int | None = None, chunked_prefill: bool = True, clock=None,
                 export_kv: bool = False):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a labutils GPT, got {type(model).__name__}")
        ctx = model.config.context_length
        max_batch_size = check_count("max_batch_size", max_batch_size, 1)
        block_size = check_count("block_size", block_size, 1, ctx, hint=f"a block holds at most the context ({ctx})")
        prefix_caching = check_flag("prefix_caching", prefix_caching)
        if kv_budget_bytes is not None:
            kv_budget_bytes = check_count("kv_budget_bytes", kv_budget_bytes, 0)
        mode = check_choice("mode", mode, MODES)
        chunked_prefill = check_flag("chunked_prefill", chunked_prefill)
        self.max_num_batched_tokens = self._check_budget(max_num_batched_tokens, max_batch_size, chunked_prefill, ctx)
        self.chunked_prefill = chunked_prefill
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a function returning seconds, got {type(clock).__name__}")
        self._clock, self.export_kv = clock, check_flag("export_kv", export_kv)
        self.model, self.config = model, model.config
        self.device, self.dtype = model_device(model), model_dtype(model)
        self.max_batch_size, self.block_size, self.mode = max_batch_size, block_size, mode
        per_request = -(-self.config.context_length // block_size)     # blocks of one full-context request
        block_bytes = kv_bytes_per_token(self.config, self.dtype) * block_size
        budget = max_batch_size * per_request if kv_budget_bytes is None else kv_budget_bytes // block_bytes
        n_blocks = max(budget, per_request)
        self.blocks = BlockManager(n_blocks, block_size, prefix_caching=prefix_caching, budget_blocks=budget)
        self.cache = PagedKVCache(self.config, block_size, n_blocks, self.device, self.dtype)
        self.scheduler = Scheduler(self.blocks, max_batch_size, self.max_num_batched_tokens,
                                   chunked_prefill=chunked_prefill, mode=mode)
        self.finished: list[RequestResult] = []     # results of the current (or last) workload
        self.timeline: list[dict] = []              # one row per step: time, batch, queue, blocks
        self.wall_s = 0.0                           # the last workload's duration: start to the end of its last step
        self._pending: list[Sequence] = []          # submitted, not arrived yet
        self._rejected: dict[int, str] = {}
        self._next_id = 0
        self._t0: float | None = None
        self.steps = 0
        self.peak_blocks = 0
        self.token_rows = 0                         # token rows the model computed, over every forward

    @staticmethod
    def _check_budget(budget, max_batch_size: int, chunked_prefill: bool, ctx: int) -> int:
        """The token budget per step: vLLM's defaults, and its two rules (one token per running request fits;
        without chunking, so does a whole prompt)."""
        if budget is None:
            return max(DEFAULT_BATCHED_TOKENS, max_batch_size, 0 if chunked_prefill else ctx)
        budget = check_count("max_num_batched_tokens", budget, 1)
        if budget < max_batch_size:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_batch_size={max_batch_size}: every "
                             "step must fit one token for each running request; raise the budget or lower "
                             "max_batch_size")
        if not chunked_prefill and budget < ctx:
            raise ValueError(f"max_num_batched_tokens={budget} is below the context length {ctx}: without chunked "
                             "prefill a whole prompt must fit one step; raise the budget or set chunked_prefill=True")
        return budget

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
        check_sampling(temperature, top_k, top_p)
        seed = None if seed is None else check_seed(seed)
        if self._t0 is not None:             # the clock runs: a request cannot arrive in the past
            arrival_s = max(float(arrival_s), self.clock())
        generator = fake_cuda.generator(self.device, seed) if temperature > 0 else None
        return self._queue(Sequence(self._next_id, prompt, max_new_tokens, arrival_s, eos_id, float(temperature),
                                    top_k, top_p, generator))

    def submit_prefilled(self, prompt_ids, first_token: int, first_token_s: float, kv, max_new_tokens: int, *,
                         arrival_s: float, ready_s: float, eos_id: int | None = None) -> int:
        """Queue a request another engine prefilled (export_kv=True): its prompt's keys and values `kv`, and
        the first token it made at first_token_s. It joins at ready_s (when the handover lands) and decodes
        greedily from there; its times still count from arrival_s. Returns its id here."""
        prompt = self._check_prompt(prompt_ids)
        first_token = check_count("first_token", first_token, 0, self.config.vocab_size - 1)
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1)
        if not (isinstance(kv, tuple) and len(kv) == 2 and all(isinstance(t, torch.Tensor) for t in kv)
                and kv[0].shape[1] == len(prompt)):
            raise ValueError("kv must be the (keys, values) pair a prefill worker's result carries, one position "
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
        if isinstance(prompt_ids, torch.Tensor):
            if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point or prompt_ids.dtype == torch.bool:
                raise TypeError(f"prompt_ids must be one prompt: a 1-D integer tensor or a list of ints, got a "
                                f"{prompt_ids.dtype} tensor of shape {tuple(prompt_ids.shape)}")
            prompt_ids = prompt_ids.tolist()
        if isinstance(prompt_ids, (str, bytes, dict, set, frozenset)) or not hasattr(prompt_ids, "__iter__"):
            raise TypeError(f"prompt_ids must be a list of token ids, got {type(prompt_ids).__name__}; "
                            "encode text with the tokenizer first")
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty; encode at least one token")
        V = self.config.vocab_size
        return [check_count(f"prompt_ids[{i}]", tok, 0, V - 1,
                            hint=f"a token id of this model's vocab (0..{V - 1}); encode with the tokenizer "
                                 "that matches this model")
                for i, tok in enumerate(prompt)]

    # -- the clock and the loop --------------------------------------------------------------------

    def clock(self) -> float:
        """Seconds since the current workload started (0 before it has)."""
        if self._clock is not None:
            return self._clock()
        return 0.0 if self._t0 is None else time.perf_counter() - self._t0

    @property
    def busy(self) -> bool:
        return bool(self._pending or self.scheduler.waiting or self.scheduler.running)

    @property
    def next_arrival_s(self) -> float | None:
        return min((s.ready_s for s in self._pending), default=None)

    @torch.inference_mode()
    def step(self) -> list[RequestResult]:
        """One scheduler iteration: arrivals join the queue, new requests prefill, the running batch decodes one token.

        Returns the requests that finished in this step.
        """
        if not self.busy:
            return []
        if self._t0 is None:                 # a new workload: a new clock and a fresh record
            self._t0 = time.perf_counter()
            self.finished, self.timeline = [], []
        start = self.clock()
        done = self._arrive(start)
        plan = self.scheduler.schedule(self.clock())
        if plan:
            done += self._forward(plan)
        self.steps += 1
        self.peak_blocks = max(self.peak_blocks, self.blocks.used)
        now = self.clock()
        running = self.scheduler.running
        self.timeline.append(dict(t=now, step_s=now - start, running=len(running), waiting=len(self.scheduler.waiting),
                                  blocks_used=self.blocks.used, blocks_cached=self.blocks.cached,
                                  kv_tokens=sum(s.n_computed for s in running),    # positions really stored
                                  decode_tokens=sum(1 for _, n in plan if n == 1),
                                  prefill_tokens=sum(n for _, n in plan if n > 1)))
        self.finished += done
        if not self.busy:
            self.wall_s, self._t0 = now, None
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

    def _device_forward(self, plan: list[tuple[Sequence, int]]) -> tuple[list[Sequence], torch.Tensor]:
        """The device half of a step: one packed forward over the plan (each request fed its planned tokens), and
        the next token of every request whose tokens are now all computed, left on the device."""
        # One-token rows first (PackedBatch's layout), shortest tables first, so rows of similar length attend together.
        plan = sorted(plan, key=lambda p: (p[1] > 1, len(p[0].table) if p[1] == 1 else 0))
        self.cache.ensure(self.blocks.high_water)
        for seq, _ in plan:
            if seq.kv is not None:                               # handed over: store it, then decode from it
                self.cache.write(seq.table, seq.kv)
                seq.kv = None
        flat, ends, sampled = [], [], []
        for seq, n in plan:
            flat += seq.tokens[seq.n_computed:seq.n_computed + n]
            if n == seq.remaining:                               # its last token: the next token comes from it
                ends.append(len(flat) - 1)
                sampled.append(seq)
        view = self.cache.batch([Row(seq.table, seq.n_computed, n) for seq, n in plan])
        ids = torch.tensor(flat, device=self.device)[None]
        logits = self.model(ids, view, check=False, logits_at=torch.tensor(ends, dtype=torch.long, device=self.device))
        self.token_rows += ids.shape[1]
        return sampled, self._sample(sampled, logits[0])

    def _forward(self, plan: list[tuple[Sequence, int]]) -> list[RequestResult]:
        """One step's forward and its bookkeeping: positions advance, full blocks are keyed, tokens appended,
        finished requests leave."""
        sampled, tokens = self._device_forward(plan)
        tokens = tokens.tolist()                                 # waits for the device
        now = self.clock()
        for seq, n in plan:
            seq.n_computed += n
            self.blocks.commit(seq.table, seq.keys, seq.tokens, seq.n_computed)
        done = []
        for seq, tok in zip(sampled, tokens):
            seq.add_token(tok, now)
            if seq.done:
                kv = self.cache.read(seq.table, seq.n_computed) if self.export_kv else None
                self.scheduler.finish(seq, now)
                done.append(seq.result())
                done[-1].kv = kv
        return done

    @staticmethod
    def _sample(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The next token of each request from its row of logits, on the device: greedy in one argmax, sampled
        ones each from its own generator through decode.loop.sample."""
        first = [i for i, s in enumerate(seqs) if not s.n_generated]
        if first:                     # once per request: NaN weights would otherwise give token 0 forever
            check_logits(logits[first])
        tokens = logits.argmax(dim=-1)
        for i, s in enumerate(seqs):
            if s.temperature > 0:
                tokens[i] = sample(logits[i:i + 1], s.temperature, s.top_k, s.top_p, s.generator, check=False)[0]
        return tokens

    # -- what it did -------------------------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """Prefix-cache hits, preemptions and KV-cache memory since the engine was made."""
        s = self.scheduler
        return dict(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                    hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
                    preemptions=s.preemptions, steps=self.steps, token_rows=self.token_rows,
                    blocks_used=self.blocks.used,
                    blocks_cached=self.blocks.cached, peak_blocks=self.peak_blocks, n_blocks=self.blocks.n_blocks,
                    block_bytes=self.cache.block_bytes, kv_bytes_allocated=self.cache.nbytes)


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
    ids = [engine.submit(r.prompt_ids, r.max_new_tokens, r.arrival_s, r.eos_id, **r.sampling) for r in workload]
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
    stats: dict
    timeline: list[dict]


def serve(model, workload: Workload, max_batch_size: int, *, slo=None, progress_desc: str = "", on_finished=None,
          **engine_options) -> Served:
    """Serve `workload` on a new Engine(model, max_batch_size, **engine_options): the lessons' and the dashboard's
    one call. `progress_desc` shows a bar of finished requests in a notebook; `on_finished` see run_workload."""
    engine = Engine(model, max_batch_size, **engine_options)
    results, wall_s = run_workload(engine, workload, progress_desc, on_finished)
    return Served(results, wall_s, summarize(results, wall_s, slo), engine.stats, engine.timeline)


__all__ = ["Engine", "Served", "run_workload", "serve"]
