"""The KV block tensors and their size."""

import torch
from transformers import LlamaConfig

from hf_paged.cache import PagedKVStorage

CONFIG = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4)


def test_growing_keeps_the_blocks_and_adds_zeros():
    storage = PagedKVStorage(CONFIG, num_blocks=4, dtype=torch.float32, device="cpu")
    storage.allocate(torch.float32, torch.device("cpu"))
    storage.key_cache[1][2] = 7.0
    storage.grow(3)
    assert storage.key_cache[1].shape[0] == 7 and storage.pool.num_blocks == 7
    assert storage.key_cache[1][2].eq(7).all() and storage.key_cache[1][4:].eq(0).all()
    assert storage.key_cache[0].abs().sum() == 0


def test_kv_memory_from_vllms_settings(monkeypatch):
    """gpu_memory_utilization sizes a GPU cache from what the loaded model and other processes leave of the device
    (ignored on CPU, as vLLM's CPU backend); $VLLM_CPU_KVCACHE_SPACE sizes a CPU cache in GiB."""
    import pytest

    from hf_paged.generation import EngineConfig
    from hf_paged.generation.kv_sizing import kv_memory

    gib = 1 << 30
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * gib, 16 * gib))
    assert kv_memory(EngineConfig(), cuda) == 3 * gib  # half the free memory
    assert kv_memory(EngineConfig(gpu_memory_utilization=0.9), cuda) == int(0.9 * 16 * gib) - 10 * gib
    with pytest.raises(ValueError, match="10 GiB are in use already"):
        kv_memory(EngineConfig(gpu_memory_utilization=0.5), cuda)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    assert kv_memory(EngineConfig(gpu_memory_utilization=0.5), cpu) == 2 * gib
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    assert kv_memory(EngineConfig(), cpu) == int(1.5 * gib)
    assert kv_memory(EngineConfig(kv_cache_memory="1MiB"), cpu) == 1 << 20  # the option wins
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")  # vLLM's "default"
    assert kv_memory(EngineConfig(), cpu) == 2 * gib
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match=r"\$VLLM_CPU_KVCACHE_SPACE is the CPU KV cache's size in GiB"):
        kv_memory(EngineConfig(), cpu)
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization is a fraction"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="not num_blocks and gpu_memory_utilization"):
        EngineConfig(num_blocks=4, gpu_memory_utilization=0.9)
