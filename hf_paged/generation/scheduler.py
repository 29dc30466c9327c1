"""First-come-first-served scheduling by token counts, with chunked prefill and preemption by recomputation."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..cache import KVCacheManager, NoFreeBlocksError
from ..cache.kv_cache_manager import BlockCopy
from .sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class ScheduledBatch:
    """What one step computes: ``num_tokens[i]`` new tokens of ``seqs[i]``, one-token sequences first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue for this step

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    """Decides, each step, how many tokens every sequence computes.

    A sequence never has phases: it has ``token_ids`` and ``num_computed_tokens``, and each step computes some of the
    difference. Running sequences go first (a decode is one token; a prompt being prefilled in chunks takes what
    the budget leaves), then waiting ones in arrival order. When blocks run out the newest running sequence is
    preempted: its blocks are freed and it waits to be recomputed (prefix caching usually makes that cheap).
    """

    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # steps in which a prompt was computed only in part (chunked prefill)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked sample: its blocks are already shared with its parent."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        picked: list[tuple[Sequence, int]] = []
        copies: list[BlockCopy] = []
        admitted: list[Sequence] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while True:
                try:
                    copies += self.kv.allocate(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n)
                    break
                except NoFreeBlocksError:
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
            if seq.status is SequenceStatus.RUNNING:
                self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
                picked.append((seq, n))
                budget -= n
        seats = sum(seq.num_samples for seq in self.running)  # n > 1 forks after the prompt
        while not preempted and self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats + seq.num_samples > self.config.max_num_seqs:
                break
            seq.num_computed_tokens = num_cached = self.kv.match_prefix(seq.seq_id, seq.token_ids)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            needed = self.kv.num_blocks_needed(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n)
            try:
                if self.running and self.kv.pool.num_free_blocks - needed < self._headroom():
                    raise NoFreeBlocksError(needed, self.kv.pool.num_free_blocks)
                copies += self.kv.allocate(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n)
            except NoFreeBlocksError:
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            self.kv.commit(seq.seq_id, seq.token_ids, seq.num_computed_tokens + n)
            self.kv.record_prefix_match(seq.num_tokens, num_cached)
            if seq.index == 0 and seq.request.num_cached_tokens == 0:
                seq.request.num_cached_tokens = num_cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += seq.num_samples
            admitted.append(seq)
            picked.append((seq, n))
            budget -= n
        self.num_partial_prefills += sum(n < s.num_tokens - s.num_computed_tokens for s, n in picked)
        picked.sort(key=lambda item: item[1] != 1)
        return ScheduledBatch([s for s, _ in picked], [n for _, n in picked], copies, admitted)

    def unadmit(self, seqs: list[Sequence]) -> None:
        """Undo the admission of ``seqs`` (a step that failed): free their blocks, back to the front of the queue."""
        for seq in reversed(seqs):
            if seq.status is SequenceStatus.RUNNING:
                self._requeue(seq)
                if seq.index == 0:
                    seq.request.num_cached_tokens = 0

    def _headroom(self) -> int:
        """Blocks kept free when admitting a new sequence, so running ones can grow without being preempted."""
        return len(self.running) // 2 + self.kv.pool.num_blocks // 100

    def _preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
