"""Streaming detokenization: token ids in one at a time, text out as soon as its UTF-8 bytes are complete."""
from __future__ import annotations

import codecs
import numbers
from collections.abc import Mapping, Set as AbstractSet
from typing import Iterable

import tiktoken

from labutils.text.tokenizer import as_encoding
from labutils.core.validate import check_count, describe


class StreamDecoder:
    """Turns a stream of token ids into text without ever printing half a character.

    A byte-level token may end in the middle of a multi-byte UTF-8 character (a Japanese character
    is 3 bytes, most emoji 4, and a token can hold any run of them). Decoding such a token alone gives
    U+FFFD. push() instead returns only the text whose bytes are complete and keeps the unfinished
    tail (at most 3 bytes, `pending`) until the next token completes it.

    Invalid bytes and a tail left unfinished at flush() become U+FFFD, exactly as enc.decode does,
    so "".join(every push) + flush() == enc.decode(ids) for any ids, and for ids that encode
    valid text the stream never holds a U+FFFD that the text lacks.
    """

    def __init__(self, enc: tiktoken.Encoding | str):
        self.enc = as_encoding(enc)
        self.reset()

    def reset(self) -> None:
        """Forget every token and any held-back bytes: ready for a new stream."""
        # Python's incremental UTF-8 decoder does the byte bookkeeping; "replace" is what tiktoken's
        # decode uses too, so both agree on invalid bytes.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids: list[int] = []

    @property
    def pending(self) -> bytes:
        """The bytes held back: the start of a character that the next token should finish."""
        return self._utf8.getstate()[0]

    def push(self, token_id: int) -> str:
        """Take one token id; return the text it completes ("" while a character is still unfinished)."""
        token_id, piece = self._token_bytes(token_id)
        text = self._utf8.decode(piece)
        self.ids.append(token_id)
        return text

    def extend(self, ids: Iterable[int]) -> str:
        """push() each id of a list in turn; return the text they complete together.

        Every id is checked before any is taken, so a bad one leaves the stream as it was.
        """
        checked = [self._token_bytes(i, f"ids[{k}]") for k, i in enumerate(_check_ids(ids))]
        self.ids.extend(i for i, _ in checked)
        return self._utf8.decode(b"".join(piece for _, piece in checked))

    def flush(self) -> str:
        """End of the stream: return the held-back tail (U+FFFD if a character never finished) and reset."""
        text = self._utf8.decode(b"", final=True)
        self.reset()
        return text

    def _token_bytes(self, token_id, name: str = "token_id") -> tuple[int, bytes]:
        """The id as a Python int and the bytes it stands for, or an error that says what to pass."""
        if not isinstance(token_id, numbers.Integral) and hasattr(token_id, "shape"):    # a tensor or an array
            raise TypeError(f"{name} must be one int, got {describe(token_id)}; pass int(t) for a single id, "
                            "or extend(t.flatten().tolist()) for several")
        token_id = check_count(name, token_id, 0, self.enc.n_vocab - 1,
                               hint=f"{self.enc.name} has ids 0..{self.enc.n_vocab - 1}; decode with the "
                                    "encoding that produced the ids")
        try:
            return token_id, self.enc.decode_single_token_bytes(token_id)
        except KeyError:     # cl100k_base leaves a few ids below n_vocab unassigned (e.g. 100256)
            raise ValueError(f"{name}={token_id} is not a token of {self.enc.name}: no bytes are assigned to "
                             "it; decode with the encoding that produced the ids") from None


def _check_ids(ids) -> list:
    """A list of ids from a list, a tuple or a 1-D tensor/array (one host copy); refuse text and 2-D batches."""
    if getattr(ids, "ndim", None) == 1:
        return ids.tolist()
    # A dict or a set iterates, but not as a sequence of ids: keys only, in no token order.
    if (isinstance(ids, (str, bytes, bytearray, Mapping, AbstractSet)) or not isinstance(ids, Iterable)
            or hasattr(ids, "shape")):
        raise TypeError(f"ids must be a list of int token ids (or a 1-D tensor), got {describe(ids)}; encode "
                        "text first with labutils.text.tokenizer.encode, and pick one row of a batch, e.g. tokens[0]")
    return list(ids)


def stream_decode(enc: tiktoken.Encoding | str, ids: Iterable[int]) -> list[str]:
    """The text a stream shows after each token, one piece per id; the last piece includes the flush.

    "".join(stream_decode(enc, ids)) == enc.decode(ids).
    """
    decoder, ids = StreamDecoder(enc), _check_ids(ids)
    decoder.extend(ids)     # checks every id up front, so an error names its index; then starts over
    decoder.reset()
    pieces = [decoder.push(i) for i in ids]
    tail = decoder.flush()
    if pieces:
        pieces[-1] += tail
    return pieces


__all__ = ["StreamDecoder", "stream_decode"]
