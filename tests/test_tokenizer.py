"""BPE training, the tiktoken wrapping, offline encodings, save/load and error messages."""
import collections
import socket

import pytest
import regex
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from labutils.text import tokenizer as tk

SAMPLE = (
    "The cache stores keys and values. The cache grows by one entry per token, and the cache "
    "is read again at every step. Reading the cache costs bandwidth, not arithmetic: 1234 56789.\n"
) * 3


def reference_merges(text, n_merges, pat=tk.GPT4_SPLIT_PATTERN):
    """The slow loop lesson 01 writes inline: recount every pair, merge the most frequent one."""
    words = {tuple(c.encode()): n for c, n in collections.Counter(regex.findall(pat, text)).items()}
    merges = []
    for i in range(n_merges):
        counts = collections.Counter()
        for w, n in words.items():
            for pair in zip(w, w[1:]):
                counts[pair] += n
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        words = {tuple(tk.merge(w, best, 256 + i)): n for w, n in words.items()}
    return merges


@pytest.fixture(scope="module")
def small_enc():
    return tk.train_bpe(SAMPLE, 256 + 40 + 1)


# ---------------------------------------------------------------- training

def test_train_bpe_matches_reference_loop():
    enc, merges = tk.train_bpe(SAMPLE, 256 + 60 + 1, return_merges=True)
    assert merges == reference_merges(SAMPLE, 60)
    assert merges == tk.bpe_merges(SAMPLE, 60)


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="abc d\n", min_size=30, max_size=200), st.integers(1, 12))
def test_train_bpe_matches_reference_on_random_text(text, n):
    try:
        fast = tk.bpe_merges(text, n)
    except ValueError:  # text too short for n merges
        return
    ref = reference_merges(text, n)
    # The fast trainer skips a pair that would re-spell an existing token; the reference does not.
    spelled = [bytes([b]) for b in range(256)]
    for a, b in ref:
        spelled.append(spelled[a] + spelled[b])
    if len(set(spelled)) == len(spelled):
        assert fast == ref


def test_ties_go_to_smallest_pair():
    # Every pair occurs once; (97, 98) = "ab" is the smallest, wherever it sits in the text.
    assert tk.bpe_merges("abcd", 1) == [(97, 98)]
    assert tk.bpe_merges("cdab", 1) == [(97, 98)]
    assert tk.bpe_merges("dcba", 1) == [(98, 97)]


def test_ranks_are_valid_tiktoken(small_enc):
    ranks = small_enc._mergeable_ranks
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert all(ranks[bytes([b])] == b for b in range(256))
    assert small_enc.n_vocab == 256 + 40 + 1
    assert small_enc._special_tokens == {tk.ENDOFTEXT: 296}
    assert isinstance(small_enc, tiktoken.Encoding)
    # every merged token is the concatenation of two earlier tokens
    by_rank = {r: t for t, r in ranks.items()}
    for r in range(256, len(ranks)):
        t = by_rank[r]
        assert any(t[:k] in ranks and ranks[t[:k]] < r and t[k:] in ranks and ranks[t[k:]] < r
                   for k in range(1, len(t)))


def test_trained_encoding_compresses(small_enc):
    assert len(small_enc.encode(SAMPLE)) < 0.6 * len(SAMPLE.encode())


def test_special_token(small_enc):
    ids = small_enc.encode("hi" + tk.ENDOFTEXT, allowed_special="all")
    assert ids[-1] == 296
    assert tk.encode(small_enc, tk.ENDOFTEXT) != [296]  # plain text by default


def test_duplicate_spelling_is_rejected():
    with pytest.raises(ValueError, match="already token"):
        tk.ranks_from_merges([(97, 98), (256, 99), (98, 99), (97, 258)])  # "abc" twice


# ---------------------------------------------------------------- errors

