"""Which replica most likely holds a prompt's first KV blocks.

A replica's prefix cache indexes full blocks by the SHA-256 chain of `block_hash`; the router computes the same
chain over the tokenized prompt and remembers, for each hash, the replica it last sent that block to. The deepest
hash of a prompt with a known replica names the replica that holds the longest prefix of it (as far as the router
knows: the replica may have evicted it since).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Hashable, Mapping, Sequence

from ..cache.kv_cache_manager import block_hash


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = 256,
                  salt: bytes | None = None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks (at most ``max_blocks``), as the engine's prefix cache keys
    them; ``salt`` is the first block's parent (a LoRA adapter's requests are cached apart from the base model's)."""
    hashes, parent = [], salt
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


class AffinityTable:
    """The replica each block hash was last routed to, for the ``capacity`` most recently routed hashes."""

    def __init__(self, capacity: int = 1 << 17):
        self.capacity = capacity
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()

    def best(self, hashes: Sequence[bytes], alive: Collection[Hashable]) -> tuple[Hashable | None, int]:
        """``(replica, blocks)``: the live replica that was sent the longest prefix of ``hashes``, and its length
        in blocks; ``(None, 0)`` when no live replica was sent even the first block."""
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner in alive:
                return owner, depth
        return None, 0

    def matched(self, hashes: Sequence[bytes], replica: Hashable) -> int:
        """How many leading blocks of ``hashes`` ``replica`` was sent last."""
        for depth in range(len(hashes), 0, -1):
            if self._owner.get(hashes[depth - 1]) == replica:
                return depth
        return 0

    def record(self, hashes: Sequence[bytes], replica: Hashable) -> None:
        """``replica`` now holds these blocks."""
        for key in hashes:
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """Drop every block of a replica that is gone."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]


def affinity_replica(table: AffinityTable, hashes: Sequence[bytes], in_flight: Mapping[Hashable, int],
                     max_imbalance: int) -> Hashable | None:
    """The replica a prompt goes to for its cached prefix, or None (balance the load instead): the live replica (a
    key of ``in_flight``, its requests in flight) that was sent the longest prefix of ``hashes``, if that prefix is
    most of the prompt (a short one, such as a chat template's default system prompt, that every request shares would
    send them all to one replica) and that replica has at most ``max_imbalance`` requests more than the least busy."""
    best, blocks = table.best(hashes, in_flight)
    if best is None or 2 * blocks <= len(hashes):
        return None
    return best if in_flight[best] - min(in_flight.values()) <= max_imbalance else None
