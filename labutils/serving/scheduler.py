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
        self._forming = True
        self.prompt_tokens = 0                     # tokens looked up in the prefix cache at admission
        self.cached_tokens = 0                     # ... and found there

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self, now: float) -> list[Sequence]:
        """The running batch for this step's decode, each given room for one more position.

        When blocks run out the newest running request is preempted; then no new request joins
        in this step (admit() says None), so a request just pushed out does not bounce straight back.
        """
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
        self._forming = not self.running           # static mode: a new batch forms only from empty
        return ready

    def admit(self, now: float) -> Sequence | None:
        """The head of the queue, joining the batch with its blocks, or None if it cannot join now.

        One at a time: the engine prefills each newcomer before admitting the next, so a request
        behind it finds the prefix blocks it has just written.
        """
        if self.preempted_now or not self.waiting or len(self.running) >= self.max_batch_size:
            return None
        if self.mode == "static" and not self._forming:
            return None                            # static: the batch is closed until all of it finished
        seq = self.waiting[0]
        alloc = self.blocks.allocate(seq.tokens)
        if alloc is None:
            return None                            # first come, first served: nobody overtakes the head
        self.waiting.popleft()
        seq.table, seq.keys, seq.n_computed = alloc.table, alloc.keys, alloc.cached_tokens
        if not seq.n_generated:                    # count each prompt once, not again after a preemption
            seq.cached_tokens = alloc.cached_tokens
            self.prompt_tokens += len(seq.prompt)
            self.cached_tokens += alloc.cached_tokens
        seq.joined_s = now
        self.running.append(seq)
        return seq

    def finish(self, seq: Sequence, now: float) -> None:
        self.blocks.free(seq.table)
        seq.table = []
        self.running.remove(seq)
        seq.spans.append((seq.joined_s, now))

    # -- internals ---------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence, now: float) -> None:
        self.blocks.free(seq.table)
        seq.table, seq.keys, seq.n_computed = [], [], 0
        seq.preemptions += 1
        self.preemptions += 1
        self.preempted_now = True
        self.running.remove(seq)
        seq.spans.append((seq.joined_s, now))
        self.waiting.appendleft(seq)


__all__ = ["MODES", "Scheduler"]