def test_errors():
    with pytest.raises(ValueError, match="vocab_size"):
        tk.train_bpe(SAMPLE, 255)
    with pytest.raises(ValueError, match="vocab_size"):
        tk.train_bpe(SAMPLE, 256)  # no room for <|endoftext|>
    with pytest.raises(ValueError, match="empty"):
        tk.train_bpe("", 300)
    with pytest.raises(ValueError, match="smaller vocab_size"):
        tk.train_bpe("ab", 400)
    with pytest.raises(TypeError, match="str"):
        tk.train_bpe(b"bytes", 300)
    with pytest.raises(ValueError, match="cl100k_base"):
        tk.get_encoding("gpt2")
    with pytest.raises(TypeError, match="decode"):
        tk.encode("course", b"hello")
    with pytest.raises(TypeError, match="encode_batch"):
        tk.encode("course", ["a", "b"])
    with pytest.raises(TypeError, match="str"):
        tk.encode("course", 42)


# ---------------------------------------------------------------- offline encodings

@pytest.fixture
def no_network(monkeypatch):
    """Any socket connection, or any attempt to read a URL through tiktoken, fails the test."""
    attempts = []

    def refuse(self, *args, **kwargs):
        attempts.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    import tiktoken.load
    real_read = tiktoken.load.read_file

    def read_file(blobpath):
        if "://" in blobpath:
            attempts.append(blobpath)
            raise OSError(f"tried to fetch {blobpath}")
        return real_read(blobpath)

    monkeypatch.setattr(tiktoken.load, "read_file", read_file)
    tk.get_encoding.cache_clear()
    yield attempts
    tk.get_encoding.cache_clear()


def test_cl100k_offline(no_network):
    enc = tk.get_encoding("cl100k_base")
    assert enc.name == "cl100k_base"
    assert enc.encode("hello world") == [15339, 1917]
    assert enc.n_vocab == 100277
    assert enc.eot_token == 100257
    assert no_network == []


def test_course_encoding_offline(no_network):
    enc = tk.get_encoding("course")
    assert enc.name == "course"
    assert enc.n_vocab == tk.COURSE_VOCAB_SIZE == 4096
    assert enc.eot_token == 4095
    assert enc.max_token_value == 4095
    assert no_network == []


def test_get_encoding_is_cached():
    assert tk.get_encoding("course") is tk.get_encoding("course")


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_unicode(text):
    for name in tk.ENCODING_NAMES:
        enc = tk.get_encoding(name)
        assert enc.decode(tk.encode(enc, text)) == text


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=50))
def test_round_trip_trained(small_enc, text):
    assert small_enc.decode(small_enc.encode_ordinary(text)) == text


# ---------------------------------------------------------------- files

def test_save_load_round_trip(tmp_path, small_enc, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # keep tiktoken's loader from copying into /tmp
    path = tk.save_encoding(small_enc, tmp_path / "tiny")
    assert path.suffix == ".tiktoken" and path.with_suffix(".json").exists()
    # the file is in tiktoken's own format, readable by tiktoken's loader
    import tiktoken.load
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == small_enc._mergeable_ranks
    back = tk.load_encoding(path)
    assert back.name == small_enc.name
    assert back._mergeable_ranks == small_enc._mergeable_ranks
    assert back._special_tokens == small_enc._special_tokens
    assert back._pat_str == small_enc._pat_str
    assert back.encode(SAMPLE) == small_enc.encode(SAMPLE)
    assert tk.load_encoding(path, name="renamed").name == "renamed"


def test_load_rejects_tampered_file(tmp_path, small_enc):
    path = tk.save_encoding(small_enc, tmp_path / "tiny")
    path.write_bytes(path.read_bytes() + b"IQ== 9999\n")
    with pytest.raises(ValueError, match="sha256"):
        tk.load_encoding(path)
    with pytest.raises(FileNotFoundError, match="rebuild"):
        tk.load_encoding(tmp_path / "missing")


def test_committed_course_encoding_is_what_training_gives():
    """The committed merges come from train_bpe on the corpus (slow-ish: ~10 s on a laptop)."""
    from labutils.text.corpus import load_corpus, split_corpus
    enc = tk.train_bpe(split_corpus(load_corpus())[0], 4096, name="course")
    committed = tk.get_encoding("course")
    if enc._mergeable_ranks == committed._mergeable_ranks:
        return
    # Docstrings differ a little between Python versions, which can shift a few merges.
    common = set(enc._mergeable_ranks) & set(committed._mergeable_ranks)
    assert len(common) / len(committed._mergeable_ranks) > 0.9
