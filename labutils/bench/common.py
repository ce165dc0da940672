"""What every bench row shares: its settings, its result row, the model it times and interleaved timing."""
from __future__ import annotations

import dataclasses
import functools
import operator
import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from labutils.perf import timing
from labutils.perf.shape_choice import shape_for
from labutils.model.build import build
from labutils.model.gpt import GPT, GPTConfig
from labutils.core.devices import default_dtype
from labutils.core.draw import random_ids


@dataclass
class BenchSettings:
    """What every row is measured on. quick=True shrinks every row to a smoke test (seconds, not minutes)."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    rounds: int = 3          # interleaved rounds per side; each row reports medians over them

    @functools.cached_property
    def preset(self) -> str:
        """The shape the rows time: a toy for --quick; else the lessons' shape for this device (shape_for):
        gpt2-small on a CPU, on a GPU the largest Llama shape whose weights and a MAX_CONTEXT cache fit half its
        free memory (a 7-8B shape's bytes and FLOPs, not its launches, set the times). Chosen once, before the
        rows hold any memory."""
        if self.quick:
            return "bench-quick"
        return shape_for(self.device, "gpt2-small", cache_tokens=MAX_CONTEXT).preset


# The longest context a row reads (the long side of TPOT, chunked prefill's long prompt): a multi-thousand-token
# prompt, while Llama 3.2's 131,072 positions would be a 15 GB cache and minutes of prefill.
MAX_CONTEXT = 4096


_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


@dataclass
class BenchRow:
    """One line of the table: a measured ratio, its target, and the two numbers behind it."""

    name: str
    ratio: float
    target: str                 # ">= 3", "<= 1.3", or strict: "> 1"
    setup: str                  # shape, dtype, device, lengths: enough to reproduce the row
    detail: str                 # the two measured sides
    status: str = ""            # PASS / FAIL / ERROR, or SKIP (cannot run here; detail says why)
    machine: str = "quiet"      # "busy" when other processes used the CPU while the row ran (labutils.perf.quiet)
    seconds: float = 0.0        # how long the row took, set by the runner

    def __post_init__(self):
        if not self.status:
            op, value = self.target.split()
            self.status = "PASS" if _OPS[op](self.ratio, float(value)) else "FAIL"


@functools.lru_cache(maxsize=4)
def bench_model(preset: str, device: str) -> GPT:
    """Random weights of a preset's shape: timing needs the shape, not the knowledge. fp32 on a CPU; on CUDA in the
    GPU's 16-bit dtype, built there (model.build): a 7B model in fp32 would be 27 GB before any cast."""
    if preset == "bench-quick":
        cfg = GPTConfig(vocab_size=512, context_length=160, n_layer=2, n_head=4, n_embd=64)
    else:
        cfg = GPTConfig.preset(preset)
    if torch.device(device).type == "cuda":
        return build(cfg, device, default_dtype(device), seed=0)
    torch.manual_seed(0)
    return GPT(cfg).to(device).eval()


def interleaved(fns: dict[str, Callable[[], object]], s: BenchSettings, repeats: int = 1) -> dict[str, float]:
    """Median seconds of each fn, timed in alternation (A B A B ...) so drifting load hits every side."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(s.rounds):
        for name, fn in fns.items():
            samples[name] += timing.time_fn(fn, device=s.device, warmup=0, repeats=repeats).samples_s
    return {name: statistics.median(v) for name, v in samples.items()}


PROMPT_LEN, NEW_TOKENS = 128, 64      # the fast-loop rows' request: batch 1, a 128-token prompt


def bench_dtype(s: BenchSettings) -> torch.dtype:
    """fp32 on CPU (where the targets were set); on a GPU its 16-bit dtype (bf16, or fp16 before Ampere)."""
    return default_dtype(s.device)


def fast_model(model: GPT, s: BenchSettings) -> GPT:
    """The model as the fast loop runs it on this device: on CPU with column-major weights (prepack.column_major_weights)."""
    from labutils.decode.prepack import column_major_weights
    return column_major_weights(model) if s.device.type == "cpu" else model


def bench_layout(s: BenchSettings) -> str:
    return ", column-major weights" if s.device.type == "cpu" else ""


def bench_request(s: BenchSettings, vocab: int) -> tuple[torch.Tensor, int]:
    prompt_len, new = (32, 8) if s.quick else (PROMPT_LEN, NEW_TOKENS)
    return random_ids(vocab, (1, prompt_len), 0, s.device), new
