"""Seeded random inputs: drawn on the host with a CPU generator, then moved to the device.

A torch.Generator belongs to one device, and a draw onto CUDA from a CPU generator raises there ("Expected a 'cuda'
device type for generator but found 'cpu'"), never on a CPU. Drawing on the host and moving the result cannot make
that mistake, and a seed gives the same ids on every device, so a GPU run and a CPU run start from the same prompt.
"""
from __future__ import annotations

import torch


def random_ids(vocab_size: int, shape: tuple[int, ...], seed: int = 0,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Token ids uniform in [0, vocab_size), long, of `shape`, the same for a seed on every device."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, tuple(shape), generator=g).to(device)
