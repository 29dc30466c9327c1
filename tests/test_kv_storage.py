"""The KV block tensors: zeros that cost memory on CPU only as they are written."""

import torch
from transformers import LlamaConfig

from hf_paged.cache import PagedKVStorage

CONFIG = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4)


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_cpu_cache_takes_memory_only_as_its_blocks_are_written():
    before = resident_mib()
    storage = PagedKVStorage(CONFIG, memory_budget=1 << 30, dtype=torch.float32, device="cpu")
    storage.allocate(torch.float32, torch.device("cpu"))
    assert sum(t.numel() * 4 for t in storage.key_cache + storage.value_cache) > (1 << 30) - (1 << 20)
    assert resident_mib() - before < 64  # of 1024 MiB
    k_cache, v_cache = storage.layer(0, torch.zeros(1, 4, 1, 64))
    k_cache[3] = 1.5
    assert resident_mib() - before < 64
    assert k_cache[3].eq(1.5).all() and k_cache[2].eq(0).all() and k_cache[-1].eq(0).all() and v_cache[3].eq(0).all()
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):  # the dtypes kv_cache_dtype offers
        small = PagedKVStorage(CONFIG, num_blocks=4, dtype=dtype, device="cpu")
        small.allocate(dtype, torch.device("cpu"))
        assert small.key_cache[0].dtype == dtype and small.key_cache[0].float().eq(0).all()


def test_growing_keeps_the_blocks_and_adds_zeros():
    storage = PagedKVStorage(CONFIG, num_blocks=4, dtype=torch.float32, device="cpu")
    storage.allocate(torch.float32, torch.device("cpu"))
    storage.key_cache[1][2] = 7.0
    storage.grow(3)
    assert storage.key_cache[1].shape[0] == 7 and storage.pool.num_blocks == 7
    assert storage.key_cache[1][2].eq(7).all() and storage.key_cache[1][4:].eq(0).all()
    assert storage.key_cache[0].abs().sum() == 0
