"""Paged-attention kernels: a Triton implementation for GPUs and a torch one for CPUs, with one dispatcher.

``HF_PAGED_KERNELS=torch`` or ``=triton`` forces a path (``triton`` on CPU needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import torch

from . import torch_ops

__all__ = ["reshape_and_cache", "paged_decode_attention", "paged_prefill_attention", "use_triton"]


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the Triton path handles tensors on ``tensor``'s device."""
    forced = os.environ.get("HF_PAGED_KERNELS", "").lower()
    if forced in ("torch", "triton"):
        return forced == "triton"
    return tensor.is_cuda


def _impl(tensor: torch.Tensor):
    if use_triton(tensor):
        from . import triton_ops

        return triton_ops
    return torch_ops


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write new keys/values ``[T, Hkv, D]`` into their cache slots (``-1`` skips a token)."""
    _impl(key).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window=None, softcap=None):
    """One new token per sequence attending to its pages; see :mod:`hf_paged.kernels.torch_ops` for the layout."""
    return _impl(query).paged_decode_attention(
        query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap
    )


def paged_prefill_attention(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window=None,
    softcap=None,
):
    """Several new tokens per sequence attending causally to its pages; see :mod:`hf_paged.kernels.torch_ops`."""
    return _impl(query).paged_prefill_attention(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, sliding_window, softcap
    )
