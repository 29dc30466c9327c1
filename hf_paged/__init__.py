"""hf_paged: PagedAttention and continuous batching for Hugging Face causal LMs.

``import hf_paged`` registers ``attn_implementation="paged"`` with Transformers.
"""

import logging

# torchao (pulled in by the quantization extra) warns about enum registration on every import; not actionable here.
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)

from .cache import BlockPool, KVCacheManager, NoFreeBlocksError, PagedCache, PagedKVStorage
from .integration import ATTN_IMPLEMENTATION, register, uses_paged_attention

register()

from .generation import (  # noqa: E402  (after registration: the generator relies on it)
    BeamSearchOutput,
    BeamSearchParams,
    CompletionOutput,
    ContinuousBatchGenerator,
    EngineConfig,
    EngineStats,
    InvalidParameter,
    Logprob,
    RequestOutput,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

from .async_llm import AsyncLLM  # noqa: E402
from .engine_args import AsyncEngineArgs, EngineArgs  # noqa: E402
from .llm import LLM  # noqa: E402
from .lora import LoRARequest  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "AsyncEngineArgs",
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BlockPool",
    "CompletionOutput",
    "ContinuousBatchGenerator",
    "EngineArgs",
    "EngineConfig",
    "EngineStats",
    "InvalidParameter",
    "LLM",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "KVCacheManager",
    "NoFreeBlocksError",
    "PagedCache",
    "PagedKVStorage",
    "uses_paged_attention",
]
