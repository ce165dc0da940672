"""Serving workloads as plain data, per-request results, and their summary as vLLM's serving benchmark reports it.

One Workload drives the course's Engine (`engine.run_workload`) or a client of a real server:
each Request carries exactly what Engine.submit takes. Each driver returns RequestResults with
token timestamps in seconds since the workload started; `summarize` turns them into TTFT, TPOT,
ITL and end-to-end latency (mean, p50, p99), output tokens/s and goodput under an SLO. The
per-request metrics are labutils.perf.timing's, measured from each request's arrival.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from labutils.decode.sampling import check_sampling
from labutils.perf import timing
from labutils.core.validate import DoesNotFitError, check_count, check_number, check_positive, check_seed

COMPLETED = ("stop", "length")     # finish reasons of a request that produced its answer (OpenAI's names)
MAX_REQUESTS, MAX_LENGTH = 100_000, 2 ** 20   # bounds that keep a typo from filling memory
# Prompt tokens a workload may hold in all: each is a Python int in a tuple (about 36 bytes), so 2**25 of them is
# about 1.2 GB. Each bound above alone allows 10**11.
MAX_TOKENS = 2 ** 25


@dataclass(frozen=True)
class SamplingParams:
    """How a request picks its tokens, with generate()'s options: temperature 0 is greedy (argmax); top_k and top_p
    trim the distribution; seed makes a sampled request reproducible. One record for a workload's Request, the
    engine's Sequence and a server's request body. Checked when made, so a bad option is refused where it is typed."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)
        object.__setattr__(self, "temperature", float(self.temperature))     # 1 and 1.0 are one setting
        if self.seed is not None:
            object.__setattr__(self, "seed", check_seed(self.seed))


GREEDY = SamplingParams()


class PromptKV(NamedTuple):
    """A prompt's keys and values, each [n_layer, prompt tokens, n_kv_head, head_dim]: what a prefill worker hands a
    decode worker (serving.disagg), read from one paged cache and written into another."""

    keys: torch.Tensor
    values: torch.Tensor


class Span(NamedTuple):
    """One stay of a request in the running batch: it joined at joined_s and left (finished or preempted) at left_s."""

    joined_s: float
    left_s: float


@dataclass(frozen=True)
class Request:
    """One request, for the course's Engine (its submit() arguments) and for a server client alike.

    arrival_s counts seconds after the workload starts. id None means its index in the workload.
    eos_id: the token that ends the answer early (the engine's; the client runs to max_new_tokens).
    sampling: how it picks tokens (greedy unless told); a server gets the options in its request body.
    """

    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    arrival_s: float = 0.0
    id: int | None = None
    eos_id: int | None = None
    sampling: SamplingParams = GREEDY

    def __post_init__(self):
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"Request.sampling must be a SamplingParams, got {type(self.sampling).__name__}; for "
                            "example SamplingParams(temperature=0.8, seed=1), or leave it out for greedy")


@dataclass(frozen=True)
class Workload:
    """Requests in arrival order, and a sentence saying how they were drawn."""

    requests: tuple[Request, ...]
    description: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self):
        return iter(self.requests)


def _length_range(name: str, value) -> tuple[int, int]:
    if not isinstance(value, (tuple, list)):
        value = (value, value)            # one length: low = high (check_count refuses what is not one)
    if len(value) != 2:
        raise ValueError(f"{name} must be a length or a (low, high) pair of lengths, got {value!r}")
    lo, hi = (check_count(f"{name}[{i}]", v, 1, MAX_LENGTH) for i, v in enumerate(value))
    if lo > hi:
        raise ValueError(f"{name}=({lo}, {hi}): the low end must not exceed the high end; swap them")
    return lo, hi


