"""Speculative decoding: a cheap draft proposes k tokens, the target checks them all in one forward pass.

Acceptance follows Leviathan et al. 2023 (arXiv:2211.17192), so sampled output has exactly the
target's distribution and greedy output is exactly the target's greedy output. The draft is a
smaller GPT, or PROMPT_LOOKUP: n-gram matches in the text so far, with no model at all.
"""
from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field

import torch

from labutils.core import fake_cuda
from labutils.perf import timing
from labutils.decode.loop import GenerationResult, as_batch
from labutils.decode.sampling import check_logits, check_sampling, sample_from, sampling_probs
from labutils.decode.kvcache import KVCache
from labutils.core.validate import check_count, check_number, check_seed

PROMPT_LOOKUP = "prompt_lookup"


@dataclass
class SpeculativeResult(GenerationResult):
    """A GenerationResult plus how the draft did. Tokens of one step share one timestamp: they arrive together."""

    k: int = 0
    proposed: int = 0          # draft tokens the target scored
    accepted: int = 0          # of those, how many it kept
    rejected: int = 0          # steps that ended in a rejection (at most one per step)
    steps: int = 0             # verify passes: target forwards after the prompt
    per_step: list[int] = field(default_factory=list)   # tokens each verify pass emitted (accepted + 1)

    @property
    def alpha(self) -> float:
        """Acceptance rate of one proposal: accepted / (accepted + rejected); nan if none was judged.

        Proposals after a step's first rejection are never judged, so they do not count: this is the
        alpha of (1 - alpha^(k+1)) / (1 - alpha), estimated from the proposals that were."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else float("nan")

    @property
    def tokens_per_step(self) -> float:
        """New tokens per target forward: 1 for plain decoding, up to k + 1 here."""
        return self.tokens.shape[1] / self.steps


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Tokens one verify pass yields when each draft token is accepted with probability alpha:
    1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha) (Leviathan et al. 2023, eq. 1)."""
    check_count("k", k, 0)
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha is a probability in [0, 1], got {alpha!r}")
    return float(k + 1) if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Tokens per step over the time of one step, in units of one target forward (Leviathan et al. 2023):
    k draft forwards at cost_ratio each, plus one verify pass over k + 1 tokens at verify_cost target
    forwards (1 while a pass is memory-bound, more once k + 1 tokens cost more than one)."""
    # check_number refuses a bool: verify_cost=True would otherwise pass as 1.
    cost_ratio = check_number("cost_ratio", cost_ratio, minimum=0, hint="a draft forward's time / a target forward's")
    verify_cost = check_number("verify_cost", verify_cost, above=0, hint="a verify pass's time / a target forward's")
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + verify_cost)


def lookup_proposals(seq: list[int], k: int, ngram: int = 3) -> list[int]:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = ngram, then shorter)
    and propose up to k tokens that followed it. No match proposes nothing."""
    k = check_count("k", k, 0, hint="how many tokens to propose; 0 proposes none")
    ngram = check_count("ngram", ngram, 1, hint="the longest tail to look up, e.g. 3")
    for n in range(min(ngram, len(seq) - 1), 0, -1):
        tail = seq[-n:]
        # Latest first: in a loop or a quoted passage the most recent match is the best guess.
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == tail:
                return seq[start + n:start + n + k]
    return []


def accept(p: torch.Tensor, q: torch.Tensor | None, proposal: torch.Tensor, temperature: float,
           generator: torch.Generator | None = None) -> tuple[int, int]:
    """Leviathan et al.'s rule. p [m+1, vocab]: the target's distributions at the m proposals and one past
    them; q [m, vocab]: the draft's (None: a deterministic draft, one-hot at each proposal).

    Proposal i is kept with probability min(1, p_i(d_i) / q_i(d_i)). At the first rejection the next
    token is drawn from norm(max(0, p_i - q_i)); if all m are kept, the bonus token from p_m.
    Returns (accepted count a, next token): the step emits proposal[:a] and then that token.
    """
    m = proposal.shape[0]
    rows = torch.arange(m, device=p.device)
    pd = p[rows, proposal]
    qd = torch.ones_like(pd) if q is None else q[rows, proposal]
    if temperature == 0:
        kept = pd >= qd                     # one-hot p and q: keep exactly when the argmaxes agree
    else:
        kept = torch.rand(m, generator=generator, device=p.device) * qd < pd   # u < p/q, u ~ U[0, 1)
    a = int(kept.long().cumprod(0).sum())   # leading run of kept proposals (the one host sync)
    if a == m:
        return a, int(sample_from(p[m:m + 1], temperature, generator))
    q_a = torch.nn.functional.one_hot(proposal[a], p.shape[-1]).to(p.dtype) if q is None else q[a]
    residual = (p[a] - q_a).clamp(min=0)
    # A rejection implies p_a(d) < q_a(d), so the residual has mass; the guard covers rounding only.
    total = residual.sum()
    residual = residual / total if total > 0 else p[a]
    return a, int(sample_from(residual[None], temperature, generator))


