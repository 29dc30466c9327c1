"""Random paged-attention problems shared by the kernel tests."""

import torch


def make_case(seq_lens, q_lens, num_kv_heads, groups, head_dim, block_size, dtype=torch.float32, seed=0,
              paged_layout=False):
    """KV caches with shuffled (non-contiguous, out of order) block tables, plus packed queries.

    ``paged_layout`` stores the caches as PagedCache does (``[num_blocks, num_kv_heads, block_size, head_dim]`` in
    memory, transposed views); otherwise they are contiguous.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[start : start + nb])
        start += nb
    width = max(blocks_per_seq)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    if paged_layout:
        k_cache = k_cache.transpose(1, 2).contiguous().transpose(1, 2)
        v_cache = v_cache.transpose(1, 2).contiguous().transpose(1, 2)
    num_heads = num_kv_heads * groups
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl, max_query_len=max(q_lens))


def slot_index(slot_mapping, block_size):
    """Flat slots as ``(block, row)`` indices into a ``[num_blocks, block_size, ...]`` cache view (in PagedCache's
    layout the first two axes do not flatten to a view, so ``cache.flatten(0, 1)[slots] = x`` would write a copy)."""
    return slot_mapping.div(block_size, rounding_mode="floor"), slot_mapping.remainder(block_size)


def sink_logits(num_heads, seed=0):
    """Attention sinks large enough to take a good part of some rows' weight."""
    return 2 * torch.randn(num_heads, generator=torch.Generator().manual_seed(seed))


def naive_attention(case, scale, sliding_window=None, softcap=None, sinks=None):
    """Token-by-token float64 attention reading the cache one key at a time through the block table; ``sinks`` join
    each row's softmax as a key without a value."""
    q, kc, vc = case["query"].double(), case["k_cache"].double(), case["v_cache"].double()
    bs = kc.shape[1]
    groups = q.shape[1] // kc.shape[2]
    out = torch.zeros_like(q)
    qsl = case["query_start_loc"].tolist()
    for s, seq_len in enumerate(case["seq_lens"].tolist()):
        table = case["block_tables"][s].tolist()
        keys = torch.stack([kc[table[p // bs], p % bs] for p in range(seq_len)]) if seq_len else None
        values = torch.stack([vc[table[p // bs], p % bs] for p in range(seq_len)]) if seq_len else None
        n_q = qsl[s + 1] - qsl[s]
        for j in range(n_q):
            hi = seq_len - n_q + j + 1
            lo = max(0, hi - sliding_window) if sliding_window else 0
            if hi <= 0:
                continue
            for h in range(q.shape[1]):
                k = keys[lo:hi, h // groups]
                scores = (k @ q[qsl[s] + j, h]) * scale
                if softcap:
                    scores = torch.tanh(scores / softcap) * softcap
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                weights = torch.softmax(scores, 0)[: hi - lo]
                out[qsl[s] + j, h] = weights @ values[lo:hi, h // groups]
    return out
