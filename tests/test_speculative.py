"""Speculative decoding: greedy output is the target's, sampled output has the target's distribution,
the draft and the one-pass verify are really used, and bad input is refused before any work."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from test_generate import count_forwards, make_model, prompt

from labutils.decode.loop import generate
from labutils.decode.sampling import sampling_probs
from labutils.model.gpt import GPT, GPTConfig
from labutils.decode.speculative import (PROMPT_LOOKUP, accept, accept_greedy, expected_speedup,
                                         expected_tokens_per_step, lookup_proposals, speculative_generate)

N_NEW = 40


def chi2_critical(df: int, alpha: float = 1e-3) -> float:
    """Upper alpha quantile of chi-square(df) by the Wilson-Hilferty cube-root approximation
    (Wilson & Hilferty 1931; within about 1% for df >= 3 at these tails)."""
    z = {1e-3: 3.090232, 1e-2: 2.326348}[alpha]          # standard normal upper quantiles
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom. Cells are pooled, smallest first, until each group
    expects at least 5 draws; a cell of probability 0 must stay empty."""
    assert counts[probs == 0].sum() == 0, f"draws landed on tokens of probability 0: {counts}"
    expected = probs.double() * counts.sum()
    order = torch.argsort(expected)
    obs, exp, o, e = [], [], 0.0, 0.0
    for i in order[(expected[order] > 0)].tolist():
        o, e = o + float(counts[i]), e + float(expected[i])
        if e >= 5:
            obs.append(o), exp.append(e)
            o, e = 0.0, 0.0
    if e > 0:                               # a remainder under 5 joins the last group
        obs[-1], exp[-1] = obs[-1] + o, exp[-1] + e
    obs, exp = torch.tensor(obs), torch.tensor(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


# ---------------------------------------------------------------- greedy equality

DRAFTS = ["noisy copy", "stranger", "target", PROMPT_LOOKUP]


def noisy_copy(model, noise=0.08, seed=0):
    """The target's weights plus noise: a draft that agrees often but not always, so rollbacks are partial."""
    draft = make_model(seed=0, n_kv_head=model.config.n_kv_head, n_layer=model.config.n_layer,
                       ctx=model.config.context_length)
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in draft.parameters():
            w.add_(torch.randn(w.shape, generator=g, dtype=w.dtype) * noise)
    return draft


def make_draft(kind, target, seed):
    if kind == "noisy copy":
        return noisy_copy(target, seed=seed)
    if kind == "stranger":   # unrelated weights: almost every proposal is rejected
        return make_model(n_kv_head=1, seed=seed + 100, n_layer=1, n_head=2, ctx=target.config.context_length)
    return target if kind == "target" else PROMPT_LOOKUP


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("draft_kind", DRAFTS)
def test_greedy_speculative_equals_greedy_generate(k, draft_kind):
    target = make_model(n_kv_head=2, seed=k)
    draft = make_draft(draft_kind, target, k)
    ids = prompt(1, 8, seed=k)
    want = generate(target, ids, N_NEW).tokens
    got = speculative_generate(target, draft, ids, N_NEW, k=k)
    assert torch.equal(got.tokens, want)
    assert len(set(want[0].tolist())) >= 8, "the target degenerated; equality would prove little"
    assert got.tokens.shape == (1, N_NEW) and len(got.timestamps) == N_NEW
    if draft_kind == "noisy copy":   # some proposals kept, some rejected: the caches really rolled back
        assert 0 < got.accepted < got.proposed
    if draft_kind == "target":
        assert got.alpha == 1.0


@settings(max_examples=12)
@given(n_layer=st.integers(1, 2), n_head=st.sampled_from([1, 2, 4]), kv_div=st.sampled_from([1, 2]),
       gated=st.booleans(), k=st.integers(1, 6), prompt_len=st.integers(1, 30), seed=st.integers(0, 999))
def test_greedy_equality_for_random_configs(n_layer, n_head, kv_div, gated, k, prompt_len, seed):
    n_kv = max(1, n_head // kv_div)
    target = make_model(n_kv_head=n_kv, gated=gated, seed=seed, n_layer=n_layer, n_head=n_head)
    draft = make_model(n_kv_head=1, seed=seed + 1, n_layer=1, n_head=1)
    ids = prompt(1, prompt_len, seed)
    want = generate(target, ids, 24).tokens
    for d in (draft, PROMPT_LOOKUP):
        assert torch.equal(speculative_generate(target, d, ids, 24, k=k).tokens, want)


@pytest.mark.parametrize("prompt_len,new", [(95, 1), (94, 2), (90, 6), (80, 16), (1, 95)])
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_equality_up_to_the_context_limit(prompt_len, new, k):
    """The request fills the context exactly (96): the last step must propose fewer than k."""
    target = make_model(seed=7)
    ids = prompt(1, prompt_len, seed=prompt_len)
    want = generate(target, ids, new).tokens
    for d in (noisy_copy(target), target, PROMPT_LOOKUP):
        got = speculative_generate(target, d, ids, new, k=k)
        assert torch.equal(got.tokens, want)


def test_a_perfect_draft_is_always_accepted_and_k_plus_one_tokens_come_per_pass():
    target = make_model(seed=3)
    with count_forwards(target) as shapes:
        r = speculative_generate(target, target, prompt(1, 8, 3), 25, k=4)
    assert r.alpha == 1.0 and r.steps == 5 and r.tokens_per_step == 5.0 and r.per_step == [5] * 5
    # The target itself ran as draft, so its hook saw the draft forwards too; the verify passes are the [1, 5] ones.
    assert shapes.count((1, 5)) == 5 and (1, 7) in shapes     # one prompt pass over all but the last token


def test_verify_is_one_target_forward_over_k_plus_one_tokens():
    target = make_model(seed=4)
    draft = noisy_copy(target)
    with count_forwards(target) as t_shapes, count_forwards(draft) as d_shapes:
        r = speculative_generate(target, draft, prompt(1, 8, 4), 30, k=3)
    assert t_shapes[0] == (1, 7)                                   # the prompt minus its last token
    assert len(t_shapes) == 1 + r.steps                            # one target pass per step, nothing else
    # k + 1 = 4 tokens per pass; only the last steps check fewer, so as not to emit past max_new_tokens.
    assert all(s[1] <= 4 for s in t_shapes[1:]) and t_shapes.count((1, 4)) >= r.steps - 3
    assert 0 < r.accepted < r.proposed
    assert d_shapes[0] == (1, 7) and all(s[1] <= 2 for s in d_shapes[1:])   # the draft: one token (two to catch up)
    assert r.proposed == sum(s[1] - 1 for s in t_shapes[1:])
    assert sum(r.per_step) == 30 and len(r.per_step) == r.steps and r.accepted == 30 - r.steps


def test_prompt_lookup_proposes_from_a_repetitive_prompt():
    target = make_model(seed=6)
    ids = prompt(1, 8, 6)
    quoted = torch.cat([ids, ids, ids[:, :4]], dim=1)          # the prompt quotes itself
    want = generate(target, quoted, 20).tokens
    r = speculative_generate(target, PROMPT_LOOKUP, quoted, 20, k=6)
    assert torch.equal(r.tokens, want)
    assert r.proposed >= 4                                     # at least the first step found "ids[4:8]"


# ---------------------------------------------------------------- the distribution

VOCAB_SMALL = 8


def small_model(seed, n_layer=1, vocab=VOCAB_SMALL):
    cfg = GPTConfig(vocab_size=vocab, context_length=16, n_layer=n_layer, n_head=2, n_embd=16)
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)      # spread the next-token distribution out
    return model.double().eval()


@pytest.mark.parametrize("draft_kind,sampling", [
    ("model", dict(temperature=1.0)), ("model", dict(temperature=0.7, top_k=5)),
    ("model", dict(temperature=1.3, top_p=0.8)), (PROMPT_LOOKUP, dict(temperature=1.0)),
])
def test_first_token_has_the_targets_distribution(draft_kind, sampling):
    target, draft = small_model(0, n_layer=2), small_model(1)
    ids = torch.tensor([[1, 2, 3, 1, 2]])                  # lookup proposes 3 after the trailing "1 2"
    if draft_kind == PROMPT_LOOKUP:
        draft = PROMPT_LOOKUP
    with torch.no_grad():
        p = sampling_probs(target(ids)[:, -1], **sampling)[0]
        q = sampling_probs(small_model(1)(ids)[:, -1], **sampling)[0]
    n = 2000
    counts = torch.zeros(VOCAB_SMALL)
    rejected = 0
    for seed in range(n):
        r = speculative_generate(target, draft, ids, 2, k=1, seed=seed, **sampling)
        counts[r.tokens[0, 0]] += 1
        rejected += r.accepted < r.proposed
    stat, df = chi2_statistic(counts, p)
    assert stat < chi2_critical(df), (stat, df, counts, p * n)
    assert rejected > n / 20, "the draft was almost never rejected: the resampling path went untested"
    # The same test tells the draft's own distribution apart, so it is able to fail.
    other = q if draft_kind == "model" else torch.nn.functional.one_hot(torch.tensor(3), VOCAB_SMALL).double()
    stat_q, df_q = chi2_statistic(counts, 0.5 * other + 0.5 * p)
    assert stat_q > chi2_critical(df_q)


def test_first_two_tokens_have_the_targets_joint_distribution():
    """Two tokens: the second comes from a bonus draw, a resample, or a later step, and the mix must be p(a) p(b|a)."""
    vocab = 5
    target, draft = small_model(0, vocab=vocab), small_model(1, vocab=vocab)
    ids = torch.tensor([[0, 1, 2]])
    with torch.no_grad():
        first = torch.softmax(target(ids)[0, -1], -1)
        nxt = torch.stack([torch.softmax(target(torch.cat([ids, torch.tensor([[a]])], 1))[0, -1], -1)
                           for a in range(vocab)])
    joint = (first[:, None] * nxt).flatten()
    n = 2500
    counts = torch.zeros(vocab * vocab)
    for seed in range(n):
        a, b = speculative_generate(target, draft, ids, 2, k=1, temperature=1.0, seed=seed).tokens[0].tolist()
        counts[a * vocab + b] += 1
    stat, df = chi2_statistic(counts, joint)
    assert stat < chi2_critical(df), (stat, df)


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_accept_alone_outputs_p(deterministic_draft):
    """accept() on fixed p and q, many draws: its first output token is distributed as p."""
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 6, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 6, generator=g, dtype=torch.float64) * 1.5, -1)
    counts = torch.zeros(6)
    for _ in range(6000):
        d = torch.tensor([2]) if deterministic_draft else torch.multinomial(q[0], 1, generator=g)
        a, tok = accept(p, None if deterministic_draft else q, d, 1.0, g)
        counts[int(d) if a == 1 else tok] += 1
    stat, df = chi2_statistic(counts, p[0])
    assert stat < chi2_critical(df)
    wrong, _ = chi2_statistic(counts, q[0])
    assert wrong > chi2_critical(df)