def make_workload(n_requests: int, *, vocab_size: int, prompt_len=(16, 64), output_len=(16, 64),
                  rate: float | None = None, system_prompt_len: int = 0, eos_id: int | None = None,
                  seed: int = 0) -> Workload:
    """A seeded workload, drawn as vLLM's benchmark draws its random dataset.

    Prompt and output lengths are uniform integers in the inclusive ranges `prompt_len` and
    `output_len`, prompt tokens uniform ids below vocab_size. `rate` requests/s gives Poisson
    arrivals (exponential gaps, the first request at t=0); None sends every request at t=0.
    `system_prompt_len` > 0 puts one shared, seeded system prompt of that many tokens before
    every request's own prompt (what prefix caching serves).
    """
    n_requests = check_count("n_requests", n_requests, 1, MAX_REQUESTS)
    vocab_size = check_count("vocab_size", vocab_size, 1)
    system_prompt_len = check_count("system_prompt_len", system_prompt_len, 0, MAX_LENGTH)
    p_lo, p_hi = _length_range("prompt_len", prompt_len)
    o_lo, o_hi = _length_range("output_len", output_len)
    if n_requests * (system_prompt_len + p_hi) > MAX_TOKENS:
        raise DoesNotFitError(f"{n_requests:,} requests of up to {system_prompt_len + p_hi:,} prompt tokens could hold "
                              f"{n_requests * (system_prompt_len + p_hi):,} tokens, more than the {MAX_TOKENS:,} a "
                              "workload may hold in memory; ask for fewer requests or shorter prompts")
    if rate is not None:
        rate = check_number("rate", rate, above=0, allow_inf=True,
                            hint="requests per second; None (or inf) sends every request at t=0")
    if eos_id is not None:
        eos_id = check_count("eos_id", eos_id, 0, vocab_size - 1, hint="a token id of the vocab, or None")
    seed = check_seed(seed)
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab_size, system_prompt_len).tolist()
    p_lens = rng.integers(p_lo, p_hi + 1, n_requests)
    o_lens = rng.integers(o_lo, o_hi + 1, n_requests)
    poisson = rate is not None and math.isfinite(rate)
    gaps = rng.exponential(1.0 / rate, n_requests) if poisson else np.zeros(n_requests)
    arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    requests = tuple(Request(tuple(system + rng.integers(0, vocab_size, p).tolist()), int(o), float(a), eos_id=eos_id)
                     for p, o, a in zip(p_lens, o_lens, arrivals))
    when = f"Poisson arrivals at {rate:.3g}/s" if poisson else "all at t=0"        # a log slider gives 50.1187
    shared = f", a shared {system_prompt_len}-token system prompt" if system_prompt_len else ""
    return Workload(requests, f"{n_requests} requests, prompts {p_lo}-{p_hi} tokens{shared}, outputs "
                              f"{o_lo}-{o_hi} tokens (uniform), {when}, seed {seed}")


@dataclass
class RequestResult:
    """What one request produced. Times are seconds since the workload started; metrics count from arrival.

    finish_reason: "stop" (EOS), "length" (max_new_tokens), "rejected" (never ran; `error` says
    why) or "failed" (stopped part-way; `error` says why).
    """

    id: int
    arrival_s: float
    tokens: list[int]
    timestamps: list[float]
    finish_reason: str
    prompt_len: int = 0
    error: str | None = None
    cached_tokens: int = 0                       # prompt tokens served from the prefix cache
    spans: list[Span] = field(default_factory=list)      # its stays in the running batch
    kv: PromptKV | None = field(default=None, repr=False, compare=False)   # a prefill worker's handover (disagg)

    @property
    def ok(self) -> bool:
        return self.finish_reason in COMPLETED

    @property
    def since_arrival(self) -> list[float]:
        return [t - self.arrival_s for t in self.timestamps]

    @property
    def ttft_s(self) -> float:
        return timing.ttft_s(self.since_arrival) if self.timestamps else math.nan

    @property
    def tpot_s(self) -> float:
        return timing.tpot_s(self.since_arrival) if self.timestamps else math.nan

    @property
    def itl_s(self) -> list[float]:
        return timing.itl_s(self.since_arrival) if self.timestamps else []

    @property
    def itl_p99_s(self) -> float:
        """The 99th percentile of this request's gaps (nan with fewer than two tokens): a stall shows here, where its
        mean, TPOT, spreads it over every gap."""
        gaps = self.itl_s
        return float(np.percentile(gaps, 99)) if gaps else math.nan

    @property
    def latency_s(self) -> float:
        """End to end: arrival to the last token."""
        return self.since_arrival[-1] if self.timestamps else math.nan


