"""Picking the next token: the one sampler every decode path here uses (generate, the fast loop, speculative
decoding, the serving engine), so temperature, top-k, top-p and min-p mean the same thing in each."""
from __future__ import annotations

import math

import torch

from labutils.core import fake_cuda
from labutils.core.validate import check_count, check_number, check_probability, check_temperature, describe


def check_sampling(temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None) -> None:
    """Refuse sampling settings that mean nothing, before any forward pass is spent on them.

    temperature: 0 (greedy) or a finite number > 0 (infinity would flatten every logit and quietly undo
    top_k); top_k: None or an int >= 1; top_p: None or a number in (0, 1]; min_p: None or a number in (0, 1].
    """
    check_temperature(temperature)
    if top_k is not None:
        check_count("top_k", top_k, 1, hint="1 keeps only the most likely token; None keeps all")
    if top_p is not None:
        check_probability("top_p", top_p)
    if min_p is not None:
        check_number("min_p", min_p, above=0, maximum=1,
                     hint="e.g. 0.1 keeps tokens at least a tenth as likely as the top one; None keeps all")


def check_logits(logits) -> None:
    """Refuse logits [batch, vocab] that no token can be picked from: NaN, +inf, or a row that is all -inf.

    -inf alone is fine (a masked token). One host sync: sample() calls it once per call, and
    generate() once per request (the prefill), where NaN weights show up first.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] == 0:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else describe(logits)
        raise TypeError(f"logits must be a float tensor [batch, vocab] with vocab >= 1, got {got}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor [batch, vocab], got dtype {logits.dtype}; "
                        "pass the model's output, or logits.float()")
    if logits.numel() == 0 or fake_cuda.is_fake(logits):     # a fake tensor (labutils.core.fake_cuda) has no values
        return
    bad = torch.isnan(logits).any() | torch.isposinf(logits).any() | torch.isneginf(logits).all(dim=-1).any()
    if bool(bad):
        raise ValueError("logits hold NaN, +inf, or a row where every token is -inf, so no token can be picked; "
                         "the model's weights or inputs are broken (load_hf_gpt2 warns about NaN weights by name)")


def sampling_probs(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, min_p: float | None = None, *, check: bool = True) -> torch.Tensor:
    """The distribution sample() draws from, [batch, vocab] in float32: temperature, top-k, top-p, then min-p.

    temperature=0 puts all mass on the argmax. top_k keeps every token tied with the k-th.
    top_p keeps the smallest set of most likely tokens whose probabilities add up to at least top_p.
    min_p keeps the tokens whose probability is at least min_p x the top token's (after temperature).
    NaN logits are refused (they would give NaN probabilities); `check=False` skips that host sync and the
    settings' checks, for a loop that checked its request once (sample, the fast loop's step, speculative decoding).
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor [batch, vocab], got {describe(logits)}; "
                        "pass the model's output, such as model(ids)[:, -1]")
    if check:
        check_sampling(temperature, top_k, top_p, min_p)
        check_logits(logits)
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    # Shift the max to 0 first (softmax does the same inside): a tiny temperature then sends the other
    # logits to -inf instead of overflowing every logit to +inf and the probabilities to NaN.
    logits = logits.float()
    # A temperature below float32's smallest normal number would round to 0 (0 / 0 = NaN); it is greedy anyway.
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the tokens ranked above it already cover top_p; the first always stays.
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    if min_p is not None:
        # p_i >= min_p * p_max  <=>  logit_i - logit_max >= ln(min_p): no softmax needed, and the cut
        # scales with the model's confidence (a sure model keeps few tokens, an unsure one many).
        # top-k and top-p never drop the top token, so amax is still the top token's logit.
        cut = logits.amax(dim=-1, keepdim=True) + math.log(min_p)
        logits = logits.masked_fill(logits < cut, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample_from(probs: torch.Tensor, temperature: float, generator: torch.Generator | None = None, *,
                noise: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of a distribution probs [rows, vocab], on its device.

    temperature=0 rows are one-hot: take the argmax and draw nothing. Otherwise, without `noise`,
    torch.multinomial draws with `generator`. With `noise` (Exponential(1) draws, [rows, vocab], made
    beforehand into a fixed buffer) the exponential race argmax(p / E) picks token i with probability p_i
    (the smallest E_i / p_i wins, and E_i / p_i is exponential with rate p_i): the same distribution,
    with no random-number state and no host sync inside the step, which a captured CUDA graph needs.
    """
    if temperature == 0:
        return probs.argmax(dim=-1)
    if noise is not None:
        return (probs / noise).argmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None, *, check: bool = True,
           min_p: float | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row of logits [batch, vocab], on the logits' device. temperature=0 is greedy.

    NaN logits are refused (greedy would otherwise return token 0, and the exponential race too); `check=False`
    skips that host sync and the settings' checks, for a step whose request was checked once, in prefill: the
    per-token path then runs no Python checks at all. `noise` draws by the exponential race instead of
    torch.multinomial (see sample_from): the fast loop's way.
    """
    if check:
        check_sampling(temperature, top_k, top_p, min_p)
        check_logits(logits)
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p, check=False)   # checked above, or by the caller
    return sample_from(probs, temperature, generator, noise=noise)


__all__ = ["check_logits", "check_sampling", "sample", "sample_from", "sampling_probs"]
