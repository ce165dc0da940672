"""The paged KV cache's storage (a pool of blocks per layer) and the per-forward view GPT.forward reads it through."""
from __future__ import annotations

import torch

from ..kernels.paged import block_slots, gather_blocks, paged_mask
from ..roofline import kv_bytes_per_token
from ..validate import check_count


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks: [n_layer, n_blocks * block_size, n_kv_head, head_dim].

    Slot `block * block_size + offset` holds one position of one request; which request and which
    position is the block tables' business (serving.blocks). The storage starts empty and doubles
    (up to n_blocks) as higher block ids come into use, so memory follows the load rather than
    the worst case. It is zeroed, not empty: masked-out padding times a NaN would still be NaN.
    """

    def __init__(self, config, block_size: int, n_blocks: int, device=None, dtype=torch.float32):
        check_count("block_size", block_size, 1)
        check_count("n_blocks", n_blocks, 1)
        self.config, self.block_size, self.n_blocks = config, block_size, n_blocks
        self.block_bytes = kv_bytes_per_token(config, dtype) * block_size   # K and V, every layer
        shape = (config.n_layer, 0, config.n_kv_head, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (both pools)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def blocks_allocated(self) -> int:
        return self.k.shape[1] // self.block_size

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
                grown = old.new_zeros((old.shape[0], new * self.block_size, *old.shape[2:]))
                grown[:, :old.shape[1]] = old
                setattr(self, name, grown)
        except (MemoryError, RuntimeError) as err:
            from ..hardware import is_oom
            if not is_oom(err):
                raise
            raise MemoryError(f"a paged KV cache of {new:,} blocks ({new * self.block_bytes / 2**20:,.0f} MiB) "
                              f"does not fit on {self.k.device}; give the Engine a smaller kv_budget_bytes "
                              "or fewer batch slots") from None

    def batch(self, tables: list[list[int]], starts: list[int], n_new: int) -> "PagedBatch":
        """The view one forward pass uses: row b writes positions starts[b] .. starts[b] + n_new - 1."""
        return PagedBatch(self, tables, starts, n_new)


class PagedBatch:
    """One forward's view of the pool, with the cache interface GPT.forward expects (see GPT.forward).

    Every row keeps its own position (`pos`, [batch]): requests that joined at different times decode
    side by side. update() writes the new keys and values into the rows' slots and returns each row's
    blocks gathered in position order (kernels.paged), with `mask` hiding later positions and padding.
    """

    def __init__(self, cache: PagedKVCache, tables: list[list[int]], starts: list[int], n_new: int):
        if not tables or any(not t for t in tables) or len(starts) != len(tables):
            raise ValueError("a paged batch needs one non-empty block table and one start position per row")
        device, bs = cache.k.device, cache.block_size
        width = max(len(t) for t in tables)
        # Pad short tables with one of their own blocks: a valid slot to read, always masked out.
        table = torch.tensor([t + [t[-1]] * (width - len(t)) for t in tables], device=device)
        for t, start in zip(tables, starts):
            if start + n_new > len(t) * bs:
                raise ValueError(f"positions up to {start + n_new - 1} do not fit a block table of {len(t)} blocks")
        self.cache, self.n_new, self.table = cache, n_new, table
        self.pos = torch.tensor(starts, device=device)
        self.slots = block_slots(table, bs)                        # [batch, width * block_size]
        self.mask: torch.Tensor | None = None
        self._write: torch.Tensor | None = None

    def check_fits(self, batch_size: int, n_new: int) -> None:
        if (batch_size, n_new) != (len(self.pos), self.n_new):
            raise ValueError(f"this paged batch was planned for {len(self.pos)} rows x {self.n_new} tokens, "
                             f"got {batch_size} x {n_new}")

    def begin(self, n_new: int) -> torch.Tensor:
        """Positions [batch, n_new] of the new tokens; prepares the write slots and the mask every layer shares."""
        self.check_fits(len(self.pos), n_new)
        positions = self.pos[:, None] + torch.arange(n_new, device=self.pos.device)
        self._write = self.slots.gather(1, positions).flatten()
        self.mask = paged_mask(positions, self.slots.shape[1])
        return positions

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [batch, n_kv_head, n_new, head_dim] into the pool; return each row's keys and values so far."""
        for pool, new in ((self.cache.k[layer], k), (self.cache.v[layer], v)):
            pool.index_copy_(0, self._write, new.transpose(1, 2).reshape(-1, *pool.shape[1:]))
        bs = self.cache.block_size
        return gather_blocks(self.cache.k[layer], self.table, bs), gather_blocks(self.cache.v[layer], self.table, bs)

    def advance(self, n: int) -> None:
        """Nothing to do: the engine moves each request's own position after the forward."""


__all__ = ["PagedBatch", "PagedKVCache"]
