"""Disaggregated prefill and decode, simulated in one process: two engines, two virtual clocks, KV handed over.

A prefill worker and a decode worker are two machines running at the same time. This process has one CPU, so
each engine keeps a virtual clock (`StepClock`) that moves only while one of its own steps runs, measured on the
real clock, or jumps ahead to its next arrival when it is idle. Stepping always the engine whose clock is behind
keeps cause before effect: a decode worker never starts a request before the prefill worker has finished it and
the handover has landed. Each handover costs the prompt's KV bytes over a link (roofline.kv_cache_bytes / the
link's bytes per second) and then goes to the decode worker, which decodes from the handed-over keys and values.

`serve_mixed` runs the same workload through ordinary engines on the same kind of clock, one per machine, each
taking every other request, so both setups use the same number of machines, measured the same way.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from labutils.perf.roofline import kv_cache_bytes
from labutils.core.validate import check_count, check_positive, model_dtype
from labutils.serving.engine import Engine
from labutils.serving.workload import SLO, RequestResult, Summary, Workload, summarize


class StepClock:
    """Virtual seconds since the workload started, for one simulated machine."""

    def __init__(self):
        self.base, self._started = 0.0, None
        self.busy_s = 0.0                          # seconds spent in steps: the machine's working time
        self._engine, self._setup_at_start = None, 0.0

    def __call__(self) -> float:
        return self.base + self._running()

    def _running(self) -> float:
        """Seconds the current step has run, less the CUDA graphs it recorded (setup, as Engine.clock leaves out)."""
        if self._started is None:
            return 0.0
        return time.perf_counter() - self._started - (self._engine.runner.setup_s - self._setup_at_start)

    def step(self, engine: Engine) -> list[RequestResult]:
        """One engine step, with this clock running for as long as it takes."""
        self._engine, self._setup_at_start = engine, engine.runner.setup_s
        self._started = time.perf_counter()
        try:
            return engine.step()
        finally:
            took = self._running()
            self.base, self.busy_s, self._started = self.base + took, self.busy_s + took, None

    def wait_until(self, t: float) -> None:
        """Idle until t: an idle machine's clock jumps to its next arrival."""
        self.base = max(self.base, t)


def _next_event(engine: Engine, clock: StepClock) -> float:
    """When this engine can next do work: now if it has requests in hand, else its next arrival (inf if none)."""
    if engine.scheduler.waiting or engine.scheduler.running:
        return clock()
    nxt = engine.next_arrival_s
    return float("inf") if nxt is None else max(clock(), nxt)


def _drive(engine: Engine, clock: StepClock, workload) -> list[RequestResult]:
    """One simulated machine serving `workload` (Requests) alone: its results, in the workload's order."""
    ids = [engine.submit(r.prompt_ids, r.max_new_tokens, r.arrival_s, r.eos_id) for r in workload]
    done = {}
    while engine.busy:
        clock.wait_until(_next_event(engine, clock))
        done.update((r.id, r) for r in clock.step(engine))
    return [done[i] for i in ids]


@dataclass
class SimulatedRun:
    """A simulated serving run: every request's result (in workload order), on virtual clocks, and its summary."""

    setup: str
    results: list[RequestResult]
    wall_s: float
    summary: Summary
    handoff_s: list[float] = dataclasses.field(default_factory=list)   # per handed-over request
    busy: list[float] = dataclasses.field(default_factory=list)        # per machine: share of wall_s in steps


def _served(setup: str, results: list[RequestResult], workload: Workload, slo, clocks, handoffs=()) -> SimulatedRun:
    for index, (r, req) in enumerate(zip(results, workload)):
        r.id, r.kv = index if req.id is None else req.id, None      # numbered as run_workload numbers them
    # Start to the end of the last step on any machine, as Engine.wall_s: a machine's clock never runs behind its
    # busy seconds, so each busy share is at most 1 (the last token's time would leave out its step's tail).
    wall = max(max(c() for c in clocks), 1e-9)
    return SimulatedRun(setup, results, wall, summarize(results, wall, slo), list(handoffs), [c.busy_s / wall for c in clocks])


def serve_mixed(model, workload: Workload, max_batch_size: int, *, machines: int = 1, slo=None,
                **engine_options) -> SimulatedRun:
    """The workload on `machines` ordinary engines (prefill and decode mixed), request i on machine i % machines."""
    machines = check_count("machines", machines, 1, 64)
    results: list[RequestResult | None] = [None] * len(workload)
    clocks = []
    for m in range(machines):
        mine = list(range(m, len(workload), machines))
        clocks.append(clock := StepClock())
        engine = Engine(model, max_batch_size, prefix_caching=False, clock=clock, **engine_options)
        for i, r in zip(mine, _drive(engine, clock, [workload.requests[i] for i in mine])):
            results[i] = r
    return _served(f"{machines} mixed engine(s)", results, workload, slo, clocks)


def serve_disaggregated(model, workload: Workload, *, prefill_batch: int, decode_batch: int, link_Bps: float,
                        slo=None, **engine_options) -> SimulatedRun:
    """The workload on a prefill worker and a decode worker: each prompt is prefilled (and its first token made)
    on one, its KV cache crosses a link of `link_Bps` bytes/s, and the other decodes the rest. Greedy only."""
    link_Bps = check_positive("link_Bps", link_Bps)
    dtype = model_dtype(model)
    p_clock, d_clock = StepClock(), StepClock()
    prefill = Engine(model, prefill_batch, prefix_caching=False, clock=p_clock, export_kv=True, **engine_options)
    decode = Engine(model, decode_batch, prefix_caching=False, clock=d_clock, **engine_options)
    p_index = {prefill.submit(r.prompt_ids, 1, r.arrival_s, r.eos_id): i for i, r in enumerate(workload)}
    where, results, handoffs = {}, {}, []          # decode id -> workload index; workload index -> result
    while prefill.busy or decode.busy:
        tp, td = _next_event(prefill, p_clock), _next_event(decode, d_clock)
        if tp <= td:                               # the machine whose clock is behind goes next
            p_clock.wait_until(tp)
            for r in p_clock.step(prefill):
                i = p_index[r.id]
                req = workload.requests[i]
                if req.max_new_tokens == 1 or r.finish_reason != "length" or r.kv is None:
                    results[i] = r                 # done at its first token (or refused): nothing to hand over
                    continue
                cost = kv_cache_bytes(model.config, r.prompt_len, 1, dtype) / link_Bps
                handoffs.append(cost)
                d = decode.submit_prefilled(req.prompt_ids, r.tokens[0], r.timestamps[0], r.kv, req.max_new_tokens,
                                            arrival_s=req.arrival_s, ready_s=r.timestamps[0] + cost, eos_id=req.eos_id)
                where[d] = i
        else:
            d_clock.wait_until(td)
            for r in d_clock.step(decode):
                results[where[r.id]] = r
    ordered = [results[i] for i in range(len(workload))]
    return _served("prefill worker + decode worker", ordered, workload, slo, (p_clock, d_clock), handoffs)


__all__ = ["SimulatedRun", "StepClock", "serve_disaggregated", "serve_mixed"]
