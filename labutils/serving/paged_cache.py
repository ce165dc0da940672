"""The paged KV cache's storage (a pool of blocks per layer) and the per-forward view GPT.forward reads it through."""
from __future__ import annotations

import torch

from ..kernels.paged import block_slots, gather_blocks, paged_mask
from ..roofline import kv_bytes_per_token
from ..validate import check_count

SCRATCH = 0     # storage block that padding writes to; block id b lives in storage block b + 1


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks: [n_layer, (n_blocks + 1) * block_size, n_kv_head, head_dim].

    Slot `(block + 1) * block_size + offset` holds one position of one request; which request and
    which position is the block tables' business (serving.blocks). Storage block 0 is scratch: the
    padding of a batched prefill writes there, and no block table points at it. The storage starts
    with the scratch block alone and doubles (up to n_blocks) as higher block ids come into use, so
    memory follows the load rather than the worst case. It is zeroed, not empty: masked-out
    padding times a NaN would still be NaN.
    """

    def __init__(self, config, block_size: int, n_blocks: int, device=None, dtype=torch.float32):
        check_count("block_size", block_size, 1)
        check_count("n_blocks", n_blocks, 1)
        self.config, self.block_size, self.n_blocks = config, block_size, n_blocks
        self.block_bytes = kv_bytes_per_token(config, dtype) * block_size   # K and V, every layer
        shape = (config.n_layer, block_size, config.n_kv_head, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (both pools, the scratch block included)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def blocks_allocated(self) -> int:
        """Blocks the storage has room for, besides the scratch block."""
        return self.k.shape[1] // self.block_size - 1

    def ensure(self, n_blocks: int) -> None:
        """Make room for block ids below n_blocks, doubling the storage so growth is rare."""
        have = self.blocks_allocated
        if n_blocks <= have:
            return
        if n_blocks > self.n_blocks:
            raise ValueError(f"block id {n_blocks - 1} is beyond the pool's {self.n_blocks} blocks")
        new = min(self.n_blocks, max(n_blocks, 2 * have))
        try:
            for name in ("k", "v"):
                old = getattr(self, name)
                grown = old.new_zeros((old.shape[0], (new + 1) * self.block_size, *old.shape[2:]))
                grown[:, :old.shape[1]] = old
                setattr(self, name, grown)
        except (MemoryError, RuntimeError) as err:
            from ..hardware import is_oom
            if not is_oom(err):
                raise
            raise MemoryError(f"a paged KV cache of {new:,} blocks ({new * self.block_bytes / 2**20:,.0f} MiB) "
                              f"does not fit on {self.k.device}; give the Engine a smaller kv_budget_bytes "
                              "or fewer batch slots") from None

    def batch(self, tables: list[list[int]], starts: list[int], counts: list[int]) -> "PagedBatch":
        """The view one forward pass uses: row b writes positions starts[b] .. starts[b] + counts[b] - 1."""
        return PagedBatch(self, tables, starts, counts)


class PagedBatch:
    """One forward's view of the pool, with the cache interface GPT.forward expects (see GPT.forward).

    Every row keeps its own position (`pos`, [batch]): requests that joined at different times decode
    side by side. Rows may feed different numbers of tokens (a batched prefill): shorter rows are
    padded on the left, so every row's last token is the last column (GPT.forward(last_only=True)),
    and the padding sits at position 0 and writes to the scratch block. update() writes the new keys
    and values into the rows' slots and returns each row's blocks gathered in position order
    (kernels.paged), with `mask` hiding later positions and other rows' padding.
    """

    def __init__(self, cache: PagedKVCache, tables: list[list[int]], starts: list[int], counts: list[int]):
        if not tables or any(not t for t in tables) or not len(starts) == len(counts) == len(tables):
            raise ValueError("a paged batch needs one non-empty block table, start and token count per row")
        device, bs = cache.k.device, cache.block_size
        for t, start, n in zip(tables, starts, counts):
            if n < 1 or start + n > len(t) * bs:
                raise ValueError(f"positions {start} .. {start + n - 1} do not fit a block table of {len(t)} blocks")
        width, self.n_new = max(len(t) for t in tables), max(counts)
        # Pad short tables with one of their own blocks: a valid slot to read, always masked out.
        self.table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], device=device) + 1
        self.cache, self.counts = cache, counts
        self.pos = torch.tensor(starts, device=device)
        self.pad = torch.tensor([self.n_new - n for n in counts], device=device)
        self.slots = block_slots(self.table, bs)                   # [batch, width * block_size]
        self.mask: torch.Tensor | None = None
        self._write: torch.Tensor | None = None

    def check_fits(self, batch_size: int, n_new: int) -> None:
        if (batch_size, n_new) != (len(self.pos), self.n_new):
            raise ValueError(f"this paged batch was planned for {len(self.pos)} rows x {self.n_new} tokens, "
                             f"got {batch_size} x {n_new}")

    def begin(self, n_new: int) -> torch.Tensor:
        """Positions [batch, n_new] of the new tokens; prepares the write slots and the mask every layer shares."""
        self.check_fits(len(self.pos), n_new)
        col = torch.arange(n_new, device=self.pos.device)
        padding = col[None, :] < self.pad[:, None]
        positions = (self.pos[:, None] + col - self.pad[:, None]).masked_fill(padding, 0)
        self._write = self.slots.gather(1, positions).masked_fill(padding, SCRATCH * self.cache.block_size).flatten()
        self.mask = paged_mask(positions, self.slots.shape[1])   # padding at position 0 sees key 0: no empty row
        return positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [batch, n_kv_head, n_new, head_dim] into the pool; return each row's keys and values so far."""
        for pool, new in ((self.cache.k[layer], k), (self.cache.v[layer], v)):
            pool.index_copy_(0, self._write, new.transpose(1, 2).reshape(-1, *pool.shape[1:]))
        bs = self.cache.block_size
        return gather_blocks(self.cache.k[layer], self.table, bs), gather_blocks(self.cache.v[layer], self.table, bs)

    def advance(self, n: int) -> None:
        """Nothing to do: the engine moves each request's own position after the forward."""


__all__ = ["PagedBatch", "PagedKVCache", "SCRATCH"]
