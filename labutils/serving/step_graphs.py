"""Serving steps replayed as CUDA graphs, as vLLM and nano-vllm replay decode: one graph per bucket of shapes.

An eager step queues every op from Python. For Llama-2-7B that is some 1,500 ops a step, about 20 ms of host time at
the H200 run's 13.3 us an op (docs/gpu/predictions.md), six times the 3.2 ms its weights take to read: the engine's
steps would measure the host, and a prefill would cost only a few of them. A graph replays all of a step's kernels
from one call. It needs fixed shapes and addresses, so a step is padded up to a bucket (powers of two): its decode
rows (one token each) and their block tables' width, and at most one prefill chunk, its tokens and its table's width.
Padding copies a real token (the same id, position, slot and table), so a padding write puts the same values into
the same slot and changes nothing, and its attention is never read. A step with two or more chunks, or one longer
than MOST_CHUNK tokens, runs eager: its shapes vary more, and a long chunk's FLOPs dwarf its launches anyway.

`capture=False` runs the same fixed-buffer step without recording it (a CPU, tests), so what a graph replays is
checked token for token against the eager step anywhere.
"""
from __future__ import annotations

import time
import warnings

import torch

from labutils.core import fake_cuda
from labutils.model.kernels.attention import attention
from labutils.model.kernels.paged import gather_blocks, paged_mask
from labutils.serving.paged_cache import PagedKVCache, side_by_side, slots_of

MOST_CHUNK = 512        # a longer prefill chunk runs eager: 512 tokens of a 7B model are 7 TFLOP, 9 ms on an H200


