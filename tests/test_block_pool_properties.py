"""Property-based tests of `BlockPool` + `KVCacheManager`, and of the `Scheduler` over them: random programs of
allocate, grow, fork, copy-on-write, prefix matching and caching, failed steps, truncate and free (and requests that
arrive, step, preempt, fork n > 1, abort and roll back), with every invariant checked after every rule.

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
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, precondition,
                                 rule)

from hf_paged.cache import BlockPool, KVCacheManager
from hf_paged.cache.kv_cache_manager import block_hash
from hf_paged.generation import EngineConfig, SamplingParams
from hf_paged.generation.detokenizer import Detokenizer
from hf_paged.generation.sampler import SamplerOutput
from hf_paged.generation.scheduler import Scheduler
from hf_paged.generation.sequence import Request, SequenceStatus

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
        learn_prefixes(self.prefixes, self.tokens[seq])
        self.computed[seq] = self.kv.match_prefix(seq, self.tokens[seq])
        assert self.computed[seq] < len(self.tokens[seq])
        self._compute(seq, chunk)
        return seq

    @rule(seq=seqs, chunk=st.integers(1, 12), fail=st.booleans())
    def compute(self, seq, chunk, fail):
        if seq in self.tokens and self.computed[seq] < len(self.tokens[seq]):
            self._compute(seq, chunk, fail)

    @rule(seq=seqs)
    def extend(self, seq):
        """A prompt computed in chunks takes the cached blocks that continue what it holds."""
        if seq in self.tokens and seq in self.kv.tables:
            self.computed[seq] = self.kv.extend_prefix(seq, self.tokens[seq], self.computed[seq])

    @rule(seq=seqs, new=TOKENS)
    def append(self, seq, new):
        """Sampled tokens join the sequence (computed by a later step)."""
        if seq in self.tokens and self.computed[seq] == len(self.tokens[seq]):
            self.tokens[seq] += new
            learn_prefixes(self.prefixes, self.tokens[seq])

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
    def blocks_are_accounted_for(self):
        check_accounting(self.kv)

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        for seq, tokens in self.tokens.items():
            check_reads(self.kv, self.written, seq, tokens, self.computed[seq])

    @invariant()
    def the_prefix_index_points_at_full_blocks_that_match(self):
        check_prefix_index(self.kv.pool, self.written, self.prefixes)


def check_accounting(kv: KVCacheManager) -> None:
    """Reference counts are exactly the block tables' references; the free blocks are exactly the unreferenced."""
    pool = kv.pool
    references = Counter(block for table in kv.tables.values() for block in table)
    assert pool.ref_counts == [references[b] for b in range(pool.num_blocks)]
    for table in kv.tables.values():
        assert len(set(table)) == len(table), "a table lists a block twice"
    free = set(pool._free)
    assert len(free) == len(pool._free) == pool.num_free_blocks
    assert free == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