def test_greedy_accept_keeps_matching_argmaxes_and_corrects_the_first_miss():
    p = torch.nn.functional.one_hot(torch.tensor([4, 1, 0, 3]), 5).float()
    q = torch.nn.functional.one_hot(torch.tensor([4, 1, 2]), 5).float()
    assert accept(p, q, torch.tensor([4, 1, 2]), 0.0) == (2, 0)     # third proposal wrong: the target's 0
    assert accept(p, q[:2], torch.tensor([4, 1]), 0.0) == (2, 0)    # all kept: bonus from p[2]
    assert accept(p, None, torch.tensor([4, 1, 0]), 0.0) == (3, 3)  # lookup, all kept: bonus from p[3]


@pytest.mark.parametrize("seed", range(20))
def test_accept_greedy_agrees_with_accept_on_one_hot_distributions(seed):
    # The greedy fast path must be accept() at temperature 0, ties included (argmax takes the first).
    g = torch.Generator().manual_seed(seed)
    m = int(torch.randint(0, 6, (1,), generator=g))
    logits = torch.randint(0, 3, (m + 1, 7), generator=g).float()       # few values: many ties
    proposal = torch.randint(0, 7, (m,), generator=g)
    if m and seed % 2:
        proposal[: m // 2 + 1] = logits[: m // 2 + 1].argmax(-1)        # a kept run, then maybe a miss
    assert accept_greedy(logits, proposal) == accept(sampling_probs(logits), None, proposal, 0.0)


# ---------------------------------------------------------------- formulas and lookup

def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_step(0.8, 3) == pytest.approx(sum(0.8 ** i for i in range(4)))
    assert expected_speedup(0.8, 3, 0.0) == pytest.approx(expected_tokens_per_step(0.8, 3))
    assert expected_speedup(0.0, 4, 0.25) == pytest.approx(0.5)           # a useless draft halves the speed
    assert expected_speedup(1.0, 4, 0.0, verify_cost=5.0) == pytest.approx(1.0)   # verify as dear as 5 steps
    with pytest.raises(ValueError, match="verify_cost"):
        expected_speedup(0.5, 2, 0.1, verify_cost=0)
    with pytest.raises(ValueError, match="alpha"):
        expected_tokens_per_step(1.5, 2)


def test_accept_yields_the_expected_tokens_per_step_when_acceptances_are_independent():
    """Same p and q at every position: each proposal is kept with alpha = sum(min(p, q)), independently,
    and the mean tokens per step is (1 - alpha^(k+1)) / (1 - alpha)."""
    g = torch.Generator().manual_seed(1)
    p1 = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    q1 = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64), -1)
    alpha, k, n = float(torch.minimum(p1, q1).sum()), 3, 4000
    p, q = p1.expand(k + 1, 6), q1.expand(k, 6)
    total = sum(accept(p, q, torch.multinomial(q, 1, generator=g)[:, 0], 1.0, g)[0] + 1 for _ in range(n))
    want = expected_tokens_per_step(alpha, k)
    sd = 1.5 / n ** 0.5                          # tokens per step lie in [1, k + 1]: sd of one step < 1.5
    assert abs(total / n - want) < 4 * sd, (total / n, want)
    assert abs(total / n - expected_tokens_per_step(min(1.0, alpha + 0.15), k)) > 4 * sd   # able to fail