def bucket(n: int) -> int:
    """The power of two at or above n (0 stays 0): graphs for 1, 2, 4, ... serve every size between."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


class StaticStep:
    """A model.cache.Cache over fixed buffers: `rows` decode rows with tables `width` blocks wide, then a prefill chunk
    of `chunk` tokens with a table `chunk_width` blocks wide (0 and 0 for none).

    set() fills the buffers for a step (one host-to-device copy); begin() and attend() read only the buffers and the
    pool, so a graph recorded over them replays any step of the same bucket."""

    def __init__(self, cache: PagedKVCache, rows: int, width: int, chunk: int, chunk_width: int):
        self.cache, self.rows, self.width, self.chunk, self.chunk_width = cache, rows, width, chunk, chunk_width
        n = rows + chunk
        self.index = torch.zeros(3 * n + rows * width + chunk_width + rows + bool(chunk), dtype=torch.long,
                                 device=cache.device)
        self.positions, self._write, self.ids = self.index[:n], self.index[n:2 * n], self.index[2 * n:3 * n][None]
        at = 3 * n
        self.tables = self.index[at:at + rows * width].view(rows, width)
        self.chunk_table = self.index[at + rows * width:at + rows * width + chunk_width][None]
        self.logits_at = self.index[at + rows * width + chunk_width:]          # decode rows, then the chunk's last

    def set(self, decode: list[tuple[int, int, list[int]]], chunk: tuple[list[int], int, list[int]] | None) -> None:
        """This step: decode rows (token, position, table) and the chunk (tokens, first position, table) or None."""
        bs = self.cache.block_size
        decode = decode + decode[:1] * (self.rows - len(decode))
        tokens = [t for t, _, _ in decode]
        positions = [p for _, p, _ in decode]
        slots = [slots_of(table, p, 1, bs)[0] for _, p, table in decode]
        padded = [b for _, _, t in decode for b in t + [t[-1]] * (self.width - len(t))]
        chunk_table = []
        if chunk is not None:
            ids, start, table = chunk
            n = len(ids)
            ids, chunk_pos = ids + ids[-1:] * (self.chunk - n), list(range(start, start + n))
            chunk_pos += chunk_pos[-1:] * (self.chunk - n)
            tokens, positions = tokens + ids, positions + chunk_pos
            slots += [slots_of(table, p, 1, bs)[0] for p in chunk_pos]
            used = table[:-(-(start + n) // bs)]
            chunk_table = used + used[-1:] * (self.chunk_width - len(used))
        ends = list(range(self.rows)) + ([self.rows + len(chunk[0]) - 1] if chunk is not None else [])
        host = torch.tensor(positions + slots + tokens + padded + chunk_table + ends)
        if self.cache.device.type == "cuda" and fake_cuda.pin_memory(True):
            host = host.pin_memory()
        self.index.copy_(host, non_blocking=True)

    def check(self, model, ids) -> None:                 # the engine's forwards skip checks (check=False)
        pass

    def begin(self, n_new: int) -> torch.Tensor:
        bs, r = self.cache.block_size, self.rows        # the masks are made inside the graph, from the positions
        self.mask = paged_mask(self.positions[:r, None], self.width * bs) if r else None
        self.chunk_mask = paged_mask(self.positions[None, r:], self.chunk_width * bs) if self.chunk else None
        return self.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """As PackedBatch.attend: write every token's k, v into its slot, then the decode rows attend over their
        tables in one call and the chunk over its own table, each query seeing the keys at or before its position."""
        k_pool, v_pool, bs, r = self.cache.k[layer], self.cache.v[layer], self.cache.block_size, self.rows
        for pool, new in ((k_pool, k), (v_pool, v)):
            pool.index_copy_(0, self._write, new[0].transpose(0, 1))
        out = []
        if r:
            qd = q[0, :, :r].transpose(0, 1)[:, :, None]                          # [rows, n_head, 1, head_dim]
            kd, vd = gather_blocks(k_pool, self.tables, bs), gather_blocks(v_pool, self.tables, bs)
            out.append(attention(qd, kd, vd, impl=impl, mask=self.mask)[:, :, 0].transpose(0, 1))
        if self.chunk:
            kc, vc = gather_blocks(k_pool, self.chunk_table, bs), gather_blocks(v_pool, self.chunk_table, bs)
            out.append(attention(q[:, :, r:], kc, vc, impl=impl, mask=self.chunk_mask)[0])
        return side_by_side(out)

    def advance(self, n: int) -> None:
        pass


class StepGraphs:
    """One recorded step per bucket, made the first time a step of that bucket comes; run() replays it.

    A pool that grows (PagedKVCache.ensure) moves its tensors, so every graph recorded over the old ones is dropped
    and recorded again when next needed. Capture that fails turns graphs off for good, with a warning that says why.
    Recording is setup, which vLLM does before it serves: its seconds (`record_s`) are kept off the engine's clock.
    """

    def __init__(self, model, cache: PagedKVCache, capture: bool = True):
        self.model, self.cache, self.capture = model, cache, capture
        self._steps: dict[tuple[int, int, int, int], tuple[StaticStep, object, dict]] = {}
        self._pool_at = None
        self.failed: str | None = None
        self.recorded = 0                                  # graphs recorded so far (recording costs a few steps)
        self.record_s = 0.0                                # seconds spent recording them (setup, not serving)
        self.buckets: set[tuple[int, int, int, int]] = set()     # every bucket a step replayed in

    @staticmethod
    def fits(chunks: list) -> bool:
        """Whether a step holding these prefill chunks (tokens, first position, table) may replay: at most one, of
        at most MOST_CHUNK tokens; its decode rows always may."""
        return len(chunks) <= 1 and all(len(ids) <= MOST_CHUNK for ids, _, _ in chunks)

    def run(self, decode: list[tuple[int, int, list[int]]],
            chunk: tuple[list[int], int, list[int]] | None) -> torch.Tensor | None:
        """Logits [decode rows (+ 1 for the chunk's last token), vocab], or None where graphs are off (run eager)."""
        if self.failed:
            return None
        at = (self.cache.k[0].data_ptr(), self.cache.v[-1].data_ptr())
        if at != self._pool_at:                            # the pool moved: every graph points at the old one
            self._steps.clear()
            self._pool_at = at
        bs = self.cache.block_size
        key = (bucket(len(decode)), bucket(max((len(t) for _, _, t in decode), default=0)),
               bucket(len(chunk[0])) if chunk else 0, bucket(-(-(chunk[1] + len(chunk[0])) // bs)) if chunk else 0)
        if key not in self._steps:
            view = StaticStep(self.cache, *key)
            view.set(decode, chunk)
            out = {}

            def step():
                out["logits"] = self.model(view.ids, view, check=False, logits_at=view.logits_at)[0]
            replay = step
            if self.capture:
                from labutils.decode.fastgen import capture_graph
                t0 = time.perf_counter()
                try:
                    replay = capture_graph(step, self.cache.device, warm_up=lambda fn: [fn() for _ in range(2)])
                except Exception as err:     # keep serving, eager, and say why
                    self.failed = f"CUDA graph capture failed ({type(err).__name__}: {str(err)[:200]}); running eager"
                    warnings.warn(f"serving: {self.failed}", RuntimeWarning, stacklevel=3)
                    return None
                finally:
                    self.record_s += time.perf_counter() - t0
                self.recorded += 1
            self._steps[key] = (view, replay, out)
        view, replay, out = self._steps[key]
        self.buckets.add(key)
        view.set(decode, chunk)
        replay()
        logits = out["logits"]
        return torch.cat([logits[:len(decode)], logits[key[0]:]]) if chunk else logits[:len(decode)]


__all__ = ["MOST_CHUNK", "StaticStep", "StepGraphs", "bucket"]
