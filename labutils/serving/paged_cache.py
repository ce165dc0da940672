"""The paged KV cache's storage (a pool of blocks per layer) and the per-forward view GPT.forward reads it through."""
from __future__ import annotations

from typing import NamedTuple

import torch

from labutils.core import fake_cuda
from labutils.model.kernels.attention import attention
from labutils.model.kernels.paged import gather_blocks, paged_mask
from labutils.perf.roofline import kv_bytes_per_token
from labutils.core.validate import check_count, check_token_ids
from labutils.serving.workload import PromptKV


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks: per layer, [n_blocks * block_size, n_kv_head, head_dim].

    Slot `block * block_size + offset` holds one position of one request; which request and which
    position is the block tables' business (serving.blocks). The storage starts empty and doubles (up
    to n_blocks) as higher block ids come into use, so memory follows the load rather than the worst
    case. Each layer has its own tensors and they grow one at a time: growing one [n_layer, ...] tensor
    would hold the old pool and the new one at once (1.5 times the final pool at the last doubling),
    where this needs one layer's worth beyond it.
    """

    def __init__(self, config, block_size: int, n_blocks: int, device=None, dtype=torch.float32):
        check_count("block_size", block_size, 1)
        check_count("n_blocks", n_blocks, 1)
        self.config, self.block_size, self.n_blocks = config, block_size, n_blocks
        self.block_bytes = kv_bytes_per_token(config, dtype) * block_size   # K and V, every layer
        shape = (0, config.n_kv_head, config.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        self.device = self.k[0].device

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (keys and values, every layer)."""
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def blocks_allocated(self) -> int:
        """Blocks every layer's storage has room for now."""
        return min(t.shape[0] for t in self.k + self.v) // self.block_size

    def ensure(self, n_blocks: int) -> None:
        """Make room for block ids below n_blocks, doubling the storage so growth is rare."""
        have = self.blocks_allocated
        if n_blocks <= have:
            return
        if n_blocks > self.n_blocks:
            raise ValueError(f"block id {n_blocks - 1} is beyond the pool's {self.n_blocks} blocks")
        new = min(self.n_blocks, max(n_blocks, 2 * have))
        try:
            for pools in (self.k, self.v):
                for layer, old in enumerate(pools):
                    if old.shape[0] >= new * self.block_size:
                        continue                  # grown already, before an out-of-memory stopped the rest
                    grown = old.new_zeros((new * self.block_size, *old.shape[1:]))
                    grown[:old.shape[0]] = old
                    pools[layer] = grown          # the old layer is freed here, before the next one grows
        except (MemoryError, RuntimeError) as err:
            from labutils.core.devices import is_oom
            if not is_oom(err):
                raise
            raise MemoryError(f"a paged KV cache of {new:,} blocks ({new * self.block_bytes / 2**20:,.0f} MiB) "
                              f"does not fit on {self.device}; give the Engine a smaller kv_limit_bytes "
                              "or fewer batch slots") from None

    def _slots(self, table: list[int], n: int) -> torch.Tensor:
        return torch.tensor(slots_of(table, 0, n, self.block_size), device=self.device)

    def read(self, table: list[int], n: int) -> PromptKV:
        """A copy of one request's keys and values at positions 0 .. n-1: [n_layer, n, n_kv_head, head_dim] each.
        What a prefill worker hands a decode worker (serving.disagg)."""
        slots = self._slots(table, n)
        return PromptKV(torch.stack([pool[slots] for pool in self.k]), torch.stack([pool[slots] for pool in self.v]))

    def write(self, table: list[int], kv: PromptKV) -> None:
        """Store keys and values read() gave (from any cache of the same model) at positions 0 .. n-1 of `table`."""
        k, v = kv.keys, kv.values
        expected = (len(self.k), k.shape[1], *self.k[0].shape[1:])
        if tuple(k.shape) != expected or k.shape != v.shape:
            raise ValueError(f"handed-over keys and values of shape {tuple(k.shape)} and {tuple(v.shape)} do not fit "
                             f"this cache's {expected}: they come from another model")
        slots = self._slots(table, k.shape[1])
        for layer in range(len(self.k)):
            self.k[layer][slots] = k[layer].to(self.k[layer])
            self.v[layer][slots] = v[layer].to(self.v[layer])

    def batch(self, rows: list["Row"]) -> "PackedBatch":
        """The view one forward pass uses: every row's new tokens, laid end to end."""
        return PackedBatch(self, rows)


