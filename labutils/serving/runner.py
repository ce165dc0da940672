"""The device half of a serving step: the scheduler's plan through the model in one packed forward, next tokens out."""
from __future__ import annotations

import torch

from labutils.core.validate import model_device, model_dtype
from labutils.decode.sampling import check_logits, sample
from labutils.core.devices import graphs_unavailable
from labutils.serving.step_graphs import StepGraphs
from labutils.serving.paged_cache import PagedKVCache, Row
from labutils.serving.scheduler import Feed
from labutils.serving.sequence import Sequence
from labutils.serving.workload import PromptKV


class ModelRunner:
    """The model and its paged KV cache (the pool of blocks the scheduler's tables point into).

    run(plan) feeds every planned token in one forward, packed end to end (paged_cache.PackedBatch), not padded,
    each at its own position, and returns the next token of every request whose tokens are now all computed.
    Greedy requests take the argmax, so each gets the tokens of its solo generate() run; a sampled one
    (temperature > 0) draws from its own seeded generator through generate()'s sampler, so its seed reproduces it.
    """

    def __init__(self, model, block_size: int, n_blocks: int, *, cuda_graphs: bool | None = None):
        self.model, self.config = model, model.config
        self.device, self.dtype = model_device(model), model_dtype(model)
        self.cache = PagedKVCache(self.config, block_size, n_blocks, self.device, self.dtype)
        self.token_rows = 0                          # token rows the model computed, over every forward
        # Steps of decode rows and at most one short prefill chunk replay as CUDA graphs where the device has them.
        why_not = graphs_unavailable(self.device)
        if cuda_graphs and why_not:
            raise ValueError(f"cuda_graphs=True, but {why_not}; leave it None (graphs where the device has them)")
        self.graphs = StepGraphs(model, self.cache) if cuda_graphs is not False and not why_not else None

    @property
    def setup_s(self) -> float:
        """Seconds spent recording CUDA graphs so far: setup, which the engine's clock leaves out."""
        return 0.0 if self.graphs is None else self.graphs.record_s

    def run(self, plan: list[Feed], high_water: int) -> dict[Sequence, int]:
        """One packed forward over `plan`; {request: its next token} for every request fed its last token, read back
        to the host (the step's one wait for the device). The pool grows to hold block ids below `high_water`
        (BlockManager.high_water: every id handed out so far)."""
        sampled, tokens = self.forward(plan, high_water)
        return dict(zip(sampled, tokens.tolist()))

    def forward(self, plan: list[Feed], high_water: int) -> tuple[list[Sequence], torch.Tensor]:
        """run() without the wait: the requests fed their last token, and their next tokens left on the device."""
        # One-token rows first (PackedBatch's layout), shortest tables first, so rows of similar length attend together.
        plan = sorted(plan, key=lambda f: (f.n > 1, len(f.seq.table) if f.n == 1 else 0))
        self.cache.ensure(high_water)
        for seq, _ in plan:
            if seq.kv is not None:                               # handed over: store it, then decode from it
                self.cache.write(seq.table, seq.kv)
                seq.kv = None
        flat, ends, rows, sampled = [], [], [], []
        for i, (seq, n) in enumerate(plan):
            flat += seq.tokens[seq.n_computed:seq.n_computed + n]
            if n == seq.remaining:                               # its last token: the next token comes from it
                ends.append(len(flat) - 1)                       # its place among the packed tokens
                rows.append(i)                                   # and among a replayed step's logits (a row each)
                sampled.append(seq)
        if self.graphs is not None:
            logits = self._replay(plan)
            if logits is not None:
                self.token_rows += len(flat)
                return sampled, self.sample(sampled, logits[rows])
        view = self.cache.batch([Row(seq.table, seq.n_computed, n) for seq, n in plan])
        ids = torch.tensor(flat, device=self.device)[None]
        logits = self.model(ids, view, check=False, logits_at=torch.tensor(ends, dtype=torch.long, device=self.device))
        self.token_rows += ids.shape[1]
        return sampled, self.sample(sampled, logits[0])

    def _replay(self, plan: list[Feed]) -> torch.Tensor | None:
        """The step as a replayed graph (step_graphs): logits of its decode rows, then of its chunk's last token; None
        where it does not fit one (two chunks, a long one) or graphs are off."""
        decode = [(seq.tokens[seq.n_computed], seq.n_computed, seq.table) for seq, n in plan if n == 1]
        chunks = [(seq.tokens[seq.n_computed:seq.n_computed + n], seq.n_computed, seq.table) for seq, n in plan if n > 1]
        if not StepGraphs.fits(chunks):
            return None
        return self.graphs.run(decode, chunks[0] if chunks else None)

    @staticmethod
    def sample(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The next token of each request from its row of logits, on the device: greedy in one argmax, sampled
        ones each from its own generator."""
        first = [i for i, s in enumerate(seqs) if not s.n_generated]
        if first:                     # once per request: NaN weights would otherwise give token 0 forever
            check_logits(logits[first])
        tokens = logits.argmax(dim=-1)
        for i, s in enumerate(seqs):
            p = s.sampling
            if p.temperature > 0:
                tokens[i] = sample(logits[i:i + 1], p.temperature, p.top_k, p.top_p, s.generator, check=False)[0]
        return tokens

    def read(self, seq: Sequence) -> PromptKV:
        """A copy of the keys and values of seq's computed positions (what a prefill worker hands over)."""
        return self.cache.read(seq.table, seq.n_computed)


__all__ = ["ModelRunner"]
