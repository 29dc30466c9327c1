"""The torch paged kernels (CPU path and reference) against a token-by-token float64 computation."""

import pytest
import torch

from hf_paged.kernels import torch_ops
from kernel_cases import make_case, naive_attention, sink_logits

CASES = [
    # seq_lens, q_lens (for prefill), kv heads, GQA groups, head dim, block size
    ([1, 17, 32, 40], [1, 5, 32, 3], 2, 1, 64, 8),
    ([9, 16, 33], [9, 2, 1], 1, 3, 80, 16),
    ([50, 7], [4, 7], 2, 4, 96, 32),
    ([20, 3, 64], [6, 3, 1], 1, 8, 128, 16),
]


@pytest.mark.parametrize("paged_layout", [False, True], ids=["contiguous", "paged-layout"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("case_args", CASES)
def test_decode_matches_naive(case_args, window, softcap, paged_layout):
    seq_lens, _, kv_heads, groups, dim, bs = case_args
    case = make_case(seq_lens, [1] * len(seq_lens), kv_heads, groups, dim, bs, paged_layout=paged_layout)
    scale = dim**-0.5
    got = torch_ops.paged_decode_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                           case["seq_lens"], scale, window, softcap)
    torch.testing.assert_close(got.double(), naive_attention(case, scale, window, softcap), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("case_args", CASES)
def test_attention_sinks_match_naive(case_args, window):
    seq_lens, q_lens, kv_heads, groups, dim, bs = case_args
    sinks = sink_logits(kv_heads * groups)
    decode = make_case(seq_lens, [1] * len(seq_lens), kv_heads, groups, dim, bs, paged_layout=True)
    got = torch_ops.paged_decode_attention(decode["query"], decode["k_cache"], decode["v_cache"],
                                           decode["block_tables"], decode["seq_lens"], 0.125, window, None, sinks)
    torch.testing.assert_close(got.double(), naive_attention(decode, 0.125, window, None, sinks), rtol=1e-5, atol=1e-5)
    prefill = make_case(seq_lens, q_lens, kv_heads, groups, dim, bs, paged_layout=True)
    got = torch_ops.paged_prefill_attention(prefill["query"], prefill["k_cache"], prefill["v_cache"],
                                            prefill["block_tables"], prefill["seq_lens"], prefill["query_start_loc"],
                                            prefill["max_query_len"], 0.125, window, None, sinks)
    expected = naive_attention(prefill, 0.125, window, None, sinks)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    import hf_paged.kernels as kernels

    with pytest.raises(ValueError, match="one logit per query head"):  # whichever kernel would run
        kernels.paged_decode_attention(decode["query"], decode["k_cache"], decode["v_cache"], decode["block_tables"],
                                       decode["seq_lens"], 0.125, window, None, sinks[:-1])


def test_decode_mixed_lengths_in_separate_runs():
    """Long and short contexts interleaved: the torch path gathers them in runs of similar length, out of order."""
    seq_lens = [300, 5, 250, 9, 0, 280, 3, 260, 17, 120]
    case = make_case(seq_lens, [1] * len(seq_lens), 2, 3, 64, 8, paged_layout=True)
    widths = sorted(max(1, -(-n // 8)) for n in seq_lens)
    assert len(torch_ops._length_runs(widths)) > 1
    got = torch_ops.paged_decode_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                           case["seq_lens"], 0.125)
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("paged_layout", [False, True], ids=["contiguous", "paged-layout"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("case_args", CASES)
def test_prefill_matches_naive(case_args, window, softcap, paged_layout):
    seq_lens, q_lens, kv_heads, groups, dim, bs = case_args
    case = make_case(seq_lens, q_lens, kv_heads, groups, dim, bs, paged_layout=paged_layout)
    scale = dim**-0.5
    got = torch_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                            case["seq_lens"], case["query_start_loc"], case["max_query_len"], scale,
                                            window, softcap)
    torch.testing.assert_close(got.double(), naive_attention(case, scale, window, softcap), rtol=1e-5, atol=1e-5)


def test_prefill_left_padding_queries_return_zeros():
    # 6 query slots but only 4 real tokens: the first two queries see no key.
    case = make_case([4], [6], 1, 2, 64, 8)
    got = torch_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                            case["seq_lens"], case["query_start_loc"], 6, 0.125)
    assert torch.count_nonzero(got[:2]) == 0
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125), rtol=1e-5, atol=1e-5)


def test_reshape_and_cache_writes_paged_layout_caches_in_place():
    physical = torch.zeros(4, 2, 4, 8)  # [blocks, heads, block_size, dim], as PagedCache stores it
    k_cache = physical.transpose(1, 2)
    key = torch.randn(2, 2, 8)
    torch_ops.reshape_and_cache(key, key, k_cache, torch.zeros(4, 4, 2, 8), torch.tensor([6, 9]))
    assert torch.equal(physical[1, :, 2], key[0]) and torch.equal(physical[2, :, 1], key[1])


def test_reshape_and_cache_skips_negative_slots():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch_ops.reshape_and_cache(key, value, k_cache, v_cache, torch.tensor([5, -1, 14]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(k_cache[3, 2], key[2])
    assert torch.equal(v_cache[3, 2], value[2])
    assert torch.count_nonzero(k_cache) == 2 * 2 * 8


@pytest.mark.parametrize("forced", ["", "torch"], ids=["default-path", "torch-path"])
def test_fp32_queries_read_a_bf16_cache(forced, monkeypatch):
    """kv_cache_dtype: the dispatcher reads a cache in another dtype than the queries and answers in the queries'."""
    from hf_paged import kernels

    monkeypatch.setenv("HF_PAGED_KERNELS", forced)
    case = make_case([5, 40, 19], [5, 4, 1], 2, 3, 64, 8, dtype=torch.bfloat16, paged_layout=True)
    query = torch.randn(case["query"].shape)
    rounded = dict(case, query=query.to(torch.bfloat16))  # what attention in the cache's dtype sees
    expected = naive_attention(rounded, 0.125)
    got = kernels.paged_prefill_attention(query, case["k_cache"], case["v_cache"], case["block_tables"],
                                          case["seq_lens"], case["query_start_loc"], case["max_query_len"], 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
    decode = make_case([5, 40, 19], [1, 1, 1], 2, 3, 64, 8, dtype=torch.bfloat16, paged_layout=True)
    query = torch.randn(decode["query"].shape)
    expected = naive_attention(dict(decode, query=query.to(torch.bfloat16)), 0.125)
    got = kernels.paged_decode_attention(query, decode["k_cache"], decode["v_cache"], decode["block_tables"],
                                         decode["seq_lens"], 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
