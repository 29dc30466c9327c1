"""Block pool and KV cache manager: accounting, sharing, copy-on-write, prefix caching, eviction."""

import pytest

from hf_paged.cache import BlockPool, KVCacheManager, NoFreeBlocksError


def test_allocate_free_and_counts():
    pool = BlockPool(8, block_size=4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_used_blocks == 3 and pool.num_free_blocks == 5
    pool.free(a)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 8


def test_over_allocation_raises_and_leaves_state_unchanged():
    pool = BlockPool(4, block_size=4)
    held = pool.allocate(3)
    with pytest.raises(NoFreeBlocksError) as err:
        pool.allocate(2)
    assert err.value.requested == 2 and err.value.free == 1
    assert pool.num_free_blocks == 1 and pool.ref_counts == [1 if b in held else 0 for b in range(4)]


def test_double_free_is_detected():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_refcounts_keep_shared_blocks_alive():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_used_blocks == 2
    pool.free(blocks)
    assert pool.num_used_blocks == 0


def test_cached_blocks_are_evicted_last_and_least_recently_used_first():
    pool = BlockPool(4, block_size=2)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"first")
    pool.cache(b, b"second")
    pool.free([a])
    pool.free([b])
    pool.free([c, d])  # uncached: allocated before any cached block
    assert set(pool.allocate(2)) == {c, d}
    assert pool.lookup(b"first") == a and pool.lookup(b"second") == b
    assert pool.allocate(1) == [a]  # least recently released cached block goes first
    assert pool.lookup(b"first") is None and pool.lookup(b"second") == b
    assert pool.num_cached_blocks == 1


def test_manager_slots_cover_exactly_the_tokens():
    manager = KVCacheManager(BlockPool(16, block_size=4))
    manager.allocate("s", 0, 10)
    table = manager.block_table("s")
    assert len(table) == 3
    assert manager.slots("s", 8, 10) == [table[2] * 4, table[2] * 4 + 1]
    manager.allocate("s", 10, 12)
    assert len(manager.block_table("s")) == 3
    manager.allocate("s", 12, 13)
    assert len(manager.block_table("s")) == 4
    manager.free("s")
    assert manager.pool.num_used_blocks == 0


def test_allocate_failure_returns_none_and_changes_nothing():
    manager = KVCacheManager(BlockPool(3, block_size=4))
    manager.allocate("a", 0, 8)
    assert manager.allocate("b", 0, 9) is None
    assert manager.block_table("b") == [] and manager.pool.num_used_blocks == 2


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    manager = KVCacheManager(BlockPool(8, block_size=4))
    manager.allocate("p", 0, 6)
    manager.fork("p", "c")
    p_table = list(manager.block_table("p"))
    assert manager.block_table("c") == p_table
    assert manager.num_blocks_needed("c", 6, 7) == 1
    copies = manager.allocate("c", 6, 7)
    assert copies == [(p_table[1], manager.block_table("c")[1])]
    assert manager.block_table("c")[0] == p_table[0] != manager.block_table("c")[1]
    assert manager.allocate("p", 6, 7) == []  # the parent now owns its block alone
    manager.free_all()
    assert manager.pool.num_used_blocks == 0


def test_prefix_matching_chains_hashes_and_counts_hits():
    manager = KVCacheManager(BlockPool(16, block_size=4))
    tokens = list(range(14))
    manager.allocate("a", 0, 14)
    manager.cache_blocks("a", tokens, 14)
    assert manager.pool.num_cached_blocks == 3
    # Same first 8 tokens, different third block.
    other = tokens[:8] + [99] * 6
    assert manager.match_prefix("b", other) == 8
    assert manager.block_table("b") == manager.block_table("a")[:2]
    # A different first block breaks the chain even if later blocks are equal.
    assert manager.match_prefix("c", [99] * 4 + tokens[4:]) == 0
    # The whole prompt is never served from cache: the last token must be computed.
    assert manager.match_prefix("d", tokens[:12]) == 8
    assert manager.prefix_hits == manager.prefix_queries == 0  # counted only once a sequence is admitted
    for length, cached in ((14, 8), (14, 0), (12, 8)):
        manager.record_prefix_match(length, cached)
    assert manager.prefix_hits == 16 and manager.prefix_queries == 14 + 14 + 12
    manager.free_all()
    assert manager.pool.num_used_blocks == 0
    # Cached blocks survive their sequences until evicted.
    assert manager.match_prefix("e", tokens) == 12