def accept_greedy(logits: torch.Tensor, proposal: torch.Tensor) -> tuple[int, int]:
    """accept() at temperature 0, without building distributions: logits [m+1, vocab] from the verify pass.

    A proposal is kept exactly when it is the target's argmax, and the token after the kept run is the
    target's argmax there, so the step emits plain greedy decoding's tokens. One host read for both.
    """
    best = logits.argmax(dim=-1)                                   # the target's greedy token at each position
    m = proposal.shape[0]
    a = int((best[:m] == proposal).long().cumprod(0).sum()) if m else 0
    return a, int(best[a])


def check_draft(target, draft, needed: int) -> None:
    """Refuse a draft that cannot serve this request, before any forward pass is spent."""
    if isinstance(draft, str):
        if draft != PROMPT_LOOKUP:
            raise ValueError(f"draft must be a GPT or {PROMPT_LOOKUP!r} (n-gram lookup in the text so far), "
                             f"got {draft!r}")
        return
    if not hasattr(draft, "config") or not callable(draft):
        raise TypeError(f"draft must be a GPT or {PROMPT_LOOKUP!r}, got {type(draft).__name__}")
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"the draft's vocabulary ({dv} tokens) differs from the target's ({tv} tokens): its "
                         "token ids would mean other tokens. Train the draft with the target's tokenizer "
                         "(python -m labutils.train --model draft) or use draft='prompt_lookup'")
    if needed > draft.config.context_length:
        raise ValueError(f"the request needs {needed} positions but the draft's context length is "
                         f"{draft.config.context_length}; shorten the prompt or max_new_tokens, or use a "
                         "draft with a longer context")
    t_dev, d_dev = next(target.parameters()).device, next(draft.parameters()).device
    if t_dev != d_dev:
        raise ValueError(f"the draft is on {d_dev} but the target is on {t_dev}; move both to one device")


def propose(draft, cache: KVCache, seq: list[int], k: int, sampling: dict, generator, device):
    """k tokens from the draft model, one forward each: (tokens [k], q [k, vocab], or None when greedy).

    The draft first catches up on the tokens it has not seen (one, or two after a fully accepted
    step); its cache then holds every token but the last proposal, which it never needs to read.
    A greedy draft is deterministic (its q is one-hot at each proposal), so no q is built.
    """
    greedy = sampling["temperature"] == 0
    feed = torch.tensor([seq[cache.pos:]], device=device)
    tokens, qs = [], []
    for _ in range(k):
        logits = draft(feed, cache, check=False, last_only=True)[:, -1]
        if greedy:
            tok = logits.argmax(dim=-1)       # the argmax of sampling_probs(logits, temperature=0)
        else:
            q = sampling_probs(logits, **sampling, check=False)     # a host sync per draft token would cost more
            tok = sample_from(q, sampling["temperature"], generator)
            qs.append(q)
        tokens.append(tok)
        feed = tok[:, None]
    return torch.cat(tokens), (None if greedy else torch.cat(qs))


def verify(target, cache: KVCache, last: torch.Tensor, proposal: torch.Tensor) -> torch.Tensor:
    """The verify pass: the target's logits at all m + 1 positions of [last token, m proposals], in one forward
    that writes their keys and values into `cache` ([m + 1, vocab], on the device)."""
    return target(torch.cat([last, proposal])[None], cache, check=False)[0]


