"""The course's corpus as token ids, split into training and held-out parts."""
from __future__ import annotations

import torch

from labutils.text.corpus import load_docstrings
from labutils.core.validate import check_number


def encode_documents(docs, enc) -> torch.Tensor:
    """Token ids of every docstring, each followed by <|endoftext|>, as one LongTensor."""
    ids: list[int] = []
    for doc_ids in enc.encode_ordinary_batch(list(docs), num_threads=1):
        ids.extend(doc_ids)
        ids.append(enc.eot_token)
    return torch.tensor(ids, dtype=torch.long)


def course_tokens(frac: float = 0.9, enc=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, heldout) token ids of the course corpus with the course encoding.

    The split is by whole docstrings at about frac of the characters, like corpus.split_corpus,
    so no held-out docstring is seen in training.
    """
    check_number("frac", frac, above=0, below=1, hint="e.g. 0.9 keeps 90% for training")
    if enc is None:
        from labutils.text.tokenizer import get_encoding
        enc = get_encoding("course")
    docs = load_docstrings()
    cut, seen, n_train = frac * sum(len(d) for d in docs), 0, 0
    while n_train < len(docs) and seen < cut:
        seen += len(docs[n_train])
        n_train += 1
    return encode_documents(docs[:n_train], enc), encode_documents(docs[n_train:], enc)


__all__ = ['course_tokens', 'encode_documents']
