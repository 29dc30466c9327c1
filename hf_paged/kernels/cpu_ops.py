"""Native CPU paged attention: ``cpu_attention.cpp`` in the native library (`native`), called through ctypes.

It reads each sequence's keys and values in place through its block table, so a decode step touches every cached
token once instead of copying the blocks into a contiguous batch first (as the torch path does). It serves decode
rows and prefill chunks up to `max_query_len`, and stores the step's new keys and values in the same call; longer
chunks are faster through torch's SDPA. Without a compiler `available()` is False and the dispatcher keeps the torch
path.
"""

from __future__ import annotations

import ctypes

import torch

from . import native

MAX_NATIVE_QUERY_LEN = 128  # longer prefill chunks go to torch's SDPA, whose matrix multiplies win there
# bf16 with the kernel's AVX512-BF16 score path: as fast as SDPA or faster on chunks up to this long (512 rows: 3.4
# against 4.9 ms over 512 keys, even over 1024; SDPA wins from about 4 keys per row).
MAX_NATIVE_QUERY_LEN_BF16_DOT = 512
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# What the kernel's index checks (check_indices in cpu_attention.cpp) found, by status.
INDEX_ERRORS = {
    3: "query_start_loc does not cover the query rows",
    4: "query_start_loc must not decrease",
    5: "a sequence is longer than its block table holds",
    6: "a block table lists a block outside 0..{last_block}",
    7: "slot_mapping names a slot outside the cache",
}
_library: ctypes.CDLL | None = None


class _Problem(ctypes.Structure):
    _fields_ = [
        ("query", ctypes.c_void_p), ("q_stride_token", ctypes.c_int64), ("q_stride_head", ctypes.c_int64),
        ("query_start_loc", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
        ("c_stride_block", ctypes.c_int64), ("c_stride_row", ctypes.c_int64), ("c_stride_head", ctypes.c_int64),
        ("block_tables", ctypes.c_void_p), ("bt_stride", ctypes.c_int64), ("seq_lens", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("num_seqs", ctypes.c_int32), ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("block_size", ctypes.c_int32),
        ("num_tokens", ctypes.c_int32), ("num_blocks", ctypes.c_int32), ("bt_width", ctypes.c_int32),
        ("scale", ctypes.c_float), ("sliding_window", ctypes.c_int32), ("softcap", ctypes.c_float),
        ("num_threads", ctypes.c_int32),
        ("key", ctypes.c_void_p), ("value", ctypes.c_void_p),
        ("k_stride_token", ctypes.c_int64), ("k_stride_head", ctypes.c_int64),
        ("v_stride_token", ctypes.c_int64), ("v_stride_head", ctypes.c_int64),
        ("slot_mapping", ctypes.c_void_p), ("prompt_rows", ctypes.c_void_p), ("sinks", ctypes.c_void_p),
    ]


def _bind(library: ctypes.CDLL) -> None:
    library.hf_paged_attention.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int]
    library.hf_paged_has_bf16_dot.argtypes = [ctypes.c_int]
    library.hf_paged_tile_attention.argtypes = [ctypes.c_int]
    if library.hf_paged_problem_size() != ctypes.sizeof(_Problem):
        raise RuntimeError("cpu_attention.cpp and cpu_ops.py disagree on the problem layout")


def available() -> bool:
    """Whether the native library is built and loaded (builds it on first call)."""
    global _library
    _library = _library or native.bound(_bind)
    return _library is not None


def max_query_len(dtype: torch.dtype, head_dim: int) -> int:
    """The longest prefill chunk the native kernel takes for this dtype and head size (longer ones go to SDPA)."""
    if dtype == torch.bfloat16 and available() and _library.hf_paged_has_bf16_dot(head_dim):
        return MAX_NATIVE_QUERY_LEN_BF16_DOT
    return MAX_NATIVE_QUERY_LEN


def tile_attention(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prompt rows of this dtype and head size take AMX tiles (``cpu_tile_attention.cpp``): bf16, head_dim a
    multiple of 32 up to 256, on a CPU with AMX."""
    return dtype == torch.bfloat16 and available() and bool(_library.hf_paged_tile_attention(head_dim))


def _fits(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """CPU tensors, fp32 or bf16 alike, head_dim contiguous, K and V laid out alike: what the kernel's pointer
    arithmetic assumes."""
    return (
        query.device.type == k_cache.device.type == v_cache.device.type == "cpu"
        and query.dtype in _DTYPES
        and k_cache.dtype == v_cache.dtype == query.dtype
        and query.stride(-1) == 1
        and k_cache.stride(-1) == 1
        and k_cache.stride() == v_cache.stride()
    )


def supports(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether these tensors can take the native kernel (see `_fits`), and the kernel is built."""
    return _fits(query, k_cache, v_cache) and available()


def _int32(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.int32 and tensor.numel():
        if not -(2**31) <= int(tensor.min()) <= int(tensor.max()) < 2**31:
            raise ValueError(f"paged attention: {name} holds values outside int32")
    return tensor.to(torch.int32).contiguous()


def _attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
               sinks=None, new_kv=None, prompt_rows=None):
    if _library is None and not available():
        raise RuntimeError("the native CPU attention kernel is not available (see the warning above)")
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype)
    if num_tokens == 0:
        return out
    # The kernel reads and writes raw memory: refuse what it would misread (layouts, inconsistent shapes, tables
    # that point outside the cache) instead of crashing the process or returning garbage.
    if not _fits(query, k_cache, v_cache):
        raise ValueError("paged attention: the native kernel takes CPU fp32/bf16 queries and caches of one dtype, "
                         "K and V laid out alike, with contiguous head_dim")
    if seq_lens.numel() == 0:
        raise ValueError(f"paged attention: {num_tokens} query rows but no sequences")
    block_tables = _int32("block_tables", block_tables)
    seq_lens = _int32("seq_lens", seq_lens)
    query_start_loc = _int32("query_start_loc", query_start_loc)
    num_seqs = seq_lens.numel()
    if v_cache.shape != k_cache.shape or k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
        raise ValueError(f"paged attention: queries {tuple(query.shape)} do not fit the cache {tuple(k_cache.shape)} "
                         f"(values {tuple(v_cache.shape)})")
    if block_tables.dim() != 2 or block_tables.shape[0] < num_seqs or query_start_loc.numel() != num_seqs + 1:
        raise ValueError("paged attention: block_tables and query_start_loc need a row per sequence")
    problem = _Problem(
        query.data_ptr(), query.stride(0), query.stride(1), query_start_loc.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        num_tokens, k_cache.shape[0], block_tables.shape[1],
        scale, sliding_window or 0, softcap or 0.0,
        torch.get_num_threads(),
    )
    held = []  # tensors whose memory the problem points into, alive until the call returns
    if new_kv is not None:
        held.append(_new_kv(problem, *new_kv, k_cache))
    if prompt_rows is not None:
        held.append(_prompt_rows(prompt_rows, num_tokens))
        problem.prompt_rows = held[-1].data_ptr()
    if sinks is not None:
        held.append(_sinks(sinks, num_heads))
        problem.sinks = held[-1].data_ptr()
    status = _library.hf_paged_attention(ctypes.byref(problem), _DTYPES[query.dtype])
    if status in INDEX_ERRORS:
        raise ValueError("paged attention: " + INDEX_ERRORS[status].format(last_block=k_cache.shape[0] - 1))
    if status != 0:
        raise RuntimeError(f"native paged attention failed with status {status}")
    return out


def _new_kv(problem: _Problem, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
            k_cache: torch.Tensor) -> torch.Tensor:
    """Point ``problem`` at the step's new keys and values, stored into their slots before any query reads the cache;
    returns the slot mapping it points into."""
    num_tokens = problem.num_tokens
    slot_mapping = slot_mapping.to(torch.int64).contiguous()
    rows = (num_tokens, k_cache.shape[2], k_cache.shape[3])
    if key.shape != rows or value.shape != rows or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"paged attention: new keys {tuple(key.shape)} / values {tuple(value.shape)} / slots "
                         f"{tuple(slot_mapping.shape)} do not match {num_tokens} query rows of {rows[1:]}")
    if key.dtype != k_cache.dtype or value.dtype != k_cache.dtype or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("paged attention: new keys/values must have the cache's dtype and contiguous head_dim")
    problem.key, problem.value, problem.slot_mapping = key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr()
    problem.k_stride_token, problem.k_stride_head = key.stride(0), key.stride(1)
    problem.v_stride_token, problem.v_stride_head = value.stride(0), value.stride(1)
    return slot_mapping