def test_lookup_proposals():
    assert lookup_proposals([1, 2, 3, 9, 8, 1, 2, 3], 2) == [9, 8]         # 3-gram match
    assert lookup_proposals([5, 2, 3, 9, 8, 1, 2, 3], 4) == [9, 8, 1, 2]   # falls back to the 2-gram "2 3"
    assert lookup_proposals([1, 7, 1, 4, 1], 3) == [4, 1]                  # latest match of "1"; cut at the end
    assert lookup_proposals([1, 2, 3, 4], 3) == []                         # nothing repeats: no proposal
    assert lookup_proposals([1, 2, 3, 1, 2, 3], 3, ngram=1) == [1, 2, 3]   # 1-gram "3": what followed it
    assert lookup_proposals([1, 2, 3, 1, 2, 4], 3) == []                   # "4" occurs only at the end
    assert lookup_proposals([7], 3) == []


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("k", [0, -1])
def test_k_below_one_is_refused(k):
    target = make_model(seed=0)
    with pytest.raises(ValueError, match=r"k must be >= 1"):
        speculative_generate(target, PROMPT_LOOKUP, prompt(), 4, k=k)


@pytest.mark.parametrize("k", [1.5, True, "4"])
def test_k_must_be_an_int(k):
    with pytest.raises(TypeError, match="k must be an int"):
        speculative_generate(make_model(seed=0), PROMPT_LOOKUP, prompt(), 4, k=k)


