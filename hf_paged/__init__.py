"""hf_paged: PagedAttention and continuous batching for Hugging Face causal LMs.

``import hf_paged`` registers ``attn_implementation="paged"`` with Transformers.
"""

from .cache import BlockPool, KVCacheManager, NoFreeBlocksError, PagedCache
from .integration import ATTN_IMPLEMENTATION, register, uses_paged_attention

register()

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockPool",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PagedCache",
    "uses_paged_attention",
]
