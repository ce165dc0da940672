"""Which requests run in the next step, and how many tokens each: one token budget, chunked prefill, preemption;
and after the step, what it changed: positions, prefix-cache keys, tokens, finished requests."""
from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple

from labutils.core.validate import check_choice, check_count, check_flag
from labutils.serving.blocks import BlockManager
from labutils.serving.sequence import Sequence
from labutils.serving.workload import PromptKV, RequestResult, Span

BATCHING = ("continuous", "static")   # continuous (Orca, vLLM) or static batching
# vLLM's default token budget for an online server (its API server's max_num_batched_tokens with chunked prefill).
DEFAULT_BATCHED_TOKENS = 2048


class Feed(NamedTuple):
    """One entry of a step's plan: feed the model `n` of `seq`'s tokens (1 while it decodes; a prompt or a chunk of one)."""

    seq: Sequence
    n: int


class Scheduler:
    """A waiting queue (first come, first served), a running batch of at most max_batch_size requests, and a
    budget of `max_num_batched_tokens` tokens per step, as vLLM's V1 scheduler plans a step.

    Each step's plan is {request: tokens}: every running request that is decoding gets its one token
    first; then requests still prefilling, then newcomers from the queue, share what is left of the
    budget. With `chunked_prefill` a prompt takes what is left and continues next step (Sarathi-Serve's
    chunked prefill, on by default in vLLM V1); without it a prompt runs whole or waits for a step with
    room for it. continuous: a request joins as soon as a slot, its blocks and budget are free, and
    leaves the moment it finishes. static: a new batch forms only when the whole previous batch has
    finished. When a running request needs a block and none is left, the newest running request is
    *preempted by recompute*: its blocks are freed and it goes back to the front of the queue keeping
    its tokens; when it rejoins, prefill recomputes their keys and values.
    """

    def __init__(self, blocks: BlockManager, max_batch_size: int, max_num_batched_tokens: int | None = None, *,
                 context_length: int, chunked_prefill: bool = True, batching: str = "continuous"):
        batching = check_choice("batching", batching, BATCHING)
        self.blocks, self.max_batch_size, self.batching = blocks, max_batch_size, batching
        self.chunked_prefill = chunked_prefill = check_flag("chunked_prefill", chunked_prefill)
        self.max_num_batched_tokens = self.check_budget(max_num_batched_tokens, max_batch_size, chunked_prefill,
                                                        context_length)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in the order they joined: the newest is last
        self.preemptions = 0
        self.preempted_now = False                 # did the last schedule() have to preempt?
        self._forming = True
        self.prompt_tokens = 0                     # tokens looked up in the prefix cache at admission
        self.cached_tokens = 0                     # ... and found there

    @staticmethod
    def check_budget(budget, max_batch_size: int, chunked_prefill: bool, context_length: int) -> int:
        """The token budget per step: vLLM's default, and its two rules, which schedule() relies on (one token per
        running request fits; without chunking, so does a whole prompt)."""
        if budget is None:
            return max(DEFAULT_BATCHED_TOKENS, max_batch_size, 0 if chunked_prefill else context_length)
        budget = check_count("max_num_batched_tokens", budget, 1)
        if budget < max_batch_size:
            raise ValueError(f"max_num_batched_tokens={budget} is smaller than max_batch_size={max_batch_size}: every "
                             "step must fit one token for each running request; raise the budget or lower "
                             "max_batch_size")
        if not chunked_prefill and budget < context_length:
            raise ValueError(f"max_num_batched_tokens={budget} is below the context length {context_length}: without "
                             "chunked prefill a whole prompt must fit one step; raise the budget or set "
                             "chunked_prefill=True")
        return budget

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float) -> list[Feed]:
        """This step's plan: which requests, and how many of each one's tokens to feed, decodes first, within the
        token budget.

        When blocks run out the newest running request is preempted; then no new request joins in this
        step, so a request just pushed out does not bounce straight back.
        """
        self.preempted_now = False
        ready = []
        for seq in list(self.running):             # oldest first: they keep their blocks
            if not seq.table:
                continue                           # preempted for an older request this round (tables empty then)
            while not self.blocks.append(seq.table, len(seq.tokens)):
                victim = self.running[-1]
                self._preempt(victim, now)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        self._forming = not self.running           # static batching: a new batch forms only from empty
        plan = [Feed(seq, 1) for seq in ready if seq.remaining == 1]
        left = self.max_num_batched_tokens - len(plan)     # >= 0: check_budget keeps it >= max_batch_size
        for seq in ready:
            if seq.remaining > 1 and (n := self._chunk(seq, left)):
                plan.append(Feed(seq, n))
                left -= n
        while (seq := self._admit(now, left)) is not None:
            if n := self._chunk(seq, left):        # static batching admits a whole batch, budget or not
                plan.append(Feed(seq, n))
                left -= n
        return plan

    def postprocess(self, plan: list[Feed], tokens: dict[Sequence, int], now: float,
                    export: Callable[[Sequence], PromptKV] | None = None) -> list[RequestResult]:
        """After the step's forward: each fed request's position moves on and its newly full blocks get their
        prefix-cache keys; `tokens` (the runner's next token per request) are appended at `now`; the requests that
        are done leave the batch. Returns their results. `export(seq)` reads a finished request's keys and values
        before its blocks are freed (a prefill worker's handover)."""
        for seq, n in plan:
            seq.n_computed += n
            self.blocks.commit(seq.table, seq.keys, seq.tokens, seq.n_computed)
        done = []
        for seq, token in tokens.items():
            seq.add_token(token, now)
            if seq.done:
                kv = export(seq) if export is not None else None
                self.finish(seq, now)
                done.append(seq.result())
                done[-1].kv = kv
        return done

    def _chunk(self, seq: Sequence, left: int) -> int:
        """How many of seq's remaining tokens this step takes: as many as fit when chunked, else all or none."""
        if self.chunked_prefill:
            return min(seq.remaining, left)
        return seq.remaining if seq.remaining <= left else 0

    def _admit(self, now: float, left: int) -> Sequence | None:
        """The head of the queue, joining the batch with its blocks, or None if it cannot join now."""
        if self.preempted_now or not self.waiting or len(self.running) >= self.max_batch_size:
            return None
        if self.batching == "static":
            if not self._forming:
                return None                        # static: the batch is closed until all of it finished
        elif left <= 0:
            return None
        seq = self.waiting[0]
        if self._must_wait_for(seq):
            return None
        if not self.chunked_prefill and self.batching != "static":
            hits, _ = self.blocks.lookup(seq.tokens)
            if len(seq.tokens) - len(hits) * self.blocks.block_size > left:
                return None                        # its whole prompt does not fit this step
        alloc = self.blocks.allocate(seq.tokens)
        if alloc is None:
            return None                            # first come, first served: nobody overtakes the head
        self.waiting.popleft()
        seq.table, seq.keys, seq.n_computed = alloc.table, alloc.keys, alloc.cached_tokens
        if seq.kv is not None:                     # handed over by a prefill worker: only its last token is new
            seq.n_computed = len(seq.tokens) - 1
        if not seq.n_generated:                    # count each prompt once, not again after a preemption
            seq.cached_tokens = alloc.cached_tokens
            self.prompt_tokens += len(seq.prompt)
            self.cached_tokens += alloc.cached_tokens
        seq.joined_s = now
        self.running.append(seq)
        return seq

    def _must_wait_for(self, head: Sequence) -> bool:
        """Should `head` wait until a request still prefilling has written the blocks of a prefix they share?
        A block is found in the prefix cache only once it is written, so joining now would compute it twice."""
        if not self.blocks.prefix_caching:
            return False
        bs = self.blocks.block_size
        for s in self.running:
            if s.remaining > 1:
                end = (s.n_computed // bs + 1) * bs    # the end of the first block s has yet to write
                if len(s.tokens) >= end and len(head.tokens) > end and head.tokens[:end] == s.tokens[:end]:
                    return True
        return False

    def finish(self, seq: Sequence, now: float) -> None:
        self.blocks.free(seq.table)
        seq.table = []
        self.running.remove(seq)
        seq.spans.append(Span(seq.joined_s, now))

    # -- internals ---------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, now: float) -> None:
        self.blocks.free(seq.table)
        seq.table, seq.keys, seq.n_computed = [], [], 0
        seq.preemptions += 1
        self.preemptions += 1
        self.preempted_now = True
        self.running.remove(seq)
        seq.spans.append(Span(seq.joined_s, now))
        self.waiting.appendleft(seq)


__all__ = ["BATCHING", "DEFAULT_BATCHED_TOKENS", "Feed", "Scheduler"]
