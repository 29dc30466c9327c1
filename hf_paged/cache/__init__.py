"""KV cache storage: the block pool, per-sequence block tables, the per-layer block tensors, one step's metadata,
and the Transformers-facing `PagedCache` that `generate` uses."""

from .block_pool import DEFAULT_BLOCK_SIZE, BlockPool, NoFreeBlocksError
from .kv_cache_manager import KVCacheManager, combined_salt
from .kv_storage import KVCacheSpec, PagedKVStorage, unpaged_layer_types
from .metadata import PagedMetadata
from .paged_cache import PagedCache

__all__ = [
    "DEFAULT_BLOCK_SIZE", "BlockPool", "NoFreeBlocksError", "KVCacheManager", "KVCacheSpec", "PagedCache",
    "PagedKVStorage", "PagedMetadata", "combined_salt", "unpaged_layer_types",
]
