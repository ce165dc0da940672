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
from labutils.model.gpt import GPT, GPTConfig
from labutils.core.draw import random_ids


@dataclass
class BenchSettings:
    """What every row is measured on. quick=True shrinks every row to a smoke test (seconds, not minutes)."""

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    quick: bool = False
    rounds: int = 3          # interleaved rounds per side; each row reports medians over them

    @property
    def preset(self) -> str:
        return "bench-quick" if self.quick else "gpt2-small"


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
    """Random fp32 weights of a preset's shape: timing needs the shape, not the knowledge."""
    torch.manual_seed(0)
    if preset == "bench-quick":
        cfg = GPTConfig(vocab_size=512, context_length=160, n_layer=2, n_head=4, n_embd=64)
    else:
        cfg = GPTConfig.preset(preset)
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
    """fp32 on CPU (where the targets were set); bf16 on a GPU."""
    return torch.bfloat16 if s.device.type == "cuda" else torch.float32


def fast_model(model: GPT, s: BenchSettings) -> GPT:
    """The model as the fast loop runs it on this device: on CPU with column-major weights (fastgen.column_major_weights)."""
    from labutils.decode.fastgen import column_major_weights
    return column_major_weights(model) if s.device.type == "cpu" else model


def bench_layout(s: BenchSettings) -> str:
    return ", column-major weights" if s.device.type == "cpu" else ""


def bench_request(s: BenchSettings, vocab: int) -> tuple[torch.Tensor, int]:
    prompt_len, new = (32, 8) if s.quick else (PROMPT_LEN, NEW_TOKENS)
    return random_ids(vocab, (1, prompt_len), 0, s.device), new