def _sinks(sinks: torch.Tensor, num_heads: int) -> torch.Tensor:
    if sinks.shape != (num_heads,):
        raise ValueError(f"paged attention: sinks must be one logit per query head ({num_heads}), got "
                         f"{tuple(sinks.shape)}")
    return sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _prompt_rows(prompt_rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if prompt_rows.dtype != torch.bool or prompt_rows.shape != (num_tokens,):
        raise ValueError(f"paged attention: prompt_rows must be one bool per query row ({num_tokens}), got "
                         f"{prompt_rows.dtype} {tuple(prompt_rows.shape)}")
    return prompt_rows.to(torch.uint8).contiguous()


def paged_attention(query, key, value, k_cache, v_cache, metadata, scale, sliding_window=None, softcap=None,
                    sinks=None):
    """Same contract as the dispatcher's `paged_attention`, in one native call: the kernel stores the new keys and
    values, then attends every row (decodes and prefill chunks alike). The caller checks `supports` and that no
    chunk is longer than `max_query_len`."""
    return _attention(query, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
                      scale, sliding_window, softcap, sinks, new_kv=(key, value, metadata.slot_mapping))


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `torch_ops.paged_decode_attention`; the caller checks `supports` first."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return _attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
                      sinks)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    prompt_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `torch_ops.paged_prefill_attention`. Each query row is attended on its own (no matrix
    multiply over a chunk), so the dispatcher sends only chunks up to `max_query_len` here. ``prompt_rows`` (bool, one
    per query row, or None) marks the prompt rows: each sequence's leading marked rows take AMX tiles in bf16 where
    `tile_attention` says so."""
    return _attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
                      sinks, prompt_rows=prompt_rows)
