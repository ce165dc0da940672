"""Which requests run in the next step: continuous or static batching, and preemption by recompute."""
from __future__ import annotations

from collections import deque

from .blocks import BlockManager
from .sequence import Sequence

MODES = ("continuous", "static")


class Scheduler:
    """A waiting queue (first come, first served) and a running batch of at most max_batch_size requests.

    continuous: a request joins as soon as a slot and the blocks for its prompt are free, and
    leaves the moment it finishes. static: a new batch forms only when the whole previous batch
    has finished. When a running request needs a block and none is left, the newest running
    request is *preempted by recompute*: its blocks are freed and it goes back to the front of
    the queue keeping its tokens; when it rejoins, one prefill recomputes their keys and values.
    """

    def __init__(self, blocks: BlockManager, max_batch_size: int, mode: str = "continuous"):
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {list(MODES)}")
        self.blocks, self.max_batch_size, self.mode = blocks, max_batch_size, mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []          # in the order they joined: the newest is last
        self.preemptions = 0
        self.preempted_now = False                 # did the last schedule() have to preempt?
        self.prompt_tokens = 0                     # tokens looked up in the prefix cache at admission
        self.cached_tokens = 0                     # ... and found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float) -> tuple[list[Sequence], list[Sequence]]:
        """(requests to prefill now, requests to decode one token) for the next step.

        The decode list is the batch that was already running, each given room for one more
        position (preempting the newest when blocks run out). New requests join only if nobody
        had to be preempted, so a request just pushed out does not bounce straight back.
        """
        decode = self._make_room(now)
        return ([] if self.preempted_now else self._admit(now)), decode

    def finish(self, seq: Sequence, now: float) -> None:
        self.blocks.free(seq.table)
        seq.table = []
        self.running.remove(seq)
        seq.spans.append((seq.joined_s, now))

    # -- internals ---------------------------------------------------------------------------------

    def _make_room(self, now: float) -> list[Sequence]:
        self.preempted_now = False
        ready = []
        for seq in list(self.running):             # oldest first: they keep their blocks
            if seq not in self.running:
                continue                           # preempted for an older request this round
            while not self.blocks.append(seq.table, seq.n_computed + 1):
                victim = self.running[-1]
                self._preempt(victim, now)
                if victim is seq:
                    break
            else:
                ready.append(seq)
        return ready

    def _preempt(self, seq: Sequence, now: float) -> None:
        self.blocks.free(seq.table)
        seq.table, seq.keys, seq.n_computed = [], [], 0
        seq.preemptions += 1
        self.preemptions += 1
        self.preempted_now = True
        self.running.remove(seq)
        seq.spans.append((seq.joined_s, now))
        self.waiting.appendleft(seq)

    def _admit(self, now: float) -> list[Sequence]:
        if self.mode == "static" and self.running:
            return []
        joined = []
        while self.waiting and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            alloc = self.blocks.allocate(seq.tokens)
            if alloc is None:
                break                              # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            seq.table, seq.keys, seq.n_computed = alloc.table, alloc.keys, alloc.cached_tokens
            if not seq.generated:                  # count each prompt once, not again after a preemption
                seq.cached_tokens = alloc.cached_tokens
                self.prompt_tokens += len(seq.prompt)
                self.cached_tokens += alloc.cached_tokens
            seq.joined_s = now
            self.running.append(seq)
            joined.append(seq)
        return joined


__all__ = ["MODES", "Scheduler"]