def slots_of(table: list[int], start: int, n: int, block_size: int) -> list[int]:
    """The pool slots of positions start .. start + n - 1 of a request with block table `table`."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


class Row(NamedTuple):
    """One request's share of a packed forward: positions start .. start + n - 1, read and written through table."""

    table: list[int]
    start: int
    n: int


class DecodeGroup(NamedTuple):
    """Decode rows `rows` of a packed batch, attending in one call over their tables padded to the longest, on the
    device: `tables` [rows, width] block ids, `mask` [rows, 1, 1, width * block_size] each row's written positions."""

    rows: range
    tables: torch.Tensor
    mask: torch.Tensor


def similar_lengths(widths: list[int]) -> list[range]:
    """Consecutive rows whose tables are at most twice the first's: one long table among short ones would otherwise
    make every row of its group gather as many blocks as it has. `widths` come shortest first, so groups are few."""
    groups: list[range] = []
    for i, w in enumerate(widths):
        if groups and widths[groups[-1].start] <= w <= 2 * widths[groups[-1].start]:
            groups[-1] = range(groups[-1].start, i + 1)
        else:
            groups.append(range(i, i + 1))
    return groups


def side_by_side(parts: list[torch.Tensor]) -> torch.Tensor:
    """The attention outputs of a packed batch's groups and chunks, [n_head, tokens, head_dim] each, side by side
    as [1, n_head, N, head_dim]. One part (a step of decode rows alone, or one prompt) is returned as a view: a
    cat would copy it, and the layer's reshape after it would copy it back, two kernels a layer on a GPU."""
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))[None]


class PrefillChunk(NamedTuple):
    """A prefill row of a packed batch, attending alone: positions start .. start + n - 1, over `table`, its
    blocks up to its last position (on the device)."""

    start: int
    n: int
    table: torch.Tensor


