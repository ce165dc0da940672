"""Paged KV-cache bookkeeping: fixed-size blocks, a free list, reference counts and the prefix cache."""
from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from labutils.core.validate import check_count, check_flag


def block_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The prefix-cache key of a full block: sha256 of the previous block's key and this block's token ids.

    The chain makes a key stand for the whole prefix up to the block. A cryptographic hash, as vLLM uses,
    because Python's hash() of int tuples can be collided on purpose, and a collision that slipped past
    the lookup's checks would hand a request keys and values computed after other tokens.
    """
    digest = hashlib.sha256(parent or b"")            # a key is 32 bytes, so no parent (b"") is told apart
    digest.update(array("q", tokens).tobytes())       # 8 bytes per token id
    return digest.digest()


@dataclass(slots=True)
class Block:
    """One block's state, in one record (as nano-vllm's Block): how many block tables hold it, and, once it is full
    and keyed, the prefix it holds. A block is in use while ref_count > 0; a free block with a key is *cached*."""

    id: int
    ref_count: int = 0
    key: bytes | None = None            # block_hash(parent, tokens): its prefix-cache key, None while unkeyed
    parent: bytes | None = None         # the previous block's key; lookup compares it and the tokens, not just
    tokens: tuple[int, ...] = ()        # the hash, so a collision can never hand out the wrong keys and values

    def forget(self) -> None:
        """Drop the prefix it held: it is about to be written with other tokens."""
        self.key, self.parent, self.tokens = None, None, ()


@dataclass
class Allocation:
    """Blocks for a request's first `len(table) * block_size` positions; the first `cached_tokens` are already written."""

    table: list[int]
    keys: list[bytes]          # chain keys of the reused blocks at the front of the table
    cached_tokens: int


