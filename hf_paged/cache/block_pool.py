"""The pool of fixed-size KV blocks: free list, reference counts and the prefix-cache index."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_BLOCK_SIZE = 16  # tokens per block, wherever none is given


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are requested than the pool has free. The pool is left unchanged."""

    def __init__(self, requested: int, free: int):
        super().__init__(f"requested {requested} KV blocks but only {free} are free")
        self.requested = requested
        self.free = free


class BlockPool:
    """Hands out block ids ``0 .. num_blocks - 1``.

    Every block is in exactly one of three states: *used* (reference count > 0), *cached-free* (count 0 but its
    content is indexed by a prefix hash, so a later request may revive it) or *free*. Free and cached-free blocks sit
    in one queue in eviction order: plain free blocks at the front, cached ones behind them from least to most
    recently released, so allocation evicts the least recently used cached block only when no plain block is left.
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}

    def grow(self, n: int) -> None:
        """Add ``n`` free blocks (ids ``num_blocks ..``), first in line for allocation."""
        start = self.num_blocks
        self.num_blocks += n
        self.ref_counts += [0] * n
        self.block_hashes += [None] * n
        for block in reversed(range(start, start + n)):
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free and cached-free)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is indexed by a prefix hash (used or not)."""
        return len(self._hash_to_block)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks with reference count 1, evicting cached-free blocks if needed."""
        if n > len(self._free):
            raise NoFreeBlocksError(n, len(self._free))
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add a reference to each block (sharing, or reviving a cached-free block)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop a reference to each block. Pass a sequence's blocks in order: its tail is evicted first."""
        for block in reversed(blocks):
            count = self.ref_counts[block]
            if count <= 0:
                raise RuntimeError(f"block {block} freed more often than referenced")
            self.ref_counts[block] = count - 1
            if count == 1:
                self._free[block] = None
                if self.block_hashes[block] is None:
                    self._free.move_to_end(block, last=False)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the content identified by ``block_hash``, if it is still cached."""
        return self._hash_to_block.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> None:
        """Index a full block's content under ``block_hash`` (the first block with that content wins)."""
        if self.block_hashes[block] is None and block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block
            self.block_hashes[block] = block_hash

    def uncache(self, block: int) -> None:
        """Drop ``block`` from the prefix index (its content is not what its hash says)."""
        self._evict(block)

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            self.block_hashes[block] = None

    def reset(self) -> None:
        """Forget every allocation and every cached prefix."""
        self.__init__(self.num_blocks, self.block_size)
