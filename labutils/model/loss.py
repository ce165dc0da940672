"""How well a model predicts held-out tokens, and the unigram baseline it must beat."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from labutils.model.gpt import GPT


def unigram_loss(train_tokens: torch.Tensor, heldout_tokens: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of heldout under train-set token frequencies: the no-context baseline.

    Add-one smoothing gives tokens never seen in training a small, finite probability.
    """
    counts = torch.bincount(train_tokens, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[heldout_tokens].mean())


@torch.no_grad()
def heldout_loss(model: GPT, tokens: torch.Tensor, seq_len: int | None = None,
                 batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats/token) over tokens, cut into non-overlapping windows."""
    seq_len = seq_len or model.config.context_length
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(f"need more than {seq_len} tokens to measure a loss, got {len(tokens)}; "
                         "pass a longer slice or a smaller seq_len")
    x = tokens[:n * seq_len].view(n, seq_len)
    y = tokens[1:n * seq_len + 1].view(n, seq_len)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, n, batch_size):
        xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
        logits = model(xb, check=False)
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), reduction="sum"))
    model.train(was_training)
    return total / (n * seq_len)


__all__ = ['heldout_loss', 'unigram_loss']
