"""Which model a lesson measures on this device: the CPU's small shapes, or on a GPU the largest published shape
whose 16-bit weights and the lesson's cache fit in about half its free memory.

A GPU's roofs show only on models big enough: gpt2-small reads 0.25 GB a decode step, 0.06 ms at an H200's 4.2 TB/s,
far less than launching its kernels costs, so its decode measures overhead, not bytes. A 7B model reads 13.5 GB in
bf16, a 3.2 ms floor there, and a 1,000-token prefill is 13-16 TFLOP, about 20 ms at 776 TFLOP/s: both phases are
then set by the hardware. Half the free memory leaves room for activations, the other side of a comparison (an int8
copy, a draft) and what the learner already holds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from labutils.core.devices import default_dtype, describe_device, free_memory_bytes, resolve_device
from labutils.core.dtypes import dtype_name
from labutils.core.validate import check_choice, check_count, check_number
from labutils.model.gpt import GPTConfig
from labutils.model.presets import PRESETS
from labutils.perf.roofline import kv_cache_bytes, weight_bytes

GPU_SHAPES = ("llama-2-7b", "llama-3.2-3b", "llama-3.2-1b")    # largest first: the seeds' 7B, then Llama 3.2's
MEMORY_SHARE = 0.5
LONG_PROMPT_MOST = 3072         # the longest "long prompt" a lesson asks for (long_prompt_tokens)
HOW_TO_CHOOSE = "another shape: set PRESET to any name in labutils.model.PRESETS whose weights and cache fit here"
HOW_TO_CHOOSE_OWN = ("another shape: give shape_for any name in labutils.model.PRESETS in place of the lesson's "
                     "config, or build(GPTConfig.preset(name), device, dtype)")
# Each family from small to large, for "the next larger shape" (a lesson's exercise compares two sizes).
LADDERS = (("tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"),
           ("llama-3.2-1b", "llama-3.2-3b", "llama-2-7b", "llama-2-13b", "llama-2-70b"))


@dataclass(frozen=True)
class ShapeChoice:
    """The shape a lesson measures on (its name and config), the dtype it runs in, and why, in a line a lesson prints.
    `preset` is a name in PRESETS, or, for a lesson's own CPU config, a few words that describe it."""

    preset: str
    dtype: torch.dtype
    why: str
    config: GPTConfig
    how_to_choose: str = HOW_TO_CHOOSE     # the lesson's knob: PRESET, or (for its own config) shape_for's argument

    def __str__(self) -> str:
        return f"{self.preset} in {dtype_name(self.dtype)}: {self.why}\n({self.how_to_choose})"


def shape_for(device, cpu_shape: str | GPTConfig, *, cache_tokens: int, batch: int = 1,
              share: float = MEMORY_SHARE) -> ShapeChoice:
    """The lesson's model on `device`: `cpu_shape` (a preset name, or a lesson's own GPTConfig) in fp32 off CUDA; on
    CUDA the first of GPU_SHAPES whose weights plus a cache of `batch` x `cache_tokens` tokens, in bf16 (fp16 where
    the GPU has no bf16), take at most `share` of the free memory. A GPU too small for all of them keeps `cpu_shape`,
    and says so."""
    choice = _choose(resolve_device(device), cpu_shape, cache_tokens, batch, share)
    if isinstance(cpu_shape, GPTConfig):
        return dataclasses.replace(choice, how_to_choose=HOW_TO_CHOOSE_OWN)
    return choice


