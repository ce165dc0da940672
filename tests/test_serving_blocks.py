"""Paged KV-cache bookkeeping and the paged reference attention: refcounts, prefix keys, LRU budget, gather + SDPA."""
import pytest
import torch

from labutils.model.kernels import attention, paged_attention
from labutils.serving import blocks as blocks_mod
from labutils.serving.blocks import BlockManager, block_hash

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


# --- allocation, refcounts, the free list -----------------------------------------------------------

def test_blocks_cover_every_position_and_come_back_on_free():
    m = BlockManager(8, BS, prefix_caching=False)
    a = m.allocate(toks(9))                        # 9 positions -> 3 blocks
    assert len(a.table) == 3 and a.cached_tokens == 0 and len(set(a.table)) == 3
    assert m.used == 3 and m.available() == 5
    assert m.append(a.table, 12) and len(a.table) == 3     # position 11 still fits block 3
    assert m.append(a.table, 13) and len(a.table) == 4     # position 12 needs a new block
    assert all(m.refcount(b) == 1 for b in a.table)
    m.free(a.table)
    assert m.used == 0 and m.available() == 8 and m.cached == 0   # no prefix caching: plain free blocks


def test_allocation_that_does_not_fit_changes_nothing():
    m = BlockManager(3, BS, prefix_caching=False)
    a = m.allocate(toks(8))
    assert m.allocate(toks(9)) is None
    assert m.used == 2 and not m.append(a.table, 13) and len(a.table) == 2
    assert m.append(a.table, 12) and len(a.table) == 3


def test_never_used_ids_go_out_lowest_first():
    m = BlockManager(64, BS, prefix_caching=False)
    assert m.allocate(toks(10)).table == [0, 1, 2] and m.high_water == 3


# --- the prefix cache ----------------------------------------------------------------------------------

def committed(m, tokens):
    """Allocate `tokens`, write all of them (commit), and return the allocation."""
    a = m.allocate(tokens)
    m.commit(a.table, a.keys, tokens, len(tokens))
    return a


def test_a_shared_prefix_reuses_full_blocks_and_counts_references():
    m = BlockManager(16, BS)
    first = committed(m, toks(10))                 # blocks 0, 1 full; 2 half
    second = m.allocate(toks(8) + [99, 98, 97])
    assert second.cached_tokens == 8 and second.table[:2] == first.table[:2]
    assert second.table[2] != first.table[2]       # the third block differs: a new one
    assert [m.refcount(b) for b in first.table] == [2, 2, 1]
    m.free(first.table)
    assert [m.refcount(b) for b in second.table[:2]] == [1, 1]


def test_the_whole_prompt_is_never_cached():
    """nano-vllm issue 144: a full hit leaves zero tokens to prefill. The last full block is recomputed."""
    m = BlockManager(16, BS)
    a = committed(m, toks(8))                      # exactly two full blocks
    m.free(a.table)
    again = m.allocate(toks(8))
    assert again.cached_tokens == 4 and again.table[0] == a.table[0]
    longer = m.allocate(toks(9))                   # one more token: both blocks may now be reused
    assert longer.cached_tokens == 8


def test_keys_chain_the_previous_block():
    """The same block of tokens after a different prefix is a different key, so it is not reused."""
    m = BlockManager(16, BS)
    committed(m, [7, 7, 7, 7, 1, 2, 3, 4, 0])
    assert m.allocate([8, 8, 8, 8, 1, 2, 3, 4, 0]).cached_tokens == 0
    assert block_hash(None, (1, 2, 3, 4)) != block_hash(block_hash(None, (7, 7, 7, 7)), (1, 2, 3, 4))


def test_a_hash_collision_costs_a_miss_not_wrong_blocks(monkeypatch):
    monkeypatch.setattr(blocks_mod, "block_hash", lambda parent, tokens: 42)   # every block collides
    m = BlockManager(16, BS)
    committed(m, toks(9))
    assert m.allocate(toks(9, start=50)).cached_tokens == 0      # same key, other tokens: compared, missed
    assert m.allocate(toks(9)).cached_tokens == 4                # the real match still hits (first block)


