"""Paged-attention kernels with one dispatcher: Triton on GPUs; on CPUs the native kernel of `cpu_ops` (decode and
short prefill chunks, storing the new keys and values in the same call) when a C++ compiler is available, the torch
path otherwise and for long prefill chunks.

``HF_PAGED_KERNELS=torch`` (plain torch only) or ``=triton`` (``TRITON_INTERPRET=1`` on CPU) forces a path.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from . import cpu_ops, torch_ops

if TYPE_CHECKING:
    from ..cache.metadata import PagedMetadata

__all__ = ["paged_attention", "reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "use_triton"]


def _forced() -> str:
    return os.environ.get("HF_PAGED_KERNELS", "").lower()


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton path handles tensors on ``tensor``'s device."""
    if _forced() in ("torch", "triton"):
        return _forced() == "triton"
    return tensor.is_cuda


def _use_native(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return not use_triton(query) and _forced() != "torch" and cpu_ops.supports(query, k_cache, v_cache)


def _native_takes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, max_query_len: int) -> bool:
    """Whether the CPU library attends these rows: `_use_native` first, which is False at once on a GPU, where
    ``cpu_ops.max_query_len`` would build the CPU library."""
    return _use_native(query, k_cache, v_cache) and max_query_len <= cpu_ops.max_query_len(query.dtype,
                                                                                            query.shape[-1])


def _impl(tensor: torch.Tensor):
    if use_triton(tensor):
        from . import triton_ops

        return triton_ops
    return torch_ops


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"paged attention: sinks must be one logit per query head ({query.shape[1]}), got "
                         f"{tuple(sinks.shape)}")


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write new keys/values ``[T, Hkv, D]`` into their cache slots (``-1`` skips a token)."""
    _impl(key).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, softcap=None,
                           sinks=None):
    """One new token per sequence attending to its pages; see :mod:`hf_paged.kernels.torch_ops` for the layout.

    A cache in another dtype than the queries (``kv_cache_dtype``) is read in its own dtype: the queries are cast to
    it and the output back."""
    _check_sinks(sinks, query)
    q = query.to(k_cache.dtype)
    impl = cpu_ops if _use_native(q, k_cache, v_cache) else _impl(q)
    out = impl.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap,
                                      sinks)
    return out.to(query.dtype)


def paged_prefill_attention(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window=None,
    softcap=None, sinks=None,
):
    """Several new tokens per sequence attending causally to its pages; see :mod:`hf_paged.kernels.torch_ops`.
    Queries in another dtype than the cache are handled as in `paged_decode_attention`."""
    _check_sinks(sinks, query)
    q = query.to(k_cache.dtype)
    impl = cpu_ops if _native_takes(q, k_cache, v_cache, max_query_len) else _impl(q)
    out = impl.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window, softcap,
        sinks,
    )
    return out.to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: PagedMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's attention for a forward step: store the new ``key``/``value`` ``[T, Hkv, D]`` in their slots,
    then attend every query row ``[T, Hq, D]`` through the step's block tables (decodes first, then prefill chunks,
    as `PagedMetadata` packs them). Returns ``[T, Hq, D]``."""
    _check_sinks(sinks, query)
    q = query.to(k_cache.dtype)
    if key.stride(-1) == value.stride(-1) == 1 and _native_takes(q, k_cache, v_cache, metadata.max_query_len):
        out = cpu_ops.paged_attention(q, key.to(k_cache.dtype), value.to(k_cache.dtype), k_cache, v_cache, metadata,
                                      scale, sliding_window, softcap, sinks)
        return out.to(query.dtype)
    reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
    nd, num_tokens = metadata.num_decodes, query.shape[0]
    outputs = []
    if nd:
        outputs.append(paged_decode_attention(query[:nd], k_cache, v_cache, metadata.block_tables[:nd],
                                              metadata.seq_lens[:nd], scale, sliding_window, softcap, sinks))
    if nd < num_tokens:
        outputs.append(paged_prefill_attention(
            query[nd:], k_cache, v_cache, metadata.block_tables[nd:], metadata.seq_lens[nd:],
            metadata.query_start_loc[nd:] - nd, metadata.max_query_len, scale, sliding_window, softcap, sinks,
        ))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
