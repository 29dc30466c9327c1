"""Triton paged attention: the GPU path, with the same signatures and semantics as :mod:`.torch_ops`.

The cache layout and the masking rule are described in :mod:`hf_paged.kernels.torch_ops`. In short: token ``i`` of
sequence ``s`` lives at row ``i % block_size`` of block ``block_tables[s, i // block_size]`` of a
``[num_blocks, block_size, num_kv_heads, head_dim]`` cache, and query ``j`` of a sequence with ``q`` new tokens sees
keys ``[lo, hi)`` with ``hi = seq_len - q + j + 1`` and ``lo = max(0, hi - sliding_window)``.

Both attention kernels walk the keys in tiles of ``BLOCK_N`` positions and look every position up in the block
table, so a tile may span several (small) cache blocks and the block size need not match the tile. Scores, the
online softmax and the accumulator are fp32; the output is cast back to the query dtype. A query that sees no key
returns zeros. At small batches decode splits each sequence's keys over several programs, whose pieces of the
softmax a second kernel combines (flash-decoding), so a batch of one still fills the GPU. The kernels run under
``TRITON_INTERPRET=1`` on CPU as well (the tests rely on that).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["reshape_and_cache", "paged_decode_attention", "paged_prefill_attention"]

# Keys per tile. tl.dot needs every dimension >= 16, so the query-head and query-row tiles are >= 16 as well.
_BLOCK_N = 64
# The most programs one decode (sequence, kv head) is split over.
_MAX_SPLITS = 16


@triton.jit
def _tanh(x):
    """tanh through exp (no libdevice), stable for large ``|x|``."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_b, stride_kc_t, stride_kc_h, stride_vc_b, stride_vc_t, stride_vc_h,
    num_kv_heads, head_dim, block_size,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (token, block of kv heads): copy the token's keys/values into its cache slot."""
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim) & (slot >= 0)
    block = slot // block_size
    row = slot % block_size

    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_kc_b + row * stride_kc_t + heads[:, None] * stride_kc_h + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vc_b + row * stride_vc_t + heads[:, None] * stride_vc_h + dims[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, row_lo, row_hi, start,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
    stride_c_b, stride_c_t, stride_c_h, stride_vc_b, stride_vc_t, stride_vc_h,
    block_size, head_dim, scale, softcap,
    USE_SOFTCAP: tl.constexpr, UPCAST_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Fold keys ``[start, start + BLOCK_N)`` into the online softmax of ``q`` (one row per query or head).

    ``row_lo``/``row_hi`` give each row's visible key range; ``table_ptr`` points at the sequence's block table.
    """
    pos = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    in_range = pos < tl.max(row_hi, 0)
    block = tl.load(table_ptr + pos // block_size, mask=in_range, other=0).to(tl.int64)
    row = (pos % block_size).to(tl.int64)
    dim_ok = dims < head_dim
    k_t = tl.load(  # [BLOCK_D, BLOCK_N]: keys loaded transposed
        k_cache_ptr + block[None, :] * stride_c_b + row[None, :] * stride_c_t + kv_head * stride_c_h + dims[:, None],
        mask=in_range[None, :] & dim_ok[:, None], other=0.0,
    )
    v = tl.load(  # [BLOCK_N, BLOCK_D]
        v_cache_ptr + block[:, None] * stride_vc_b + row[:, None] * stride_vc_t + kv_head * stride_vc_h
        + dims[None, :],
        mask=in_range[:, None] & dim_ok[None, :], other=0.0,
    )

    k_t = k_t.to(q.dtype)
    if UPCAST_DOT:
        q, k_t = q.to(tl.float32), k_t.to(tl.float32)
    scores = tl.dot(q, k_t, input_precision="ieee") * scale
    if USE_SOFTCAP:
        scores = softcap * _tanh(scores / softcap)
    visible = (pos[None, :] >= row_lo[:, None]) & (pos[None, :] < row_hi[:, None])
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _with_sink(m_i, l_i, acc, sink):
    """The online softmax's sum and output with one sink logit per row folded in: a key that takes weight in the
    denominator and has no value."""
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    return l_i * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, sinks_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    stride_qs, stride_qh, stride_os, stride_oh, stride_table,
    stride_c_b, stride_c_t, stride_c_h, stride_vc_b, stride_vc_t, stride_vc_h,
    group_size, num_heads, head_dim, block_size, scale, window, softcap, num_splits,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, UPCAST_DOT: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, kv head, split of the keys): the group's query heads attend together to the
    sequence's keys. Unsplit, the program writes the output; split, it writes its running max, sum and unnormalized
    output for ``_combine_splits_kernel``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    heads = kv_head * group_size + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok = tl.arange(0, BLOCK_H) < group_size
    io_mask = head_ok[:, None] & (dims[None, :] < head_dim)
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + dims[None, :], mask=io_mask, other=0.0)

    hi = tl.load(seq_lens_ptr + seq)
    lo = tl.where(window > 0, tl.maximum(hi - window, 0), 0)
    row_lo = tl.zeros([BLOCK_H], dtype=tl.int32) + lo
    row_hi = tl.zeros([BLOCK_H], dtype=tl.int32) + hi
    # Each split takes a whole number of tiles; the last ones may get none.
    per_split = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    first = lo + split * per_split
    last = tl.minimum(first + per_split, hi)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(first, last, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, row_lo, row_hi, start,
            k_cache_ptr, v_cache_ptr, tables_ptr + seq * stride_table, kv_head,
            stride_c_b, stride_c_t, stride_c_h, stride_vc_b, stride_vc_t, stride_vc_h,
            block_size, head_dim, scale, softcap, USE_SOFTCAP, UPCAST_DOT, BLOCK_N, BLOCK_D,
        )
    if SPLIT:
        row = (seq * num_heads + heads) * num_splits + split
        tl.store(part_ml_ptr + 2 * row, m_i, mask=head_ok)
        tl.store(part_ml_ptr + 2 * row + 1, l_i, mask=head_ok)
        tl.store(part_acc_ptr + row[:, None] * head_dim + dims[None, :], acc, mask=io_mask)
    else:
        if USE_SINKS:
            l_i, acc = _with_sink(m_i, l_i, acc, tl.load(sinks_ptr + heads, mask=head_ok, other=0.0))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _combine_splits_kernel(
    part_ml_ptr, part_acc_ptr, sinks_ptr, out_ptr, stride_os, stride_oh, num_heads, head_dim, num_splits,
    USE_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head): the splits' softmax pieces rescaled to one max and summed."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    row = (seq * num_heads + head) * num_splits + splits
    m_s = tl.load(part_ml_ptr + 2 * row, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + 2 * row + 1, mask=split_ok, other=0.0)
    acc_s = tl.load(part_acc_ptr + row[:, None] * head_dim + dims[None, :],
                    mask=split_ok[:, None] & (dims[None, :] < head_dim), other=0.0)
    m = tl.max(m_s, 0)
    if USE_SINKS:
        m = tl.maximum(m, tl.load(sinks_ptr + head))
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no split saw a key
    weight = tl.exp(m_s - m_safe)
    total = tl.sum(l_s * weight, 0)
    if USE_SINKS:
        total += tl.exp(tl.load(sinks_ptr + head) - m_safe)
    out = tl.sum(acc_s * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < head_dim)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, q_start_ptr, sinks_ptr, out_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    stride_c_b, stride_c_t, stride_c_h, stride_vc_b, stride_vc_t, stride_vc_h,
    group_size, head_dim, block_size, scale, window, softcap,
    USE_SOFTCAP: tl.constexpr, USE_SINKS: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (sequence, query head, tile of BLOCK_M queries), causal over the sequence's pages."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q0 = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_start_ptr + seq + 1) - q0
    m0 = tl.program_id(2) * BLOCK_M
    if m0 < q_len:
        kv_head = head // group_size
        rows = m0 + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, BLOCK_D)
        io_mask = (rows[:, None] < q_len) & (dims[None, :] < head_dim)
        q_off = (q0 + rows[:, None]).to(tl.int64) * stride_qt + head * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)

        seq_len = tl.load(seq_lens_ptr + seq)
        row_hi = seq_len - q_len + rows + 1
        row_hi = tl.where(rows < q_len, row_hi, 0)  # padding rows of the tile see nothing
        row_lo = tl.where(window > 0, tl.maximum(row_hi - window, 0), 0)
        # Keys any row of this tile can see: from the first row's lo to the last valid row's hi.
        kv_lo = tl.where(window > 0, tl.maximum(seq_len - q_len + m0 + 1 - window, 0), 0)
        kv_hi = seq_len - q_len + tl.minimum(m0 + BLOCK_M, q_len)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for start in range(kv_lo, kv_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, row_lo, row_hi, start,
                k_cache_ptr, v_cache_ptr, tables_ptr + seq * stride_table, kv_head,
                stride_c_b, stride_c_t, stride_c_h, stride_vc_b, stride_vc_t, stride_vc_h,
                block_size, head_dim, scale, softcap, USE_SOFTCAP, UPCAST_DOT, BLOCK_N, BLOCK_D,
            )
        if USE_SINKS:
            l_i, acc = _with_sink(m_i, l_i, acc, tl.zeros([BLOCK_M], dtype=tl.float32) + tl.load(sinks_ptr + head))
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = (q0 + rows[:, None]).to(tl.int64) * stride_ot + head * stride_oh + dims[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _check_inner(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")


def _upcast_dot(query: torch.Tensor) -> bool:
    """CPU tensors mean the interpreter, whose half-precision ``tl.dot`` is unreliable (bf16 multiplies raw bits).

    The operands are rounded to the input dtype first and only then widened, so the numerics match the GPU path.
    """
    return query.device.type == "cpu"


def _sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them, fp32 on the queries' device (the queries stand in, unread, for none)."""
    return query if sinks is None else sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, ...]:
    return (*k_cache.stride()[:3], *v_cache.stride()[:3])


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the flat slots ``slot_mapping`` (``-1`` = skip)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_inner(key, value, k_cache, v_cache)
    block_h = min(triton.next_power_of_2(num_kv_heads), 8)
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), *_cache_strides(k_cache, v_cache),
        num_kv_heads, head_dim, k_cache.shape[1],
        BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim),
    )


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
    """One query token per sequence: ``query [S, Hq, D]`` -> ``[S, Hq, D]``."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group_size = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _check_inner(query, k_cache, v_cache)
    block_h, block_d = max(16, triton.next_power_of_2(group_size)), triton.next_power_of_2(head_dim)
    num_splits = _num_splits(num_seqs, num_kv_heads, query.device)
    # The splits' pieces: (max, sum) and the unnormalized output per (sequence, head, split), fp32.
    part_ml = query.new_empty((num_seqs, num_heads, num_splits, 2) if num_splits > 1 else (0,), dtype=torch.float32)
    part_acc = query.new_empty((num_seqs, num_heads, num_splits, head_dim) if num_splits > 1 else (0,),
                               dtype=torch.float32)
    sink_logits = _sinks(sinks, query)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, sink_logits, out, part_ml, part_acc,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache, v_cache),
        group_size, num_heads, head_dim, k_cache.shape[1], float(scale), int(sliding_window or 0),
        float(softcap or 0.0), num_splits,
        USE_SOFTCAP=softcap is not None, USE_SINKS=sinks is not None, UPCAST_DOT=_upcast_dot(query),
        SPLIT=num_splits > 1, BLOCK_H=block_h, BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
        num_warps=_num_warps(block_h, block_d),
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            part_ml, part_acc, sink_logits, out, out.stride(0), out.stride(1), num_heads,
            head_dim, num_splits, USE_SINKS=sinks is not None, BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


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
) -> torch.Tensor:
    """Several query tokens per sequence: ``query [T, Hq, D]`` packed by ``query_start_loc [S + 1]`` -> ``[T, Hq, D]``.

    ``max_query_len`` must be at least the longest sequence's query count (it sizes the grid).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    out = torch.zeros_like(query)
    if num_tokens == 0 or num_seqs == 0 or max_query_len <= 0:
        return out
    _check_inner(query, k_cache, v_cache)
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, _sinks(sinks, query), out,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *_cache_strides(k_cache, v_cache),
        num_heads // num_kv_heads, head_dim, k_cache.shape[1], float(scale), int(sliding_window or 0),
        float(softcap or 0.0),
        USE_SOFTCAP=softcap is not None, USE_SINKS=sinks is not None, UPCAST_DOT=_upcast_dot(query),
        BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=_num_warps(block_m, triton.next_power_of_2(head_dim)),
    )
    return out


def _num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """How many programs share each (sequence, kv head)'s keys: enough for two per multiprocessor, at most
    ``_MAX_SPLITS``. One program per (sequence, kv head) leaves most of a GPU idle at small batches (three programs
    for a batch of one with SmolLM2's three kv heads). It depends on shapes only, so a captured CUDA graph keeps it."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    index = device.index if device.index is not None else torch.cuda.current_device()
    return max(1, min(_MAX_SPLITS, 2 * _multiprocessors(index) // programs))


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _num_warps(rows: int, block_d: int) -> int:
    """Eight warps for the large tiles, whose registers spilled with Triton's default four when compiled for sm_90
    (bf16 heads of 128, or 64 query rows); four otherwise."""
    return 8 if rows >= 64 or block_d >= 128 else 4
