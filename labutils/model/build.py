"""Random weights built where they will run: on the device, in its 16-bit dtype, with no full-precision copy first.

`GPT(config).to(device, dtype)` first makes every weight in fp32 on the CPU: 27 GB for a 7B model, more than most
GPUs hold and slow to fill. `build(config, device, dtype, seed)` lays the model out on the meta device (shapes, no
memory), casts it there, allocates it once on the device (`to_empty`) and fills it with GPT's own initialisation
from a seeded generator on that device. A 7B model in bf16 is then 13.5 GB written once on the GPU, in seconds.
Timing needs the shapes, not trained knowledge, so random weights measure the same bytes and FLOPs as real ones.
"""
from __future__ import annotations

import torch

from labutils.core import fake_cuda
from labutils.core.validate import check_device, check_seed, parse_dtype
from labutils.model.gpt import GPT, GPTConfig, check_buildable


def build(config: GPTConfig, device="cpu", dtype=torch.float32, seed: int = 0) -> GPT:
    """A GPT of `config` with seeded random weights, allocated once on `device` in `dtype`, in eval mode.

    Refuses, before allocating, a model whose weights would not fit the device's free memory (with both figures).
    The same seed gives the same weights on the same device; devices draw from their own generators.
    """
    device = check_device("device", device)
    dtype = parse_dtype("dtype", dtype)
    seed = check_seed(seed)
    check_buildable(config, device, dtype)
    with torch.device("meta"):
        model = GPT(config).to(dtype)          # shapes only: nothing allocated, nothing initialised
    model = model.to_empty(device=device).tie_weights()   # one allocation, in the final dtype, on the device
    generator = fake_cuda.generator(device, seed)          # on the device (emulated CUDA's own on emulated CUDA)
    return model.init_weights(generator).eval()


__all__ = ["build"]