def test_truncate_and_select():
    manager = KVCacheManager(BlockPool(8, block_size=4), enable_prefix_caching=False)
    manager.allocate(0, 0, 9)
    manager.allocate(1, 0, 3)
    manager.truncate(0, 5)
    assert len(manager.block_table(0)) == 2 and manager.pool.num_used_blocks == 3
    manager.select([0, 0, 1])
    assert manager.block_table(0) == manager.block_table(1) and manager.pool.num_used_blocks == 3
    manager.free_all()
    assert manager.pool.num_used_blocks == 0


def test_block_keys_chain_to_their_parent():
    from hf_paged.cache.kv_cache_manager import block_hash

    root = block_hash(None, [1, 2, 3, 4])
    assert block_hash(None, [1, 2, 3, 4]) == root and len(root) == 32
    assert block_hash(root, [5, 6, 7, 8]) != block_hash(block_hash(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert block_hash(None, [1, 2, 3, 4]) != block_hash(None, [4, 3, 2, 1])


def test_truncating_into_an_indexed_block_unindexes_it():
    """A block kept in part is rewritten in place, so its old hash must not lead a later prompt to it."""
    manager = KVCacheManager(BlockPool(8, block_size=4), enable_prefix_caching=True)
    first = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    manager.allocate("a", 0, 9)
    manager.cache_blocks("a", first, 9)
    manager.truncate("a", 6)
    rewritten = [1, 2, 3, 4, 5, 6, 70, 80, 90]
    manager.allocate("a", 6, 9)
    manager.cache_blocks("a", rewritten, 9)
    assert manager.match_prefix("b", first + [0]) == 4
    assert manager.match_prefix("c", rewritten + [0]) == 8


def test_grow_adds_free_blocks_first_in_line():
    pool = BlockPool(2, block_size=4)
    assert pool.allocate(2) == [0, 1]
    pool.grow(3)
    assert pool.num_blocks == 5 and pool.num_free_blocks == 3 and len(pool.ref_counts) == 5
    assert pool.allocate(3) == [2, 3, 4]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_a_freed_sequence_evicts_its_last_block_first():
    """Evicting the head of a cached chain would make every block after it unreachable."""
    kv = KVCacheManager(BlockPool(4, 4), enable_prefix_caching=True)
    tokens = list(range(12))
    assert kv.allocate("a", 0, 12) == []
    kv.cache_blocks("a", tokens, 12)
    kv.free("a")
    assert kv.allocate("b", 0, 8) == []  # the one plain free block, then one cached block evicted
    assert kv.match_prefix("c", tokens + [99]) == 8


@pytest.mark.parametrize("bystander", [False, True])
def test_blocks_needed_together_count_one_copy_fewer_than_the_sharers_that_write(bystander):
    """Three forks write into their shared partial block: two copies, the last one writes in place; a fourth holder
    that does not write leaves every writer a copy to make."""
    kv = KVCacheManager(BlockPool(16, 4))
    kv.allocate("a", 0, 6)
    for child in ("b", "c") + (("d",) if bystander else ()):
        kv.fork("a", child)
    spans = [(seq, 6, 7) for seq in ("a", "b", "c")]
    needed = kv.num_blocks_needed_all(spans)
    free = kv.pool.num_free_blocks
    copies = [kv.allocate(*span) for span in spans]
    assert needed == free - kv.pool.num_free_blocks == (3 if bystander else 2)
    assert sum(map(len, copies)) == needed
    assert kv.num_blocks_needed_all([("a", 8, 9)]) == kv.num_blocks_needed("a", 8, 9) == 1
    assert kv.num_blocks_needed("a", 0, 9) == 2  # rewriting the full block the forks share takes a block of its own


def test_a_block_shared_by_a_fork_before_it_was_written_is_replaced_not_written_into():
    """A failed step leaves a sequence holding a block past its computed tokens; a fork then shares it. Each that
    writes there first takes a block of its own (nothing to copy), so neither writes into the other's rows."""
    kv = KVCacheManager(BlockPool(16, 4), enable_prefix_caching=False)
    kv.allocate("a", 0, 6)  # the step that was to compute tokens 0-5 failed: a keeps its two blocks
    kv.allocate("a", 0, 4)  # the step computed 0-3 instead
    kv.fork("a", "b")
    spare = kv.block_table("a")[1]
    assert kv.num_blocks_needed_all([("a", 4, 5), ("b", 4, 5)]) == 1
    assert kv.allocate("a", 4, 5) == [] and kv.block_table("a")[1] != spare
    assert kv.allocate("b", 4, 5) == [] and kv.block_table("b")[1] == spare  # its last holder writes in place
    assert kv.block_table("a")[0] == kv.block_table("b")[0]