def check_reads(kv: KVCacheManager, written: dict, seq_id, tokens: list[int], num_computed: int) -> None:
    """The cache rows a sequence's table names hold its own tokens, for every token it has computed."""
    table = kv.block_table(seq_id)
    assert len(table) * BLOCK_SIZE >= num_computed
    for p in range(num_computed):
        assert written[table[p // BLOCK_SIZE]].get(p % BLOCK_SIZE) == tokens[p], (seq_id, p)


def check_prefix_index(pool: BlockPool, written: dict, prefixes: dict) -> None:
    """The prefix index points only at full blocks whose rows are the tokens their chain hash stands for."""
    index = pool._hash_to_block
    assert len(index) == sum(h is not None for h in pool.block_hashes)
    for key, block in index.items():
        assert pool.block_hashes[block] == key
        rows = written.get(block, {})
        assert [rows.get(r) for r in range(BLOCK_SIZE)] == list(prefixes[key][-BLOCK_SIZE:]), block


def learn_prefixes(prefixes: dict, tokens: list[int]) -> None:
    """Remember what every full-block chain hash of ``tokens`` stands for."""
    parent = None
    for i in range(len(tokens) // BLOCK_SIZE):
        parent = block_hash(parent, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        prefixes[parent] = tuple(tokens[:(i + 1) * BLOCK_SIZE])


EOS = 2


class FakeTokenizer:
    """Token ``t`` reads as ``"<t>"``."""

    all_special_ids = [EOS]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids if not (skip_special_tokens and t == EOS))


class SchedulerMachine(RuleBasedStateMachine):
    """The `Scheduler` over the same pool, driven like the engine: requests arrive (n up to 3), steps run with fake
    sampled tokens (EOS among them) or fail and roll back, requests are aborted, under a long-prefill cap or none. A
    step "writes" what it computes into the shadow KV cache, so preemption, forks, copy-on-write and prefix reuse
    (prompts taking each other's chunks among it) are all checked by what every sequence reads back."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(BlockPool(NUM_BLOCKS, BLOCK_SIZE), enable_prefix_caching=True)
        config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=6, max_num_batched_tokens=16)
        self.scheduler = Scheduler(config, self.kv, Detokenizer(FakeTokenizer()), max_model_len=48)
        self.requests: list[Request] = []
        self.written: dict[int, dict[int, int]] = {}
        self.prefixes: dict[bytes, tuple[int, ...]] = {}

    @initialize(threshold=st.sampled_from([0, 3, 4]))
    def cap(self, threshold):
        self.scheduler.config = self.scheduler.config.replace(long_prefill_token_threshold=threshold)

    @rule(prompt=TOKENS, repeat=st.integers(1, 4), n=st.integers(1, 3), max_tokens=st.integers(1, 8))
    def add(self, prompt, repeat, n, max_tokens):
        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=0)
        request = Request(f"r{len(self.requests)}", None, prompt * repeat, params, seed=0,
                          eos_token_ids=frozenset({EOS}))
        learn_prefixes(self.prefixes, request.prompt_token_ids)
        self.requests.append(request)
        self.scheduler.add(request)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), tail=TOKENS)
    def add_alike(self, data, tail):
        """A prompt that starts as an earlier one does (a shared system prompt), often arriving beside it."""
        earlier = data.draw(st.sampled_from(self.requests))
        self.add((earlier.prompt_token_ids + tail)[:30], 1, 1, data.draw(st.integers(1, 8)))

    @precondition(lambda self: self.scheduler.has_work())
    @rule(tokens=st.lists(st.integers(0, 3), min_size=64, max_size=64), fail=st.booleans())
    def step(self, tokens, fail):
        out = self.scheduler.schedule()
        for src, dst in out.block_copies:
            self.written[dst] = dict(self.written.get(src, {}))
        if fail:  # the forward raised before writing anything
            self.scheduler.rollback(out)
            return
        for seq, n in zip(out.seqs, out.num_tokens):
            table = self.kv.block_table(seq.seq_id)
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.written.setdefault(table[p // BLOCK_SIZE], {})[p % BLOCK_SIZE] = seq.token_ids[p]
        sampled = SamplerOutput([tokens[i % len(tokens)] for i in range(len(out.draws))]) if out.draws else None
        for request in self.scheduler.update(out, sampled):
            for seq in request.seqs:
                learn_prefixes(self.prefixes, seq.token_ids)

    @precondition(lambda self: any(not r.is_finished for r in self.requests))
    @rule(data=st.data())
    def abort(self, data):
        live = [r for r in self.requests if not r.is_finished]
        request = data.draw(st.sampled_from(live))
        self.scheduler.abort(request)
        assert request.is_finished, "an aborted request must be finished (else the engine keeps it forever)"

    @invariant()
    def blocks_are_accounted_for(self):
        check_accounting(self.kv)
        check_prefix_index(self.kv.pool, self.written, self.prefixes)
        seats = sum(seq.num_samples for seq in self.scheduler.running)
        assert seats <= self.scheduler.config.max_num_seqs

    @invariant()
    def sequences_hold_blocks_exactly_while_they_run(self):
        live = {seq.seq_id for seq in self.scheduler.running}
        assert set(self.kv.tables) == live, "a waiting or finished sequence holds blocks, or a running one none"
        for seq in self.scheduler.running:
            check_reads(self.kv, self.written, seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        for seq in self.scheduler.waiting:
            assert seq.num_computed_tokens == 0 and seq.status is SequenceStatus.WAITING

    def teardown(self):
        """Whatever was left runs to its end: every request finishes and every block comes back."""
        for _ in range(400):
            if not self.scheduler.has_work():
                break
            self.step([3] * 64, fail=False)
        assert not self.scheduler.has_work(), "the scheduler never finished"
        assert all(r.is_finished for r in self.requests)
        assert self.kv.pool.num_used_blocks == 0 and not self.kv.tables


SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
KVCacheMachine.TestCase.settings = SETTINGS
SchedulerMachine.TestCase.settings = settings(SETTINGS, max_examples=100)
test_kv_cache_invariants = KVCacheMachine.TestCase
test_scheduler_invariants = SchedulerMachine.TestCase
