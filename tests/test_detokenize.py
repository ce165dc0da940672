"""Streaming detokenization: the stream joins to enc.decode, holds back only unfinished characters, refuses bad ids."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labutils.text.detokenize import StreamDecoder, stream_decode
from labutils.text.tokenizer import ENCODING_NAMES, encode, get_encoding

REPLACEMENT = "\ufffd"
# Valid Unicode (no surrogates) without U+FFFD itself, weighted towards multi-byte characters.
CHARS = st.characters(codec="utf-8", blacklist_characters=REPLACEMENT)
MULTIBYTE = st.sampled_from("éßü猫が好き東京列車🐈🦙🪐⬛\u200d")
TEXT = st.text(st.one_of(CHARS, MULTIBYTE), max_size=40)


@settings(max_examples=150, deadline=None)
@given(TEXT, st.sampled_from(ENCODING_NAMES))
def test_stream_of_valid_text_is_the_text_and_never_shows_a_replacement(text, name):
    enc = get_encoding(name)
    ids = encode(enc, text)
    pieces = stream_decode(enc, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == enc.decode(ids) == text
    assert not any(REPLACEMENT in p for p in pieces)


@settings(max_examples=100, deadline=None)
@given(TEXT, st.sampled_from(ENCODING_NAMES))
def test_only_an_unfinished_character_is_held_back(text, name):
    """After each token: text out + bytes held == every byte so far, and what is held cannot be decoded yet."""
    enc = get_encoding(name)
    decoder, out, seen = StreamDecoder(enc), "", b""
    for tid in encode(enc, text):
        out += decoder.push(tid)
        seen += enc.decode_single_token_bytes(tid)
        assert out.encode("utf-8") + decoder.pending == seen
        assert len(decoder.pending) <= 3
        if decoder.pending:
            with pytest.raises(UnicodeDecodeError):
                decoder.pending.decode("utf-8")
    assert decoder.flush() == "" and decoder.pending == b""


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, get_encoding("course").n_vocab - 1), max_size=30))
def test_any_ids_join_to_enc_decode(ids):
    """Ids a model samples need not spell valid UTF-8; the stream still agrees with enc.decode, U+FFFD and all."""
    enc = get_encoding("course")
    assert "".join(stream_decode(enc, ids)) == enc.decode(ids)
    decoder = StreamDecoder(enc)
    assert decoder.extend(ids) + decoder.flush() == enc.decode(ids)


def test_per_token_decode_breaks_a_character_the_stream_does_not():
    enc = get_encoding("cl100k_base")
    ids = encode(enc, "猫 🐈")
    assert any(REPLACEMENT in enc.decode([i]) for i in ids)      # the example really splits a character
    pieces = stream_decode(enc, ids)
    assert "".join(pieces) == "猫 🐈"
    assert "" in pieces                                            # some tokens had to wait for the next one


def test_flush_replaces_an_unfinished_tail_and_starts_over():
    enc = get_encoding("course")
    cat = encode(enc, "猫")                      # three byte tokens in the course encoding
    decoder = StreamDecoder(enc)
    assert decoder.extend(cat[:2]) == "" and len(decoder.pending) == 2
    assert decoder.flush() == REPLACEMENT == enc.decode(cat[:2])
    assert decoder.pending == b"" and decoder.ids == []
    assert decoder.extend(cat) == "猫" and decoder.ids == cat


def test_accepts_numpy_ints_and_1d_tensors():
    import numpy as np
    enc = get_encoding("course")
    ids = encode(enc, "東京 cache")
    assert "".join(stream_decode(enc, torch.tensor(ids))) == "東京 cache"
    assert StreamDecoder("course").push(np.int64(ids[-1])) == enc.decode([ids[-1]])


@pytest.mark.parametrize("bad, error, words", [
    (-1, ValueError, "token_id must be >= 0"),
    (4096, ValueError, "ids 0..4095"),
    (3.0, TypeError, "int(3.0)"),
    (True, TypeError, "token_id must be an int"),
    ("a", TypeError, "token_id must be an int"),
    (torch.tensor(3), TypeError, "int(t)"),
])
def test_push_refuses_bad_ids(bad, error, words):
    decoder = StreamDecoder("course")
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        decoder.push(bad)
    assert decoder.ids == []


def test_unassigned_id_is_named():
    assert 100256 < get_encoding("cl100k_base").n_vocab       # below n_vocab, yet no token has it
    with pytest.raises(ValueError, match="100256 is not a token of cl100k_base"):
        StreamDecoder("cl100k_base").push(100256)


def test_bad_id_lists_and_encodings():
    with pytest.raises(TypeError, match="encode text first"):
        stream_decode("course", "hello")
    with pytest.raises(TypeError, match="one row of a batch"):
        stream_decode("course", torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"ids\[2\] must be an int"):
        stream_decode("course", [1, 2, "x"])
    with pytest.raises(TypeError, match="tiktoken.Encoding or an encoding name"):
        StreamDecoder(42)
    with pytest.raises(ValueError, match="unknown encoding"):
        StreamDecoder("gpt2")


def test_extend_takes_nothing_when_one_id_is_bad():
    decoder = StreamDecoder("course")
    decoder.push(231)                           # the first byte of 猫
    with pytest.raises(ValueError, match=r"ids\[1\]"):
        decoder.extend([140, 99999])
    assert decoder.pending == b"\xe7" and decoder.ids == [231]
