"""Property-based test of `BlockPool` + `KVCacheManager`: random programs of allocate, grow, fork, copy-on-write,
prefix matching and caching, failed steps, truncate and free, with every invariant checked after every rule.

A shadow copy of the KV cache (``written[block][row] = token``) plays the model's part: a step "writes" the tokens
it computes into the rows its block table names, copy-on-write copies rows, and the invariants check that every
sequence reads back its own tokens, that reference counts are exactly the block tables' references, and that the
prefix index points only at full blocks whose content is what their hash says. Hypothesis prints the failing
program (and a ``@reproduce_failure`` blob) when an invariant breaks.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, multiple, precondition, rule

from hf_paged.cache import BlockPool, KVCacheManager
from hf_paged.cache.kv_cache_manager import block_hash

BLOCK_SIZE = 4
NUM_BLOCKS = 24
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=6)  # a small alphabet: prefixes collide often


class KVCacheMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BLOCK_SIZE)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching=True)
        self.tokens: dict[int, list[int]] = {}  # every live sequence's tokens ...
        self.computed: dict[int, int] = {}  # ... and how many of them are in the cache
        self.written: dict[int, dict[int, int]] = {}  # the shadow KV cache: block -> row -> token
        self.prefixes: dict[bytes, tuple[int, ...]] = {}  # chain hash -> the tokens it stands for
        self.next_id = 0

    # ----------------------------------------------------------------------------------------------- helpers
    def _snapshot(self):
        return list(self.pool.ref_counts), list(self.pool._free), {k: list(v) for k, v in self.kv.tables.items()}

    def _learn_prefixes(self, tokens: list[int]) -> None:
        parent = None
        for i in range(len(tokens) // BLOCK_SIZE):
            parent = block_hash(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            self.prefixes[parent] = tuple(tokens[:(i + 1) * BLOCK_SIZE])

    def _compute(self, seq: int, n: int, fail: bool = False) -> None:
        """One scheduled step of ``n`` tokens: make room, index what will be full, write (or fail and roll back)."""
        start = self.computed[seq]
        end = min(start + n, len(self.tokens[seq]))
        before = self._snapshot()
        copies = self.kv.allocate(seq, start, end)
        if copies is None:
            assert self._snapshot() == before, "a refused allocation changed the pool"
            return
        for src, dst in copies:
            self.written[dst] = dict(self.written.get(src, {}))
        self.kv.cache_blocks(seq, self.tokens[seq], end)
        if fail:  # the forward raised: nothing was written, the blocks indexed for it must leave the index
            self.kv.uncache_blocks(seq, start)
            return
        table = self.kv.block_table(seq)
        for p in range(start, end):
            self.written.setdefault(table[p // BLOCK_SIZE], {})[p % BLOCK_SIZE] = self.tokens[seq][p]
        self.computed[seq] = end

    # ------------------------------------------------------------------------------------------------- rules
    @rule(target=seqs, tokens=TOKENS, repeat=st.integers(1, 4), chunk=st.integers(1, 12))
    def add(self, tokens, repeat, chunk):
        seq, self.next_id = self.next_id, self.next_id + 1
        self.tokens[seq] = tokens * repeat
        self._learn_prefixes(self.tokens[seq])
        self.computed[seq] = self.kv.match_prefix(seq, self.tokens[seq])
        assert self.computed[seq] < len(self.tokens[seq])
        self._compute(seq, chunk)
        return seq

    @rule(seq=seqs, chunk=st.integers(1, 12), fail=st.booleans())
    def compute(self, seq, chunk, fail):
        if seq in self.tokens and self.computed[seq] < len(self.tokens[seq]):
            self._compute(seq, chunk, fail)

    @rule(seq=seqs, new=TOKENS)
    def append(self, seq, new):
        """Sampled tokens join the sequence (computed by a later step)."""
        if seq in self.tokens and self.computed[seq] == len(self.tokens[seq]):
            self.tokens[seq] += new
            self._learn_prefixes(self.tokens[seq])

    @rule(target=seqs, parent=seqs)
    def fork(self, parent):
        if parent not in self.tokens or parent not in self.kv.tables:
            return multiple()
        child, self.next_id = self.next_id, self.next_id + 1
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent][:self.computed[parent]])
        self.computed[child] = self.computed[parent]
        return child

    @rule(seq=seqs, keep=st.integers(0, 40))
    def truncate(self, seq, keep):
        if seq in self.tokens and seq in self.kv.tables:
            keep = min(keep, self.computed[seq])
            self.kv.truncate(seq, keep)
            self.tokens[seq], self.computed[seq] = self.tokens[seq][:keep], keep

    @rule(seq=consumes(seqs))
    def free(self, seq):
        """Finished or aborted (or preempted: recomputed later as a new sequence)."""
        if seq in self.tokens:
            self.kv.free(seq)
            del self.tokens[seq], self.computed[seq]

    @precondition(lambda self: self.pool.num_free_blocks < NUM_BLOCKS // 4)
    @rule()
    def free_oldest(self):
        """Keep the pool from filling up for good, so allocation and eviction keep happening."""
        self.free(min(self.tokens))

    # -------------------------------------------------------------------------------------------- invariants
    @invariant()
    def reference_counts_are_table_references(self):
        references = Counter(block for table in self.kv.tables.values() for block in table)
        assert self.pool.ref_counts == [references[b] for b in range(NUM_BLOCKS)]
        for table in self.kv.tables.values():
            assert len(set(table)) == len(table), "a table lists a block twice"

    @invariant()
    def free_and_used_blocks_add_up(self):
        free = set(self.pool._free)
        assert len(free) == len(self.pool._free) == self.pool.num_free_blocks
        assert free == {b for b in range(NUM_BLOCKS) if self.pool.ref_counts[b] == 0}
        assert self.pool.num_free_blocks + self.pool.num_used_blocks == NUM_BLOCKS

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq, tokens in self.tokens.items():
            table = self.kv.block_table(seq)
            assert len(table) * BLOCK_SIZE >= self.computed[seq]
            for p in range(self.computed[seq]):
                assert self.written[table[p // BLOCK_SIZE]].get(p % BLOCK_SIZE) == tokens[p], (seq, p)

    @invariant()
    def the_prefix_index_points_at_full_blocks_that_match(self):
        index = self.pool._hash_to_block
        assert len(index) == sum(h is not None for h in self.pool.block_hashes)
        for key, block in index.items():
            assert self.pool.block_hashes[block] == key
            tokens = self.prefixes[key]
            rows = self.written.get(block, {})
            assert [rows.get(r) for r in range(BLOCK_SIZE)] == list(tokens[-BLOCK_SIZE:]), (block, tokens)


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_cache_invariants = KVCacheMachine.TestCase