class PackedBatch:
    """One forward's view of the pool: a model.cache.Cache, the interface GPT.forward expects.

    Packed, not padded, as vLLM lays out a step: every scheduled token of every request sits end to end in one
    flat batch [1, N], so the linear layers compute exactly N token rows. Each token keeps its own position
    (`begin` returns them, [N]). Attention cannot be one call over the flat batch, since each request may see only
    its own keys: `attend` writes the new keys and values into their slots, then
    - the decode rows (one token each, first in the batch) attend in groups of similar length: one batched call per
      group over its rows' blocks gathered side by side (kernels.paged), a mask hiding each row's later positions.
      A group's rows are padded to its longest table, so a group never holds a table more than twice another's:
      one long request among short ones would otherwise make every row gather as many blocks as it has. The
      runner (serving.runner) orders the decode rows by table length, so groups are few;
    - each prefill chunk attends alone, over its own blocks up to its last position, causal by offset.
    """

    def __init__(self, cache: PagedKVCache, rows: list[Row]):
        if not rows or any(not r.table or r.n < 1 for r in rows):
            raise ValueError("a packed batch needs one non-empty block table and at least one token per row")
        bs = cache.block_size
        for r in rows:
            if r.start < 0 or r.start + r.n > len(r.table) * bs:
                raise ValueError(f"positions {r.start} .. {r.start + r.n - 1} do not fit a block table of "
                                 f"{len(r.table)} blocks")
        self.cache = cache
        self.n_decode = next((i for i, r in enumerate(rows) if r.n > 1), len(rows))
        if any(r.n == 1 for r in rows[self.n_decode:]):
            raise ValueError("a packed batch takes its one-token rows first, then the longer ones")
        # Every index this forward needs, built on the host and sent in one copy (pinned, asynchronous on a GPU):
        # per token its position and its slot; the decode rows' tables padded with one of their own blocks (a valid
        # slot to read, always masked out); each prefill chunk's table up to its last position.
        positions = [p for r in rows for p in range(r.start, r.start + r.n)]
        slots = [s for r in rows for s in slots_of(r.table, r.start, r.n, bs)]
        groups = similar_lengths([len(r.table) for r in rows[:self.n_decode]])
        widths = [max(len(rows[i].table) for i in g) for g in groups]
        padded = [b for g, width in zip(groups, widths) for r in rows[g.start:g.stop]
                  for b in r.table + [r.table[-1]] * (width - len(r.table))]
        chunk_tables = [r.table[:-(-(r.start + r.n) // bs)] for r in rows[self.n_decode:]]
        host = torch.tensor(positions + slots + padded + [b for t in chunk_tables for b in t])
        device = cache.device
        if device.type == "cuda" and fake_cuda.pin_memory(True):
            host = host.pin_memory()
        index = host.to(device, non_blocking=True)
        N = len(positions)
        self.positions, self._write = index[:N], index[N:2 * N]
        at = 2 * N
        self._groups = []
        for g, width in zip(groups, widths):
            tables = index[at:at + len(g) * width].view(len(g), width)
            self._groups.append(DecodeGroup(g, tables, paged_mask(self.positions[g.start:g.stop, None], width * bs)))
            at += len(g) * width
        self._chunks = []
        for r, t in zip(rows[self.n_decode:], chunk_tables):
            self._chunks.append(PrefillChunk(r.start, r.n, index[at:at + len(t)]))
            at += len(t)

    @property
    def n_tokens(self) -> int:
        return len(self._write)

    def check_fits(self, batch_size: int, n_new: int) -> None:
        if (batch_size, n_new) != (1, self.n_tokens):
            raise ValueError(f"this packed batch was planned for 1 row x {self.n_tokens} tokens, got {batch_size} x {n_new}")

    def check(self, model, ids: torch.Tensor) -> None:
        """model.cache.Cache's check: ids in the vocab, one row of the planned length (positions were checked
        against the block tables when the batch was made). The engine's forwards skip it (check=False)."""
        check_token_ids("ids", ids, model.config.vocab_size)
        self.check_fits(ids.shape[0], ids.shape[1])

    def begin(self, n_new: int) -> torch.Tensor:
        """Positions [n_new] of the packed tokens (one per token, each request's own)."""
        self.check_fits(1, n_new)
        return self.positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """Write k, v [1, n_kv_head, N, head_dim] into the pool; each request's attention over its own keys -> [1, n_head, N, head_dim]."""
        k_pool, v_pool, bs = self.cache.k[layer], self.cache.v[layer], self.cache.block_size
        for pool, new in ((k_pool, k), (v_pool, v)):
            pool.index_copy_(0, self._write, new[0].transpose(0, 1))
        out = []
        for g in self._groups:
            qd = q[0, :, g.rows.start:g.rows.stop].transpose(0, 1)[:, :, None]      # [rows, n_head, 1, head_dim]
            kd, vd = gather_blocks(k_pool, g.tables, bs), gather_blocks(v_pool, g.tables, bs)
            out.append(attention(qd, kd, vd, impl=impl, mask=g.mask)[:, :, 0].transpose(0, 1))
        offset = self.n_decode
        for start, n, table in self._chunks:
            end = start + n
            kc = gather_blocks(k_pool, table[None], bs)[:, :, :end]
            vc = gather_blocks(v_pool, table[None], bs)[:, :, :end]
            out.append(attention(q[:, :, offset:offset + n], kc, vc, q_offset=start, impl=impl)[0])
            offset += n
        return side_by_side(out)

    def advance(self, n: int) -> None:
        """Nothing to store: each request's position is its own (Sequence.n_computed), and the scheduler moves it
        after the step (Scheduler.postprocess)."""


__all__ = ["DecodeGroup", "PackedBatch", "PagedKVCache", "PrefillChunk", "Row", "side_by_side"]