def test_vocab_mismatch_names_both_sizes_before_any_forward():
    target = make_model(seed=0)
    draft = GPT(GPTConfig(vocab_size=50, context_length=96, n_layer=1, n_head=2, n_embd=16))
    with count_forwards(target) as shapes:
        with pytest.raises(ValueError, match=r"draft's vocabulary \(50 tokens\) differs from the target's \(97 tokens\)"):
            speculative_generate(target, draft, prompt(), 4)
    assert shapes == []


def test_draft_with_a_shorter_context_is_refused_before_any_work():
    target = make_model(seed=0)                                   # context 96
    draft = make_model(seed=1, n_layer=1, ctx=32)
    with count_forwards(target) as t_shapes, count_forwards(draft) as d_shapes:
        with pytest.raises(ValueError, match=r"needs 40 positions but the draft's context length is 32"):
            speculative_generate(target, draft, prompt(1, 30), 10)
    assert t_shapes == [] and d_shapes == []
    assert speculative_generate(target, draft, prompt(1, 22), 10).tokens.shape == (1, 10)   # 32 fits


@pytest.mark.parametrize("bad, err, match", [
    ("medusa", ValueError, "prompt_lookup"),
    (object(), TypeError, "draft must be a GPT"),
])
def test_unknown_drafts_are_refused(bad, err, match):
    with pytest.raises(err, match=match):
        speculative_generate(make_model(seed=0), bad, prompt(), 4)


def test_batches_and_long_requests_are_refused():
    target = make_model(seed=0)
    with pytest.raises(ValueError, match="one sequence, got a batch of 2"):
        speculative_generate(target, PROMPT_LOOKUP, prompt(2), 4)
    with pytest.raises(ValueError, match="exceed the target's context length 96"):
        speculative_generate(target, PROMPT_LOOKUP, prompt(1, 90), 10)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        speculative_generate(target, PROMPT_LOOKUP, prompt(), 0)
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(target, PROMPT_LOOKUP, prompt(), 4, temperature=-1)
