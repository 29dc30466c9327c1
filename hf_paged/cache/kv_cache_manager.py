"""Per-sequence block tables over a :class:`BlockPool`: allocation, sharing with copy-on-write, prefix caching."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Hashable, Sequence

from .block_pool import BlockPool

BlockCopy = tuple[int, int]


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: SHA-256 over its parent's key and its token ids.

    A cryptographic hash, because a hit hands over another request's KV without comparing tokens: with Python's
    ``hash`` a crafted prompt could collide with someone else's prefix and read answers conditioned on it.
    """
    return hashlib.sha256((parent or b"") + array("q", tokens).tobytes()).digest()


def combined_salt(*parts: bytes | None) -> bytes | None:
    """One prefix-cache salt of several given in a fixed order (a LoRA adapter's, LongRoPE's, the request's own):
    None when none is given; each part framed by its length, so that no other parts give the same salt."""
    if all(part is None for part in parts):
        return None
    return b"".join(b"-" if part is None else len(part).to_bytes(4, "little") + part for part in parts)


class KVCacheManager:
    """Maps sequence ids to the blocks that hold their KV.

    A full block is identified by a hash chained to its parent block's hash and its own token ids, so two sequences
    that start with the same tokens can share those blocks (prefix caching). Blocks are shared by reference counts;
    a shared block that is only partly filled is copied before a sequence writes into it (copy-on-write).
    """

    def __init__(self, pool: BlockPool, enable_prefix_caching: bool = True):
        self.pool = pool
        self.block_size = pool.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.tables: dict[Hashable, list[int]] = {}
        self._hashes: dict[Hashable, list[bytes]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.tables.get(seq_id, [])

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _shared_in(self, table: list[int], num_computed: int, num_tokens: int) -> list[int]:
        """Indices of the blocks of ``table`` that tokens ``[num_computed, num_tokens)`` go into and that another
        sequence holds too: the one they start in when partly filled (copy-on-write), and any beyond it that a
        fork shared before they were written (held since a failed step)."""
        first, end = num_computed // self.block_size, min(len(table), self.blocks_for(num_tokens))
        return [i for i in range(first, end) if self.pool.ref_counts[table[i]] > 1]

    def num_blocks_needed(self, seq_id: Hashable, num_computed: int, num_tokens: int) -> int:
        """New blocks that :meth:`allocate` would take to hold ``num_tokens`` tokens."""
        table = self.block_table(seq_id)
        shared = self._shared_in(table, num_computed, num_tokens)
        return max(0, self.blocks_for(num_tokens) - len(table)) + len(shared)

    def num_blocks_needed_all(self, spans: Sequence[tuple[Hashable, int, int]]) -> int:
        """New blocks that :meth:`allocate` would take for each ``(seq_id, num_computed, num_tokens)`` of ``spans`` in
        turn: a shared block that ``k`` of them write into is replaced ``k`` times, or ``k - 1`` when they are all its
        holders (the last one writes into it in place)."""
        new, writers = 0, Counter()
        for seq_id, num_computed, num_tokens in spans:
            table = self.block_table(seq_id)
            new += max(0, self.blocks_for(num_tokens) - len(table))
            writers.update(table[i] for i in self._shared_in(table, num_computed, num_tokens))
        return new + sum(min(k, self.pool.ref_counts[block] - 1) for block, k in writers.items())

    def allocate(self, seq_id: Hashable, num_computed: int, num_tokens: int) -> list[BlockCopy] | None:
        """Make room for tokens ``[num_computed, num_tokens)`` of ``seq_id``.

        Returns the ``(src, dst)`` block copies the caller must perform on the KV tensors before writing (copy-on-
        write of a shared, partly filled block; a shared block not written yet is just replaced), or None, changing
        nothing, if the pool is short.
        """
        if self.num_blocks_needed(seq_id, num_computed, num_tokens) > self.pool.num_free_blocks:
            return None
        table = self.tables.setdefault(seq_id, [])
        copies = []
        for index in self._shared_in(table, num_computed, num_tokens):
            (new,) = self.pool.allocate(1)
            if index * self.block_size < num_computed:  # rows before the first new token are kept
                copies.append((table[index], new))
            self.pool.free([table[index]])
            table[index] = new
        missing = self.blocks_for(num_tokens) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return copies

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions ``[start, end)``."""
        table, bs = self.tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def match_prefix(self, seq_id: Hashable, token_ids: Sequence[int], salt: bytes | None = None,
                     reuse: bool = True) -> int:
        """Attach the longest cached prefix of ``token_ids`` to the new sequence ``seq_id``, among blocks cached with
        the same ``salt`` (the first block's parent in the hash chain); without ``reuse``, none (the sequence still
        starts its table, and caches its own blocks).

        Returns the number of tokens whose KV is already cached. At least one token is always left to compute, so the
        model still produces logits for the last prompt token.
        """
        if not self.enable_prefix_caching:
            return 0
        self.tables[seq_id], self._hashes[seq_id] = [], []
        return self.extend_prefix(seq_id, token_ids if reuse else (), 0, salt)

    def extend_prefix(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int,
                      salt: bytes | None = None) -> int:
        """Attach to ``seq_id``, whose blocks hold its first ``num_computed`` tokens and no more, the cached blocks
        that continue them, as :meth:`match_prefix` does from the start (a prompt computed in chunks takes what other
        sequences have computed of the same tokens since). Returns the tokens it now holds; ``num_computed`` when it
        ends inside a block."""
        if not self.enable_prefix_caching:
            return num_computed
        table, hashes, bs = self.tables[seq_id], self._hashes[seq_id], self.block_size
        if num_computed != len(table) * bs or len(hashes) != len(table):
            return num_computed
        for i in range(len(table), (len(token_ids) - 1) // bs):
            key = block_hash(hashes[-1] if hashes else salt, token_ids[i * bs : (i + 1) * bs])
            block = self.pool.lookup(key)
            if block is None:
                break
            self.pool.incref([block])
            table.append(block)
            hashes.append(key)
        return len(table) * bs

    def record_prefix_match(self, num_tokens: int, num_cached: int) -> None:
        """Count one admitted sequence's prefix lookup in the hit-rate counters (a lookup whose sequence could not
        be admitted yet is repeated later and counted then)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_cached

    def cache_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int,
                     salt: bytes | None = None) -> None:
        """Index for prefix reuse the blocks of ``seq_id`` that are full once ``num_computed`` tokens are in the cache.

        The scheduler does this when it schedules a step, so a later sequence of the same step can share those
        blocks: every layer writes the whole step's keys and values before any of its attention reads them. If the
        step fails, :meth:`uncache_blocks` takes them back out of the index.
        """
        if not self.enable_prefix_caching:
            return
        hashes = self._hashes.setdefault(seq_id, [])
        table, bs = self.tables[seq_id], self.block_size
        for i in range(len(hashes), num_computed // bs):
            key = block_hash(hashes[-1] if hashes else salt, token_ids[i * bs : (i + 1) * bs])
            hashes.append(key)
            self.pool.cache(table[i], key)

    def uncache_blocks(self, seq_id: Hashable, num_computed: int) -> None:
        """Unindex the blocks of ``seq_id`` indexed beyond its first ``num_computed`` tokens."""
        hashes = self._hashes.get(seq_id)
        if not hashes:
            return
        keep = num_computed // self.block_size
        for block in self.tables[seq_id][keep : len(hashes)]:
            self.pool.uncache(block)
        del hashes[keep:]

    def fork(self, parent: Hashable, child: Hashable) -> None:
        """Let ``child`` share every block of ``parent``."""
        table = list(self.tables[parent])
        self.pool.incref(table)
        self.tables[child] = table
        self._hashes[child] = list(self._hashes.get(parent, []))

    def share_prefix(self, seq_id: Hashable, source: Hashable, num_tokens: int) -> None:
        """Let ``seq_id``, whose computed tokens are all among the first ``num_tokens`` tokens of ``source``, hold the
        whole blocks of those instead of its own (beams recomputed together)."""
        keep = num_tokens // self.block_size
        blocks = self.tables[source][:keep]
        self.pool.incref(blocks)
        self.free(seq_id)
        self.tables[seq_id] = list(blocks)
        self._hashes[seq_id] = list(self._hashes.get(source, [])[:keep])

    def select(self, sources: Sequence[Hashable]) -> None:
        """Renumber: sequence ``i`` becomes a sharer of the blocks of old sequence ``sources[i]``."""
        tables = [list(self.tables[source]) for source in sources]
        for table in tables:
            self.pool.incref(table)
        self.free_all()
        self.tables = dict(enumerate(tables))

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep only the blocks that hold the first ``num_tokens`` tokens."""
        table = self.tables[seq_id]
        keep = self.blocks_for(num_tokens)
        hashes = self._hashes.get(seq_id)
        if hashes is not None:
            full = num_tokens // self.block_size
            for block in table[full : min(keep, len(hashes))]:  # kept in part: its other rows will be overwritten
                self.pool.uncache(block)
            del hashes[full:]
        self.pool.free(table[keep:])
        del table[keep:]

    def free(self, seq_id: Hashable) -> None:
        """Release every block of ``seq_id`` (cached full blocks stay revivable until evicted)."""
        table = self.tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if table:
            self.pool.free(table)

    def reset_counters(self) -> None:
        """Start the prefix cache's query and hit counts again (the engine's start-up probe is not counted)."""
        self.prefix_queries = self.prefix_hits = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False, nothing changed) while a sequence holds blocks."""
        if self.pool.num_used_blocks:
            return False
        self.pool.reset()
        return True

    def free_all(self) -> None:
        for seq_id in list(self.tables):
            self.free(seq_id)
