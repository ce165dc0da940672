"""One request's state inside the engine: its tokens, its block table and its clock readings."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labutils.serving.workload import GREEDY, PromptKV, RequestResult, SamplingParams, Span


@dataclass(eq=False)
class Sequence:
    """A request as the scheduler moves it: waiting -> running (-> preempted -> waiting ...) -> finished.

    `n_computed` counts the positions whose keys and values are in its blocks: `remaining` tokens are left to
    feed (the whole prompt at first, perhaps in chunks, then one token per decode step). `sampling` is the
    request's SamplingParams; `generator` is its own seeded random stream, so its tokens do not depend on
    what else runs beside it.

    Compared by identity (eq=False): the scheduler's `seq in running` and `running.remove(seq)` would
    otherwise compare every field of every request, which made a schedule quadratic in the batch.
    """

    id: int
    prompt: list[int]
    max_new_tokens: int
    arrival_s: float
    eos_id: int | None = None
    sampling: SamplingParams = GREEDY
    generator: torch.Generator | None = field(default=None, repr=False)
    ready_s: float | None = None                         # when it may join: arrival_s, or when its handed-over KV lands
    kv: PromptKV | None = field(default=None, repr=False)   # handed-over keys and values, until the runner stores them
    timestamps: list[float] = field(default_factory=list)
    table: list[int] = field(default_factory=list)       # block ids, in position order
    keys: list[bytes] = field(default_factory=list)      # prefix-cache keys of its full blocks
    n_computed: int = 0
    cached_tokens: int = 0
    preemptions: int = 0
    spans: list[Span] = field(default_factory=list)
    joined_s: float | None = None                        # when it last joined the running batch
    # prompt + generated tokens, the one list of them: grown in place, never rebuilt per use
    tokens: list[int] = field(init=False)

    def __post_init__(self):
        self.tokens = list(self.prompt)
        if self.ready_s is None:
            self.ready_s = self.arrival_s

    def add_token(self, token: int, t: float) -> None:
        """Append one generated token and the clock reading when it was made."""
        self.tokens.append(token)
        self.timestamps.append(t)

    @property
    def remaining(self) -> int:
        """Tokens whose keys and values are not computed yet: the prompt (or the part a chunk left), or the last token."""
        return len(self.tokens) - self.n_computed

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def generated(self) -> list[int]:
        """The tokens made so far (a copy): for results and tests, not for the step loop."""
        return self.tokens[len(self.prompt):]

    @property
    def hit_eos(self) -> bool:
        return self.eos_id is not None and self.n_generated > 0 and self.tokens[-1] == self.eos_id

    @property
    def done(self) -> bool:
        return self.n_generated >= self.max_new_tokens or self.hit_eos

    def result(self, finish_reason: str | None = None, error: str | None = None) -> RequestResult:
        if finish_reason is None:
            finish_reason = "stop" if self.hit_eos else "length"
        return RequestResult(self.id, self.arrival_s, self.generated, list(self.timestamps), finish_reason,
                             prompt_len=len(self.prompt), error=error, cached_tokens=self.cached_tokens,
                             spans=list(self.spans))


__all__ = ["Sequence"]
