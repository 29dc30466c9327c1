"""KV cache storage: the block pool, per-sequence block tables and the Transformers-facing `PagedCache`."""

from .block_pool import BlockPool, NoFreeBlocksError
from .kv_cache_manager import KVCacheManager
from .paged_cache import KVCacheSpec, PagedCache, PagedMetadata

__all__ = ["BlockPool", "NoFreeBlocksError", "KVCacheManager", "KVCacheSpec", "PagedCache", "PagedMetadata"]
