"""Sampling: greedy limits, top-k / top-p on hand-made distributions, seeded reproducibility, bad settings."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from labutils.decode.loop import generate
from labutils.decode.sampling import sample, sampling_probs
from labutils.decode.speculative import PROMPT_LOOKUP, speculative_generate

from test_generate import count_forwards, make_model, prompt

# A hand-made distribution: probabilities 0.5, 0.3, 0.15, 0.05, shuffled so order is not position.
P = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
LOGITS = P.log()[None]          # [1, 4]
RANK = [1, 3, 0, 2]             # tokens from most to least likely


def random_logits(batch=3, vocab=50, seed=0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_temperature_zero_is_argmax():
    logits = random_logits()
    assert torch.equal(sample(logits), logits.argmax(-1))
    assert torch.equal(sample(logits, temperature=0.0, top_k=5, top_p=0.5), logits.argmax(-1))
    probs = sampling_probs(logits, temperature=0)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and torch.equal(probs.sum(-1), torch.ones(3))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_top_k_one_is_greedy(temperature):
    logits = random_logits(seed=1)
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert torch.equal(sample(logits, temperature, top_k=1, generator=g), logits.argmax(-1))


def test_top_k_keeps_the_k_most_likely():
    probs = sampling_probs(LOGITS, 1.0, top_k=2)[0].double()
    expected = torch.zeros(4, dtype=torch.float64)
    expected[[1, 3]] = P[[1, 3]] / (0.5 + 0.3)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("top_p,kept", [(0.3, 1), (0.45, 1), (0.6, 2), (0.79, 2), (0.81, 3), (0.9, 3),
                                        (0.96, 4), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_covering_p(top_p, kept):
    assert_keeps_the_top(kept, top_p=top_p)


def assert_keeps_the_top(kept, **cut):
    """sampling_probs renormalises over the `kept` most likely tokens, and the sampler draws no other."""
    probs = sampling_probs(LOGITS, 1.0, **cut)[0].double()
    keep = RANK[:kept]
    expected = torch.zeros(4, dtype=torch.float64)
    expected[keep] = P[keep] / P[keep].sum()
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample(LOGITS, 1.0, generator=g, **cut)) for _ in range(300)}
    assert drawn == set(keep)


# P = 0.5, 0.3, 0.15, 0.05: min_p x 0.5 is the cut, so the kept set grows as min_p falls.
@pytest.mark.parametrize("min_p,kept", [(1.0, 1), (0.7, 1), (0.6, 2), (0.31, 2), (0.29, 3), (0.11, 3),
                                        (0.09, 4), (0.01, 4)])
def test_min_p_keeps_tokens_within_min_p_of_the_top(min_p, kept):
    assert_keeps_the_top(kept, min_p=min_p)


def test_min_p_cut_follows_the_temperature():
    # At temperature 2 the probabilities flatten (p ~ sqrt(P)): 0.05 is then sqrt(0.1) = 0.32 of the top.
    assert int((sampling_probs(LOGITS, 1.0, min_p=0.2)[0] > 0).sum()) == 3
    assert int((sampling_probs(LOGITS, 2.0, min_p=0.2)[0] > 0).sum()) == 4


def test_min_p_composes_with_top_k_and_is_off_by_default():
    logits = random_logits(seed=4)
    assert torch.equal(sampling_probs(logits, 0.8), sampling_probs(logits, 0.8, min_p=None))
    both = sampling_probs(logits, 0.8, top_k=5, min_p=0.3)
    alone = sampling_probs(logits, 0.8, min_p=0.3)
    kept_both, kept_alone = both > 0, alone > 0
    assert torch.equal(kept_both, kept_alone & (sampling_probs(logits, 0.8, top_k=5) > 0))
    assert (kept_both.sum(-1) >= 1).all() and torch.allclose(both.sum(-1), torch.ones(3))
    # Every kept token is at least min_p times as likely as the top one, in the distribution before the cut.
    full = sampling_probs(logits, 0.8)
    assert (full[kept_alone] >= 0.3 * full.amax(-1, keepdim=True).expand_as(full)[kept_alone] - 1e-6).all()


def test_min_p_in_generate_is_seeded_and_changes_the_text():
    model = make_model(2, seed=9)
    ids = prompt(1, 6, 9)
    a = generate(model, ids, 30, temperature=1.5, min_p=0.5, seed=3).tokens
    assert torch.equal(a, generate(model, ids, 30, temperature=1.5, min_p=0.5, seed=3).tokens)
    assert torch.equal(a, generate(model, ids, 30, temperature=1.5, min_p=0.5, seed=3, use_cache=False).tokens)
    assert not torch.equal(a, generate(model, ids, 30, temperature=1.5, seed=3).tokens)
    # min_p = 1 keeps only the top token: sampling becomes greedy.
    assert torch.equal(generate(model, ids, 30).tokens, generate(model, ids, 30, temperature=1.5, min_p=1.0,
                                                                 seed=3).tokens)


def test_temperature_sharpens_and_flattens():
    cold = sampling_probs(LOGITS, 0.5)[0]
    warm = sampling_probs(LOGITS, 2.0)[0]
    torch.testing.assert_close(sampling_probs(LOGITS, 1.0)[0].double(), P, rtol=0, atol=1e-6)
    assert cold[1] > P[1] > warm[1]          # the favourite gains mass when cold, loses it when warm
    assert cold[2] < P[2] < warm[2]


def test_empirical_frequencies_follow_the_distribution():
    g = torch.Generator().manual_seed(0)
    draws = sample(LOGITS.expand(4000, 4), 1.0, generator=g)
    freq = torch.bincount(draws, minlength=4).double() / 4000
    torch.testing.assert_close(freq, P, rtol=0, atol=0.03)


def test_seeded_sampling_is_reproducible():
    model = make_model(2, seed=9)
    ids = prompt(2, 6, 9)
    a = generate(model, ids, 40, temperature=1.0, top_k=20, seed=123).tokens
    b = generate(model, ids, 40, temperature=1.0, top_k=20, seed=123).tokens
    c = generate(model, ids, 40, temperature=1.0, top_k=20, seed=124).tokens
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # Same seed, same distributions: the recompute path draws the same tokens as the cached one.
    d = generate(model, ids, 40, temperature=1.0, top_k=20, seed=123, use_cache=False).tokens
    assert torch.equal(a, d)


def test_sampling_at_temperature_differs_from_greedy():
    model = make_model(2, seed=9)
    ids = prompt(1, 6, 9)
    greedy = generate(model, ids, 40).tokens
    assert torch.equal(greedy, generate(model, ids, 40, temperature=0.0, seed=5).tokens)
    assert not torch.equal(greedy, generate(model, ids, 40, temperature=2.0, seed=5).tokens)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(temperature=-0.1), ValueError, "temperature must be a finite number >= 0, got -0.1"),
    (dict(temperature=float("nan")), ValueError, "temperature must be a finite number >= 0, got nan"),
    (dict(temperature=float("inf")), ValueError, "temperature must be a finite number >= 0, got inf"),
    (dict(temperature="hot"), TypeError, "temperature must be a number, got str 'hot'"),
    (dict(temperature=1.0, top_k=0), ValueError, "top_k must be >= 1, got 0"),
    (dict(temperature=1.0, top_k=2.5), TypeError, "top_k must be an int, got float 2.5"),
    (dict(temperature=1.0, top_p=0.0), ValueError, r"top_p must be a finite number > 0 and <= 1, got 0.0"),
    (dict(temperature=1.0, top_p=1.5), ValueError, r"top_p must be a finite number > 0 and <= 1, got 1.5"),
    (dict(temperature=1.0, top_p=-0.2), ValueError, r"top_p must be a finite number > 0 and <= 1, got -0.2"),
    (dict(temperature=1.0, min_p=0.0), ValueError, r"min_p must be a finite number > 0 and <= 1, got 0.0"),
    (dict(temperature=1.0, min_p=1.2), ValueError, r"min_p must be a finite number > 0 and <= 1, got 1.2"),
    (dict(temperature=1.0, min_p=float("nan")), ValueError, r"min_p must be a finite number > 0 and <= 1"),
    (dict(temperature=1.0, min_p="0.1"), TypeError, "min_p must be a number, got str '0.1'"),
])
def test_invalid_settings_raise(kwargs, error, message):
    with pytest.raises(error, match=message):
        sample(random_logits(), **kwargs)
    with pytest.raises(error, match=message):
        sampling_probs(random_logits(), **kwargs)


# --- bad input: each of these passed silently before (NaN probabilities, token 0, a bare seed error) ------------------

# Settings that sample (temperature > 0) or not, with and without the cuts.
SETTINGS = st.fixed_dictionaries(dict(temperature=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
                                      top_k=st.sampled_from([None, 1, 3]), top_p=st.sampled_from([None, 0.5, 1.0]),
                                      min_p=st.sampled_from([None, 0.1])))


@st.composite
def logits_with_a_nan(draw):
    """Finite logits [batch, vocab] with one NaN somewhere (the first token too, which greedy used to return)."""
    batch, vocab = draw(st.integers(1, 3)), draw(st.integers(1, 8))
    values = draw(st.lists(st.floats(-20, 20, width=32), min_size=batch * vocab, max_size=batch * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(batch, vocab)
    logits[draw(st.integers(0, batch - 1)), draw(st.integers(0, vocab - 1))] = float("nan")
    return logits


@settings(max_examples=60, deadline=None)
@given(logits=logits_with_a_nan(), sampling=SETTINGS)
def test_sampling_probs_refuses_nan_logits(logits, sampling):
    """They came back as NaN probabilities, which torch.multinomial then refused with a message about probs."""
    with pytest.raises(ValueError, match="logits hold NaN.*weights or inputs are broken"):
        sampling_probs(logits, **sampling)


@settings(max_examples=60, deadline=None)
@given(logits=logits_with_a_nan(), sampling=SETTINGS, seed=st.integers(0, 2 ** 31))
def test_the_exponential_race_refuses_nan_logits(logits, sampling, seed):
    """The fast loop's draw (sample with noise, fastgen's own function before) picked token 0 from NaN probabilities."""
    noise = torch.empty(logits.shape).exponential_(generator=torch.Generator().manual_seed(seed))
    with pytest.raises(ValueError, match="logits hold NaN"):
        sample(logits, noise=noise, **sampling)


def test_unchecked_sampling_is_the_callers_promise():
    """check=False (a loop that checked its request once) skips the host sync, and NaN then goes through unseen."""
    logits = torch.tensor([[float("nan"), 1.0, 2.0]])
    assert torch.isnan(sampling_probs(logits, 1.0, check=False)).all()
    assert int(sample(logits, 1.0, check=False, noise=torch.ones(1, 3))) == 0     # the old silent token 0


@pytest.mark.parametrize("logits", [[[1.0, 2.0]], (1.0, 2.0), 3.0, "logits", None])
def test_sampling_probs_wants_a_tensor(logits):
    with pytest.raises(TypeError, match=r"logits must be a float tensor \[batch, vocab\], got .*model\(ids\)"):
        sampling_probs(logits, temperature=1.0)


def test_integer_logits_are_refused_by_name():
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        sampling_probs(torch.tensor([[1, 2]]), temperature=1.0)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(max_value=-1), draft=st.sampled_from(["model", PROMPT_LOOKUP]))
def test_speculative_generate_refuses_a_negative_seed_before_any_forward(seed, draft):
    target = make_model(2, seed=9)
    with count_forwards(target) as shapes:
        with pytest.raises(ValueError, match=r"seed must be >= 0.*None picks none"):
            speculative_generate(target, target if draft == "model" else draft, prompt(1, 6, 9), 4,
                                 temperature=1.0, seed=seed)
    assert shapes == []