def test_freed_prefix_blocks_stay_cached_and_are_evicted_least_recently_used_first():
    m = BlockManager(4, BS)
    a = committed(m, toks(5))                      # block a0 full, a1 partial
    b = committed(m, toks(5, start=100))
    m.free(a.table)
    m.free(b.table)                                # cached: a0 then b0 (LRU order); a1, b1 plain
    assert m.cached == 2 and m.used == 0
    c = m.allocate(toks(16, start=200))            # needs 4 blocks: 2 plain + both cached, evicted
    assert m.cached == 0 and m.evictions == 2 and len(c.table) == 4
    m.free(c.table)
    d = committed(m, toks(5))                      # a's prefix is gone
    assert d.cached_tokens == 0


def test_lru_keeps_the_recently_used_prefix():
    m = BlockManager(6, BS, limit_blocks=5)
    a, b = committed(m, toks(5)), committed(m, toks(5, start=100))
    m.free(a.table)
    m.free(b.table)
    m.free(m.allocate(toks(5)).table)              # touch a's prefix: now b0 is least recently used
    m.allocate(toks(12, start=300))                # 3 blocks: 2 plain + 1 never used; 3 used + 2 cached
    assert m.evictions == 0
    m.allocate(toks(4, start=400))                 # one more would pass the budget: evicts b0, the LRU one
    assert m.evictions == 1
    assert m.lookup(toks(5))[0] == a.table[:1]
    assert m.lookup(toks(5, start=100))[0] == []


def test_the_budget_bounds_blocks_in_use_plus_cached():
    m = BlockManager(10, BS, limit_blocks=3)
    a = committed(m, toks(13))                     # 4 blocks in use: over the budget, nothing cached
    assert m.used == 4 and m.cached == 0
    m.free(a.table)
    assert m.cached == 3 and m.used + m.cached <= 3   # three full blocks were keyed; all fit the budget
    m.allocate(toks(5, start=500))
    assert m.used + m.cached <= 3


def test_budget_zero_caches_nothing():
    m = BlockManager(8, BS, limit_blocks=0)
    assert not m.prefix_caching
    a = committed(m, toks(12))
    m.free(a.table)
    assert m.cached == 0 and m.allocate(toks(12)).cached_tokens == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_blocks=0, block_size=4), "n_blocks must be >= 1"),
    (dict(n_blocks=4, block_size=0), "block_size must be >= 1"),
    (dict(n_blocks=4, block_size=4, limit_blocks=-1), "limit_blocks must be >= 0"),
])
def test_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BlockManager(**kwargs)


# --- the paged reference kernel ------------------------------------------------------------------------

@pytest.mark.parametrize("n_kv", [4, 2, 1])
@pytest.mark.parametrize("impl", ["sdpa", "naive"])
def test_paged_attention_equals_dense_attention_over_scattered_blocks(n_kv, impl):
    """Requests of different lengths, blocks scattered through the pool, decode and prefill queries."""
    g = torch.Generator().manual_seed(n_kv)
    H, d, bs, lens = 4, 8, 4, [3, 11, 6]
    pool_k = torch.randn(40, n_kv, d, generator=g, dtype=torch.float64)
    pool_v = torch.randn(40, n_kv, d, generator=g, dtype=torch.float64)
    perm = torch.randperm(10, generator=g).tolist()
    tables = [perm[0:1], perm[1:4], perm[4:6]]
    width = max(map(len, tables))
    table = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables])
    for tq in (1, 3):                               # a decode step, and the last 3 prompt tokens
        q = torch.randn(3, H, tq, d, generator=g, dtype=torch.float64)
        positions = torch.tensor([[n - tq + i for i in range(tq)] for n in lens]).clamp(min=0)
        got = paged_attention(q, pool_k, pool_v, table, positions, bs, impl=impl)
        for r, (t, n) in enumerate(zip(tables, lens)):
            slots = [b * bs + o for b in t for o in range(bs)][:n]
            k, v = pool_k[slots].transpose(0, 1)[None], pool_v[slots].transpose(0, 1)[None]
            rows = positions[r]
            want = torch.cat([attention(q[r:r + 1, :, i:i + 1], k[:, :, :p + 1], v[:, :, :p + 1],
                                        q_offset=p, impl=impl) for i, p in enumerate(rows.tolist())], dim=2)
            torch.testing.assert_close(got[r:r + 1, :, :len(rows)], want, rtol=0, atol=1e-12)