@torch.inference_mode()
def speculative_generate(target, draft, ids, max_new_tokens: int, *, k: int = 4, temperature: float = 0.0,
                         top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                         ngram: int = 3) -> SpeculativeResult:
    """Generate from `target` with `draft` (a smaller GPT, or PROMPT_LOOKUP) proposing k tokens per step.

    Every emitted token comes from a verify pass: the target runs once over the last token and the
    proposals, and accept() keeps a prefix of them plus one token of its own. Greedy output equals
    generate(target, ...)'s; sampled output has the same distribution. One sequence (batch 1):
    each sequence would accept a different number of tokens, and a KVCache keeps one position.
    """
    t0 = time.perf_counter()   # validation and cache allocation count toward TTFT, as in generate()
    device = next(target.parameters()).device
    ids = as_batch(ids, device)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
        raise TypeError(f"max_new_tokens must be an int, got {type(max_new_tokens).__name__} {max_new_tokens!r}")
    max_new_tokens = int(max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    check_count("k", k, 1)
    check_count("ngram", ngram, 1)
    check_sampling(temperature, top_k, top_p)
    seed = None if seed is None else check_seed(seed)      # a negative seed, before any forward pass
    if ids.shape[0] != 1:
        raise ValueError(f"speculative_generate takes one sequence, got a batch of {ids.shape[0]}: each sequence "
                         "accepts a different number of tokens per step; call it once per prompt")
    T = ids.shape[1]
    needed = T + max_new_tokens
    if needed > target.config.context_length:
        raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {needed} tokens exceed the "
                         f"target's context length {target.config.context_length}; shorten one of them")
    check_draft(target, draft, needed)
    target.check_ids(ids)
    lookup = isinstance(draft, str)
    generator = fake_cuda.generator(device, seed)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)

    # Both caches hold every token of seq but the last; the last is fed with the next proposals.
    seq = ids[0].tolist()
    t_cache = KVCache(target.config, 1, needed, device=device, dtype=next(target.parameters()).dtype)
    d_cache = None if lookup else KVCache(draft.config, 1, needed, device=device,
                                          dtype=next(draft.parameters()).dtype)
    if T > 1:
        target(ids[:, :-1], t_cache, check=False, last_only=True)
        if not lookup:
            draft(ids[:, :-1], d_cache, check=False, last_only=True)

    new: list[int] = []
    stamps: list[float] = []
    proposed = accepted = rejected = steps = 0
    per_step: list[int] = []
    while len(new) < max_new_tokens:
        m = min(k, max_new_tokens - len(new) - 1)   # never emit past max_new_tokens (or the context)
        q = None
        if m == 0:
            proposal = torch.empty(0, dtype=torch.long, device=device)
        elif lookup:
            proposal = torch.tensor(lookup_proposals(seq, m, ngram), dtype=torch.long, device=device)
        else:
            proposal, q = propose(draft, d_cache, seq, m, sampling, generator, device)
        m = proposal.shape[0]
        n = len(seq)
        logits = verify(target, t_cache, torch.tensor([seq[-1]], device=device), proposal)
        if steps == 0:
            check_logits(logits)      # once per request: NaN weights would otherwise give token 0 forever
        if temperature == 0:
            a, tok = accept_greedy(logits, proposal)
        else:
            a, tok = accept(sampling_probs(logits, **sampling, check=False), q, proposal, temperature, generator)
        step_tokens = proposal[:a].tolist() + [tok]
        # Roll back: entries past the accepted tokens are simply overwritten by the next step.
        t_cache.pos = n + a
        if d_cache is not None:
            d_cache.pos = min(d_cache.pos, n + a)
        seq += step_tokens
        new += step_tokens
        timing.synchronize(device)
        stamps += [time.perf_counter() - t0] * len(step_tokens)
        proposed, accepted, rejected, steps = proposed + m, accepted + a, rejected + (a < m), steps + 1
        per_step.append(len(step_tokens))
    return SpeculativeResult(torch.tensor([new]), stamps, T, k=k, proposed=proposed, accepted=accepted,
                             rejected=rejected, steps=steps, per_step=per_step)


__all__ = ["PROMPT_LOOKUP", "SpeculativeResult", "accept", "accept_greedy", "expected_speedup", "expected_tokens_per_step",
           "lookup_proposals", "propose", "speculative_generate"]