class BlockManager:
    """Hands block ids 0 .. n_blocks-1 to requests' block tables and takes them back.

    A block is *in use* while its reference count is above zero (a shared prefix block counts once
    per request). A free block is either plain, or *cached*: it still holds a full block of a known
    prefix, keyed by block_hash, and waits in LRU order for a request with the same prefix.
    `limit_blocks` bounds in-use plus cached blocks; past it the least recently used cached block
    is forgotten (a limit of 0 caches nothing). Never-used ids go out lowest first, so the storage
    behind them (PagedKVCache) only grows as far as the load needs.
    """

    def __init__(self, n_blocks: int, block_size: int = 16, *, prefix_caching: bool = True,
                 limit_blocks: int | None = None):
        n_blocks, block_size = check_count("n_blocks", n_blocks, 1), check_count("block_size", block_size, 1)
        limit = n_blocks if limit_blocks is None else check_count("limit_blocks", limit_blocks, 0)
        self.n_blocks, self.block_size, self.limit_blocks = n_blocks, block_size, limit
        self.prefix_caching = check_flag("prefix_caching", prefix_caching) and limit > 0   # nothing kept: nothing keyed
        # Block records exist for ids below high_water only (a block gets one when it is first handed out, so
        # high_water is their count), and a large pool costs nothing until the load needs it. The other three are
        # indexes over those records.
        self._blocks: list[Block] = []
        self._by_key: dict[bytes, int] = {}                    # prefix-cache key -> the block holding it
        self._free: deque[int] = deque()                       # plain free blocks
        self._cached: OrderedDict[int, None] = OrderedDict()   # free and keyed, least recently used first
        self.used = 0              # blocks with a reference count above zero
        self.evictions = 0

    @property
    def high_water(self) -> int:
        """Ids below this have been handed out at least once (and have a Block record)."""
        return len(self._blocks)

    @property
    def cached(self) -> int:
        """Free blocks that still hold a known prefix."""
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._blocks[block].ref_count if 0 <= block < self.high_water else 0

    def available(self, exclude=()) -> int:
        """Blocks a new allocation could take: plain free, never used, and cached ones not in `exclude`."""
        reused = sum(1 for b in exclude if b in self._cached)
        return len(self._free) + (self.n_blocks - self.high_water) + len(self._cached) - reused

    # -- the prefix cache --------------------------------------------------------------------------

    def lookup(self, tokens) -> tuple[list[int], list[bytes]]:
        """The blocks already holding the longest run of `tokens`' leading full blocks, and their keys.

        Never the whole sequence: at least its last token is left to compute, because the next
        token comes from that token's logits (a full hit would leave nothing to prefill).
        """
        hits: list[int] = []
        keys: list[bytes] = []
        if not self.prefix_caching:
            return hits, keys
        bs, parent = self.block_size, None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = block_hash(parent, chunk)
            block = self._by_key.get(key)
            if block is None or (self._blocks[block].parent, self._blocks[block].tokens) != (parent, chunk):
                break                                                      # absent, or a hash collision
            hits.append(block)
            keys.append(key)
            parent = key
        return hits, keys

    def commit(self, table: list[int], keys: list[bytes], tokens, n_written: int) -> None:
        """Key every block of `table` that is now full (its first n_written positions are written).

        `keys` is the request's chain of block keys so far, extended in place. A block whose key is
        already held by another block stays unkeyed: one copy of a prefix is enough.
        """
        if not self.prefix_caching:
            return
        bs = self.block_size
        for i in range(len(keys), min(n_written // bs, len(table))):
            chunk, parent = tuple(tokens[i * bs:(i + 1) * bs]), (keys[-1] if keys else None)
            key = block_hash(parent, chunk)
            keys.append(key)
            block = self._blocks[table[i]]
            if key not in self._by_key and block.key is None:
                self._by_key[key] = block.id
                block.key, block.parent, block.tokens = key, parent, chunk

    # -- allocation --------------------------------------------------------------------------------

    def allocate(self, tokens) -> Allocation | None:
        """Blocks for every position of `tokens`, reusing cached prefix blocks; None if they do not fit (nothing changes)."""
        hits, keys = self.lookup(tokens)
        need = -(-len(tokens) // self.block_size) - len(hits)
        if self.available(exclude=hits) < need:
            return None
        for block in hits:
            self._incref(block)
        table = hits + [self._take() for _ in range(need)]
        return Allocation(table, keys, len(hits) * self.block_size)

    def append(self, table: list[int], n_positions: int) -> bool:
        """Grow `table` to cover n_positions; False (table unchanged) when no block is left."""
        need = -(-n_positions // self.block_size) - len(table)
        if need > self.available():
            return False
        table.extend(self._take() for _ in range(need))
        return True

    def free(self, table: list[int]) -> None:
        """Drop one reference to every block of a finished or preempted request.

        Tail first into the LRU, as nano-vllm frees: a freed chain then waits there with its last block oldest, so
        eviction takes children before their parents, and a cached block's parent is always cached too
        (a child that outlived its parent could never be found again, yet would fill the limit).
        Freeing a table twice, or a block that was never handed out, is refused before anything changes.
        """
        for block, n in Counter(table).items():
            held = self.refcount(block) if isinstance(block, int) else 0
            if held < n:                            # 0 for an id never handed out
                raise ValueError(
                    f"free: block {block!r} is not in use (reference count {held}, freed "
                    f"{n} time(s) here): this table was freed already, or holds a block that was never "
                    "allocated; free each allocation's table exactly once")
        plain = []
        for block in map(self._blocks.__getitem__, reversed(table)):
            block.ref_count -= 1
            if block.ref_count == 0:
                self.used -= 1
                if block.key is not None:
                    self._cached[block.id] = None     # most recently used end
                else:
                    plain.append(block.id)
        self._free.extend(reversed(plain))            # plain blocks keep table order: the next request gets them so
        self._enforce_limit()

    def _incref(self, block: int) -> None:
        record = self._blocks[block]
        if record.ref_count == 0:
            self._cached.pop(block, None)
            self.used += 1
        record.ref_count += 1

    def _take(self) -> int:
        """One block with refcount 1: a plain free one, a never-used one while the limit allows, else the LRU cached one."""
        if self._free:
            block = self._free.popleft()
        elif self.high_water < self.n_blocks and (self.used + len(self._cached) < self.limit_blocks
                                                  or not self._cached):
            block = self.high_water
            self._blocks.append(Block(block))
        elif self._cached:
            block = self._evict()
        else:
            raise RuntimeError("no free KV block; check available() before taking one")
        self._blocks[block].ref_count = 1
        self.used += 1
        self._enforce_limit()
        return block

    def _evict(self) -> int:
        block, _ = self._cached.popitem(last=False)
        record = self._blocks[block]
        if self._by_key.get(record.key) == block:
            del self._by_key[record.key]
        record.forget()
        self.evictions += 1
        return block

    def _enforce_limit(self) -> None:
        while self._cached and self.used + len(self._cached) > self.limit_blocks:
            self._free.append(self._evict())


__all__ = ["Allocation", "Block", "BlockManager", "block_hash"]