# --- review bugs: orphaned children, dead blocks, double frees, the hash itself ------------------------

def test_a_colliding_root_never_adopts_a_child_computed_after_other_tokens(monkeypatch):
    """Root-first freeing evicted a chain's root before its child; a later root whose key collided (with other
    tokens) then led the lookup to that orphan, whose keys and values were computed after different tokens."""
    real = blocks_mod.block_hash
    weak = lambda parent, tokens: b"every root" if parent is None else real(parent, tokens)   # noqa: E731
    monkeypatch.setattr(blocks_mod, "block_hash", weak)
    m = BlockManager(3, BS)
    a = committed(m, toks(9))                      # a0 [0..3], a1 [4..7] keyed; a2 partial
    m.free(a.table)
    x = committed(m, toks(5, start=100))           # 2 blocks: the plain one and one eviction
    assert m.evictions == 1
    m.free(x.table)
    d = m.allocate(toks(4, start=100) + toks(5, start=4))     # x's root, then a1's tokens
    # Tail first, a1 went before a0; a0 still holds the colliding root key, so x's root was never keyed, and
    # d misses (the tokens differ) instead of reusing x's root and then a1 (8 cached tokens, the wrong ones).
    assert d.cached_tokens == 0


def test_a_freed_chain_is_evicted_tail_first_and_leaves_no_dead_blocks():
    m = BlockManager(4, BS)
    a = committed(m, toks(13))                     # 3 full blocks and a partial one
    m.free(a.table)
    m.allocate(toks(12, start=100))                # 3 blocks: the plain one and two evictions
    assert m.evictions == 2 and m.cached == 1
    hits, _ = m.lookup(toks(13))
    assert hits == a.table[:1], "the block still cached must be the chain's root, found by its prefix"


def test_freeing_twice_or_a_block_never_allocated_is_refused_and_changes_nothing():
    m = BlockManager(8, BS)
    a = m.allocate(toks(6))
    m.free(a.table)
    before = (m.used, m.cached, [m.refcount(b) for b in range(8)])
    for bad in (a.table, [7], [-1], [a.table[0], a.table[0]]):
        with pytest.raises(ValueError, match="freed already, or holds a block that was never allocated"):
            m.free(bad)
        assert (m.used, m.cached, [m.refcount(b) for b in range(8)]) == before, bad
    b = m.allocate(toks(2))
    with pytest.raises(ValueError, match="exactly once"):
        m.free(b.table + b.table)                  # one reference, freed twice in one call
    m.free(b.table)
    assert m.used == 0


def test_block_keys_are_sha256_chained_over_token_bytes():
    import hashlib
    root = block_hash(None, (1, 2, 3, 4))
    assert root == hashlib.sha256((1).to_bytes(8, "little") + (2).to_bytes(8, "little") + (3).to_bytes(8, "little")
                                  + (4).to_bytes(8, "little")).digest()
    assert block_hash(root, (5, 6, 7, 8)) == hashlib.sha256(root + b"".join(
        t.to_bytes(8, "little") for t in (5, 6, 7, 8))).digest()
    # Python's hash() of these two tuples collides (hash(-1) == hash(-2) in CPython); the keys do not.
    assert hash((None, (-1,))) == hash((None, (-2,)))
    assert block_hash(None, (-1,)) != block_hash(None, (-2,))

