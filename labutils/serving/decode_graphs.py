"""Decode steps replayed as CUDA graphs, as vLLM and nano-vllm run them: one graph per (batch, table width) bucket.

An eager step queues every op from Python. For Llama-2-7B that is some 1,900 ops a step, about 26 ms of host time at
the H200 run's 13.8 us an op (docs/gpu/predictions.md), eight times the 3.2 ms its weights take to read: the engine's
steps would measure the host, and a long prefill would cost only a few of them. A graph replays all of a step's
kernels from one call. A graph needs fixed shapes and addresses, so a step whose every row decodes one token is
padded up to a bucket: the batch to a power of two, each row's block table to a power-of-two width. Padding rows copy
the first row (the same token, position, slot and table), so their writes put the same values into the same slots
and change nothing. Steps that hold a prefill chunk run eager: their shapes vary, and their FLOPs dwarf the launches.

`capture=False` runs the same static-buffer step without recording it (a CPU, tests), so what the graph replays is
checked token for token against the eager step anywhere.
"""
from __future__ import annotations

import warnings

import torch

from labutils.core import emulated_cuda, fake_cuda
from labutils.model.kernels.attention import attention
from labutils.model.kernels.paged import gather_blocks, paged_mask
from labutils.serving.paged_cache import PagedKVCache, slots_of


def bucket(n: int) -> int:
    """The power of two at or above n: graphs for 1, 2, 4, ... rows (or blocks) serve every size between."""
    return 1 << (n - 1).bit_length()


def graphs_unavailable(device: torch.device) -> str | None:
    """Why this device replays no CUDA graphs (a reason to print), or None where it does."""
    if device.type != "cuda":
        return f"CUDA graphs need an NVIDIA GPU; the model is on {device.type}"
    if fake_cuda.active() or emulated_cuda.active():
        return "CUDA is faked or emulated here, which has no graphs"
    return None


class StaticDecodeBatch:
    """A model.cache.Cache over fixed buffers: `rows` decode rows, each table `width` blocks wide, in one group.

    set() fills the buffers for a step (one host-to-device copy); begin() and attend() read only the buffers and the
    pool, so a graph recorded over them replays any step of the same bucket."""

    def __init__(self, cache: PagedKVCache, rows: int, width: int):
        self.cache, self.rows, self.width = cache, rows, width
        self.index = torch.zeros(3 * rows + rows * width, dtype=torch.long, device=cache.device)
        self.ids = torch.zeros(1, rows, dtype=torch.long, device=cache.device)
        self.positions, self._write = self.index[:rows], self.index[rows:2 * rows]
        self.tables = self.index[3 * rows:].view(rows, width)

    def set(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> None:
        """This step's rows (at most `rows`; the rest copy the first), in one copy to the device."""
        pad = self.rows - len(tokens)
        tokens, positions, tables = tokens + tokens[:1] * pad, positions + positions[:1] * pad, tables + tables[:1] * pad
        bs = self.cache.block_size
        slots = [slots_of(t, p, 1, bs)[0] for t, p in zip(tables, positions)]
        padded = [b for t in tables for b in t + [t[-1]] * (self.width - len(t))]
        host = torch.tensor(positions + slots + tokens + padded)
        if self.cache.device.type == "cuda" and fake_cuda.pin_memory(True):
            host = host.pin_memory()
        self.index.copy_(host, non_blocking=True)
        self.ids[0].copy_(self.index[2 * self.rows:3 * self.rows])

    def check(self, model, ids) -> None:                 # the engine's forwards skip checks (check=False)
        pass

    def begin(self, n_new: int) -> torch.Tensor:
        self.mask = paged_mask(self.positions[:, None], self.width * self.cache.block_size)   # inside the graph
        return self.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """As PackedBatch.attend for one decode group: write k, v at the rows' slots, attend over their tables."""
        k_pool, v_pool, bs = self.cache.k[layer], self.cache.v[layer], self.cache.block_size
        for pool, new in ((k_pool, k), (v_pool, v)):
            pool.index_copy_(0, self._write, new[0].transpose(0, 1))
        qd = q[0].transpose(0, 1)[:, :, None]                                    # [rows, n_head, 1, head_dim]
        kd, vd = gather_blocks(k_pool, self.tables, bs), gather_blocks(v_pool, self.tables, bs)
        return attention(qd, kd, vd, impl=impl, mask=self.mask)[:, :, 0].transpose(0, 1)[None]

    def advance(self, n: int) -> None:
        pass


class DecodeGraphs:
    """One recorded decode step per bucket, made the first time a step of that bucket comes; run() replays it.

    A pool that grows (PagedKVCache.ensure) moves its tensors, so every graph recorded over the old ones is dropped
    and recorded again when next needed. Capture that fails turns graphs off for good, with a warning that says why.
    """

    def __init__(self, model, cache: PagedKVCache, capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self._steps: dict[tuple[int, int], tuple[StaticDecodeBatch, object, dict]] = {}
        self._pool_at = None
        self.failed: str | None = None
        self.recorded = 0                                  # graphs recorded so far (recording costs a few steps)

    def run(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        """Logits [rows, vocab] of one decode step, or None where graphs are off (the caller then runs eager)."""
        if self.failed:
            return None
        at = (self.cache.k[0].data_ptr(), self.cache.v[-1].data_ptr())
        if at != self._pool_at:                            # the pool moved: every graph points at the old one
            self._steps.clear()
            self._pool_at = at
        key = (bucket(len(tokens)), bucket(max(len(t) for t in tables)))
        if key not in self._steps:
            view = StaticDecodeBatch(self.cache, *key)
            view.set(tokens, positions, tables)
            out = {}

            def step():
                out["logits"] = self.model(view.ids, view, check=False)[0]
            replay = step
            if self.capture:
                from labutils.decode.fastgen import capture_graph
                try:
                    replay = capture_graph(step, self.cache.device, warm_up=lambda fn: [fn() for _ in range(2)])
                except Exception as err:     # keep serving, eager, and say why
                    self.failed = f"CUDA graph capture failed ({type(err).__name__}: {str(err)[:200]}); decoding eager"
                    warnings.warn(f"serving: {self.failed}", RuntimeWarning, stacklevel=3)
                    return None
                self.recorded += 1
            self._steps[key] = (view, replay, out)
        view, replay, out = self._steps[key]
        view.set(tokens, positions, tables)
        replay()
        return out["logits"][:len(tokens)]


__all__ = ["DecodeGraphs", "StaticDecodeBatch", "bucket", "graphs_unavailable"]
