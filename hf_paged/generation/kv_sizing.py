"""How large the engine's KV cache is: its bytes from the engine's options (vLLM's settings included), checked
against the machine, and the `PagedKVStorage` of that many blocks."""

from __future__ import annotations

import logging
import os

import torch

from ..cache import KVCacheSpec, PagedKVStorage
from ..distributed import is_tensor_parallel, smallest_over_ranks
from .config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_MEMORY = 2 << 30
CPU_KV_SPACE_VARIABLE = "VLLM_CPU_KVCACHE_SPACE"


def cpu_kv_space() -> int | None:
    """vLLM's ``$VLLM_CPU_KVCACHE_SPACE``: the CPU KV cache's size in GiB (None when unset or 0, vLLM's default)."""
    text = os.environ.get(CPU_KV_SPACE_VARIABLE, "").strip()
    try:
        gib = float(text or 0)
    except ValueError:
        gib = -1
    if gib < 0:
        raise ValueError(f"${CPU_KV_SPACE_VARIABLE} is the CPU KV cache's size in GiB, not {text!r}")
    return int(gib * 2**30) or None


def kv_memory(config: EngineConfig, device: torch.device) -> int | None:
    """The KV cache's bytes: ``kv_cache_memory``, else (unless ``num_blocks`` sizes it) on CPU
    ``$VLLM_CPU_KVCACHE_SPACE`` GiB or 2 GiB, on GPU what ``gpu_memory_utilization`` leaves of the device's memory
    with everything on it now (the loaded model's weights, other processes), or half the free memory."""
    if config.num_blocks is not None or config.kv_cache_memory is not None:
        return config.kv_cache_memory
    if device.type != "cuda":
        return cpu_kv_space() or DEFAULT_CPU_KV_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    utilization = config.gpu_memory_utilization
    if utilization is None:
        return free // 2
    left = int(utilization * total) - (total - free)
    if left <= 0:
        raise ValueError(f"EngineConfig.gpu_memory_utilization={utilization} allows {utilization * total / 2**30:.3g} "
                         f"GiB of the GPU, but {(total - free) / 2**30:.3g} GiB are in use already (the weights, "
                         "other processes): nothing is left for the KV cache")
    return left


def kv_storage_for(model: torch.nn.Module, config: EngineConfig) -> PagedKVStorage:
    """The engine's KV cache for ``model``, allocated; under tensor parallelism every rank holds as many blocks as
    the rank with the fewest (each GPU's free memory), so that they all schedule alike."""
    memory = kv_memory(config, model.device)
    if config.gpu_memory_utilization is not None and model.device.type != "cuda":
        logger.info("gpu_memory_utilization is ignored on %s (as vLLM's CPU backend ignores it): the KV cache "
                    "takes kv_cache_memory, $%s GiB or 2 GiB", model.device.type, CPU_KV_SPACE_VARIABLE)
    dtype = config.kv_dtype(model.dtype)
    spec = KVCacheSpec.from_model(model)
    if config.num_blocks is not None:
        _check_memory(config.num_blocks * spec.bytes_per_block(config.block_size, dtype), "EngineConfig.num_blocks",
                      model.device)
    elif config.kv_cache_memory is not None:  # the default is the caller's to size, not this machine's to refuse
        _check_memory(memory, "EngineConfig.kv_cache_memory", model.device)
    elif model.device.type == "cpu" and cpu_kv_space() is not None:
        _check_memory(memory, f"${CPU_KV_SPACE_VARIABLE}", model.device)

    def make(blocks: int | None, budget: int | None) -> PagedKVStorage:
        return PagedKVStorage(model.config, num_blocks=blocks, block_size=config.block_size, memory_budget=budget,
                              dtype=dtype, device=model.device, spec=spec)

    storage = make(config.num_blocks, memory)
    if is_tensor_parallel(model):
        fewest = smallest_over_ranks(storage.num_blocks, model.device)
        storage = storage if fewest == storage.num_blocks else make(fewest, None)
    storage.allocate(dtype, model.device)
    return storage


def _check_memory(size: int, option: str, device: torch.device) -> None:
    """Refuse a KV cache larger than the machine's memory (on CPU; a GPU's allocator says so itself): the zeroed
    blocks would be overcommitted, then the process killed, or a bare MemoryError raised."""
    if device.type != "cpu":
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if size > total:
        raise ValueError(f"{option} asks for a {size / 2**30:.3g} GiB KV cache, more than this machine's "
                         f"{total / 2**30:.3g} GiB of memory")
