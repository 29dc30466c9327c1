"""Plain-torch paged attention: the CPU path and the reference the Triton kernels are tested against.

Layout shared by every implementation:

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides); token ``i`` of a
  sequence lives at block ``block_tables[s, i // block_size]``, row ``i % block_size``. `PagedKVStorage` stores them
  ``[num_blocks, num_kv_heads, block_size, head_dim]`` in memory (transposed views): one head's rows of a block are
  contiguous, and so are all the heads of a block, which the CPU kernel reads as one run.
* Queries are packed without padding: ``query[query_start_loc[s]:query_start_loc[s + 1]]`` belong to sequence ``s``.
* ``seq_lens[s]`` counts the keys of sequence ``s`` after this step's tokens were written. Query ``j`` of a sequence
  with ``q`` queries sees keys ``[lo, hi)`` with ``hi = seq_lens[s] - q + j + 1`` and ``lo = hi - sliding_window``
  (or 0). A query with ``hi <= 0`` (a left-padding position) sees nothing and returns zeros.
* ``sinks`` (attention sinks, gpt-oss's): one fp32 logit per query head, or None. Each row's softmax denominator also
  holds ``exp(sinks[h])``, a key that takes weight but has no value, so a row's weights sum to less than 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into the flat slots ``slot_mapping`` (``-1`` = skip)."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    # (block, row) indices rather than one flat slot axis: in PagedKVStorage's layout the two do not flatten to a view.
    block_size = k_cache.shape[1]
    index = (slot_mapping.div(block_size, rounding_mode="floor"), slot_mapping.remainder(block_size))
    k_cache.index_put_(index, key.to(k_cache.dtype))
    v_cache.index_put_(index, value.to(v_cache.dtype))


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over contiguous tensors: q ``[B, Hq, Q, D]``, k/v ``[B, Hkv, K, D]``, bool mask broadcastable to
    ``[B, Hq, Q, K]`` (True = attend). Softmax in fp32; float64 stays float64 (the reference path)."""
    if softcap is None and sinks is None and q.dtype != torch.float64:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2))
    if scores.dtype != torch.float64:
        scores = scores.float()
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(1, -1, 1, 1))
    # A row that sees no key gives zeros; in place unless autograd needs the softmax's output for backward.
    probs = (probs.nan_to_num(0.0) if probs.requires_grad else probs.nan_to_num_(0.0)).to(v.dtype)
    return torch.matmul(probs, v)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension; ``sinks`` (broadcastable to ``scores[..., :1]``) join each row's denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _length_runs(widths: list[int], max_runs: int = 4, call_cost: int = 32) -> list[tuple[int, int, int]]:
    """Cut ascending block counts into up to ``max_runs`` runs ``(start, end, width)``.

    A run costs its rows times its widest table (padded work) plus ``call_cost`` block-rows per call; neighbouring
    quartiles are merged whenever that is cheaper.
    """
    count = len(widths)
    bounds = sorted({count * g // max_runs for g in range(1, max_runs + 1)} - {0})
    runs, start = [], 0
    for end in bounds:
        if runs and (start - runs[-1][0]) * (widths[end - 1] - runs[-1][2]) <= call_cost:
            runs[-1][1:] = [end, widths[end - 1]]
        else:
            runs.append([start, end, widths[end - 1]])
        start = end
    return [tuple(run) for run in runs]


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
    """One query token per sequence: ``query [S, Hq, D]`` -> ``[S, Hq, D]``.

    The batch reads only its own pages: ``k_cache[block_tables]`` touches the blocks listed in the tables and
    nothing else. Sequences are gathered in up to four runs of similar length, so short contexts are not padded to
    the longest one.
    """
    block_size = k_cache.shape[1]
    widths = (seq_lens.to(torch.long) + block_size - 1).div(block_size, rounding_mode="floor").clamp(1)
    widths = widths.clamp(max=max(1, block_tables.shape[1]))
    order = torch.argsort(widths, stable=True)
    runs = _length_runs(widths[order].tolist())
    if len(runs) == 1:
        return _decode_gathered(query, k_cache, v_cache, block_tables[:, : runs[0][2]], seq_lens, scale,
                                sliding_window, softcap, sinks)
    out = torch.empty_like(query)
    for start, end, width in runs:
        rows = order[start:end]
        out[rows] = _decode_gathered(query[rows], k_cache, v_cache, block_tables[rows, :width], seq_lens[rows],
                                     scale, sliding_window, softcap, sinks)
    return out


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[num_kv_heads, len(blocks), block_size, head_dim]``, contiguous: the listed blocks of every head.

    Advanced indexing, not ``index_select``: on a transposed view of PagedKVStorage's blocks ``index_select`` is about
    10x slower (64 of 2048 blocks: 3.0 against 0.13 ms on CPU)."""
    return cache.permute(2, 0, 1, 3)[:, blocks].contiguous()  # already contiguous in PagedKVStorage's layout


def _decode_gathered(query, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window, softcap, sinks):
    """Decode attention for sequences whose tables are all ``block_tables.shape[1]`` blocks wide (padded)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = block_tables.shape[1] * block_size
    blocks = block_tables.flatten().long()
    # [Hkv, S, L, D]: one contiguous key matrix per (head, sequence), read from that sequence's blocks only.
    keys = _gather_blocks(k_cache, blocks).view(num_kv_heads, num_seqs, max_len, head_dim)
    values = _gather_blocks(v_cache, blocks).view(num_kv_heads, num_seqs, max_len, head_dim)
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2))
    if scores.dtype not in (torch.float32, torch.float64):
        scores = scores.float()
    scores = scores * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(max_len, device=query.device)
    lens = seq_lens.to(torch.long).unsqueeze(1)
    hidden = pos >= lens
    if sliding_window is not None:
        hidden |= pos < lens - sliding_window
    scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    sinks = None if sinks is None else sinks.view(num_kv_heads, 1, num_heads // num_kv_heads, 1)
    probs = softmax_with_sinks(scores, sinks).nan_to_num_(0.0).to(values.dtype)
    out = torch.matmul(probs, values)  # [Hkv, S, G, D]
    return out.transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


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
    """Several query tokens per sequence, causal over the sequence's cached pages plus themselves.

    ``query [T, Hq, D]`` packed by ``query_start_loc [S + 1]`` -> ``[T, Hq, D]``. Each sequence is attended on its
    own, reading its own blocks only.
    """
    out = torch.zeros_like(query)
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0 or seq_len == 0:
            continue
        blocks = block_tables[s, : -(-seq_len // block_size)].long()
        keys = _gather_blocks(k_cache, blocks).flatten(1, 2)[:, :seq_len].unsqueeze(0)
        values = _gather_blocks(v_cache, blocks).flatten(1, 2)[:, :seq_len].unsqueeze(0)
        last_key = torch.arange(seq_len - (q1 - q0), seq_len, device=query.device).unsqueeze(1)
        key_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        mask = key_pos <= last_key
        if sliding_window is not None:
            mask &= key_pos > last_key - sliding_window
        sees_nothing = ~mask.any(dim=1)
        if bool(sees_nothing.all()):
            continue
        mask[sees_nothing, 0] = True
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)
        seq_out = dense_attention(q, keys, values, mask[None, None], scale, softcap, sinks)[0].transpose(0, 1)
        seq_out[sees_nothing] = 0
        out[q0:q1] = seq_out
    return out