@dataclass(frozen=True)
class Stats:
    """Mean, median and 99th percentile (numpy's linear interpolation, as vLLM's benchmark)."""

    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values) -> "Stats":
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return cls(math.nan, math.nan, math.nan)
        return cls(float(np.mean(values)), float(np.percentile(values, 50)), float(np.percentile(values, 99)))


# The latest arrival a workload may ask for, in seconds: arrivals are waited for on the real clock, by the
# course's engine and by the server client alike.
MAX_ARRIVAL_S = 3600.0


@dataclass(frozen=True)
class SLO:
    """Service-level objectives; a request is *good* when it meets every one that is set."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    itl_p99_s: float | None = None    # on each request's own p99 gap, as Sarathi-Serve's P99 TBT: a TPOT SLO, a mean,
    #                                   can be met by a stream that stalled once for hundreds of milliseconds

    def __post_init__(self):
        for name in ("ttft_s", "tpot_s", "latency_s", "itl_p99_s"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_number(f"SLO.{name}", getattr(self, name), above=0,
                                                            hint="a limit in seconds, or None for no limit"))

    def met_by(self, r) -> bool:
        # A one-token answer has no TPOT (nan): nothing to miss.
        return r.ok and all(limit is None or not getattr(r, name) > limit
                            for name, limit in dataclasses.asdict(self).items())


@dataclass(frozen=True)
class Summary:
    """A workload's meters. Latency stats cover completed requests; ITL pools every gap of every request."""

    n_requests: int
    n_completed: int
    wall_s: float
    output_tokens: int
    output_tok_s: float           # output tokens of completed requests per second of wall time
    request_per_s: float          # completed requests per second
    goodput_req_s: float          # completed requests meeting the SLO, per second
    ttft_s: Stats
    tpot_s: Stats
    itl_s: Stats
    latency_s: Stats
    slo: SLO

    def table(self) -> str:
        """The summary as lines of text, milliseconds for latencies."""
        lines = [f"requests: {self.n_completed} of {self.n_requests} completed in {self.wall_s:.2f} s",
                 f"throughput: {self.output_tok_s:.1f} output tokens/s, {self.request_per_s:.2f} requests/s, "
                 f"goodput {self.goodput_req_s:.2f} requests/s"]
        for name in ("ttft_s", "tpot_s", "itl_s", "latency_s"):
            s = getattr(self, name)
            lines.append(f"{name.removesuffix('_s').upper():<8} mean {s.mean * 1e3:8.1f} ms   p50 {s.p50 * 1e3:8.1f} ms"
                         f"   p99 {s.p99 * 1e3:8.1f} ms")
        return "\n".join(lines)


def summarize(finished, wall_s: float, slo: SLO | dict | None = None) -> Summary:
    """Meters of a workload's results (anything with RequestResult's fields) over wall_s seconds.

    With no SLO every completed request is good, so goodput equals completed requests/s.
    """
    wall_s = check_positive("wall_s", wall_s)          # the workload's duration in seconds
    if isinstance(slo, dict):
        unknown = set(slo) - {"ttft_s", "tpot_s", "latency_s"}
        if unknown:
            raise ValueError(f"unknown SLO field(s) {sorted(unknown)}; use ttft_s, tpot_s and latency_s")
        slo = SLO(**slo)
    slo = SLO() if slo is None else slo
    if not isinstance(slo, SLO):
        raise TypeError(f"slo must be an SLO, a dict of its fields or None, got {type(slo).__name__}")
    finished = list(finished)
    done = [r for r in finished if r.ok]
    tokens = sum(len(r.tokens) for r in done)
    return Summary(
        n_requests=len(finished), n_completed=len(done), wall_s=wall_s, output_tokens=tokens,
        output_tok_s=tokens / wall_s, request_per_s=len(done) / wall_s,
        goodput_req_s=sum(slo.met_by(r) for r in done) / wall_s,
        ttft_s=Stats.of(r.ttft_s for r in done), tpot_s=Stats.of(r.tpot_s for r in done),
        itl_s=Stats.of(gap for r in done for gap in r.itl_s), latency_s=Stats.of(r.latency_s for r in done),
        slo=slo)


__all__ = ["COMPLETED", "GREEDY", "make_workload", "MAX_ARRIVAL_S", "PromptKV", "Request", "RequestResult", "SamplingParams",
           "SLO", "Span", "Stats", "summarize", "Summary", "Workload"]