def _choose(device: torch.device, cpu_shape, cache_tokens, batch, share) -> ShapeChoice:
    if isinstance(cpu_shape, GPTConfig):
        cpu_name, cpu_config = f"the lesson's {cpu_shape.n_layer}-layer, {cpu_shape.n_embd}-wide GPT", cpu_shape
    else:
        cpu_name = check_choice("cpu_shape", cpu_shape, PRESETS,
                                hint="a preset name, or a GPTConfig of the lesson's own")
        cpu_config = GPTConfig.preset(cpu_name)
    cache_tokens = check_count("cache_tokens", cache_tokens, 1)
    batch = check_count("batch", batch, 1)
    share = check_number("share", share, above=0.0, maximum=1.0, hint="the share of free memory, such as 0.5")
    if device.type != "cuda":
        return ShapeChoice(cpu_name, torch.float32, f"the course's shape on a {device.type}: small enough to "
                                                    "time in seconds there", cpu_config)
    dtype = default_dtype(device)
    sixteen = "" if dtype == torch.bfloat16 else "; fp16, because this GPU has no bf16"
    free = free_memory_bytes(device)
    where = describe_device(device)
    if free is None:
        return ShapeChoice(cpu_name, dtype, f"{where} does not say how much memory is free, so the small shape"
                                            f"{sixteen}", cpu_config)
    name = largest_fitting(free, dtype, cache_tokens, batch, share)
    if name is not None:
        weights, cache = _bytes(name, dtype, cache_tokens, batch)
        return ShapeChoice(name, dtype, (
            f"the largest of {', '.join(GPU_SHAPES)} whose weights ({weights / 1e9:.1f} GB) and cache of "
            f"{batch} x {cache_tokens:,} tokens ({cache / 1e9:.2f} GB) fit in {share:.0%} of the "
            f"{free / 1e9:.1f} GB free on {where}{sixteen}"), GPTConfig.preset(name))
    smallest = GPU_SHAPES[-1]
    need = sum(_bytes(smallest, dtype, cache_tokens, batch))
    return ShapeChoice(cpu_name, dtype, (
        f"even {smallest} needs {need / 1e9:.1f} GB, more than {share:.0%} of the {free / 1e9:.1f} GB free on "
        f"{where}, so the small shape; its decode measures overheads more than bytes{sixteen}"), cpu_config)


def long_prompt_tokens(config, most: int = LONG_PROMPT_MOST) -> int:
    """The lessons' long prompt on a shape: three quarters of its context, at most `most` tokens. 768 on the CPU's
    1,024-token shapes; 3,072 on Llama-2-7B, whose prefill of 41 TFLOP takes some 55 ms on an H200, against a
    3.2 ms decode step: long enough to matter there."""
    return min(3 * check_count("context_length", config.context_length, 1) // 4, check_count("most", most, 1))


def largest_fitting(free_bytes: float, dtype: torch.dtype, cache_tokens: int, batch: int = 1,
                    share: float = MEMORY_SHARE) -> str | None:
    """The first of GPU_SHAPES whose weights and a cache of batch x cache_tokens, in `dtype`, take at most `share` of
    `free_bytes`; None when none does. shape_for's rule, apart from the device, for arithmetic about a GPU."""
    return next((name for name in GPU_SHAPES if sum(_bytes(name, dtype, cache_tokens, batch)) <= share * free_bytes),
                None)


def _bytes(name: str, dtype: torch.dtype, cache_tokens: int, batch: int) -> tuple[int, int]:
    """(weight bytes, cache bytes) of a shape holding batch x cache_tokens tokens in `dtype`."""
    return weight_bytes(name, dtype), kv_cache_bytes(name, cache_tokens, batch, dtype)


def next_larger(preset: str) -> str:
    """The next shape up in `preset`'s family (gpt2-small -> gpt2-medium, llama-2-7b -> llama-2-13b)."""
    preset = check_choice("preset", preset, PRESETS)
    for ladder in LADDERS:
        if preset in ladder[:-1]:
            return ladder[ladder.index(preset) + 1]
    raise ValueError(f"{preset} has no larger shape in labutils.perf.shape_choice.LADDERS; choose one of "
                     f"{[name for ladder in LADDERS for name in ladder[:-1]]}")


__all__ = ["GPU_SHAPES", "HOW_TO_CHOOSE", "HOW_TO_CHOOSE_OWN", "LADDERS", "LONG_PROMPT_MOST", "MEMORY_SHARE",
           "ShapeChoice", "largest_fitting", "long_prompt_tokens", "next_larger", "shape_for"]
