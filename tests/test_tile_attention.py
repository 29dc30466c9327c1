"""bf16 prompt rows' attention on AMX tiles (``kernels/cpu_tile_attention.cpp``) against float64 attention, and the
property the engine relies on: a prompt row's output depends on that row alone, not on the rows it is tiled with."""

import pytest
import torch

from hf_paged.kernels import cpu_ops, native
from kernel_cases import make_case, naive_attention, sink_logits

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: hf_paged has no native kernels")


def tiles(head_dim: int) -> bool:
    return cpu_ops.tile_attention(torch.bfloat16, head_dim)


def needs_tiles(head_dim: int):
    if not tiles(head_dim):
        pytest.skip("this CPU has no AMX tiles for bf16 attention")


def attend(case, scale, window=None, softcap=None, prompt_rows=None, sinks=None):
    return cpu_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                           case["seq_lens"], case["query_start_loc"], case["max_query_len"], scale,
                                           window, softcap, sinks, prompt_rows=prompt_rows)


def test_tiles_are_offered_for_bf16_head_sizes_in_multiples_of_32():
    amx = {"amx_tile", "amx_bf16"} <= set(native._cpu_id().split())
    assert [tiles(d) for d in (32, 64, 80, 96, 128, 160, 256, 288)] == [amx, amx, False, amx, amx, amx, amx, False]
    assert not cpu_ops.tile_attention(torch.float32, 64)


CASES = [
    # seq_lens, q_lens, prompt rows of each sequence, kv heads, GQA groups, head dim, block size
    ([40], [40], [40], 1, 1, 64, 16),  # two whole tiles and a short one, no earlier keys
    ([100, 37, 9], [60, 37, 1], [60, 30, 0], 3, 3, 64, 4),  # SmolLM2's heads; a prompt then generated rows; a decode
    ([300, 17], [70, 1], [70, 1], 2, 4, 128, 16),  # a chunk over 230 earlier keys; a one-row prompt chunk
    ([90], [33], [20], 1, 6, 96, 8),  # heads in runs of 4 and 2, dims in runs of 4 and 2
    ([70, 50], [70, 50], [70, 45], 1, 5, 256, 32),
    ([64, 33], [64, 33], [64, 33], 2, 2, 32, 16),
]


@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 5.0), (10, 30.0)])
@pytest.mark.parametrize("case_args", CASES)
def test_prompt_rows_on_tiles_match_naive_and_other_rows_are_untouched(case_args, window, softcap):
    seq_lens, q_lens, prompts, kv_heads, groups, dim, bs = case_args
    needs_tiles(dim)
    case = make_case(seq_lens, q_lens, kv_heads, groups, dim, bs, dtype=torch.bfloat16, paged_layout=True)
    prompt_rows = torch.cat([torch.arange(q) < p for q, p in zip(q_lens, prompts)])
    scale = dim**-0.5
    tiled, rows = attend(case, scale, window, softcap, prompt_rows), attend(case, scale, window, softcap)
    torch.testing.assert_close(tiled.double(), naive_attention(case, scale, window, softcap), rtol=1.6e-2, atol=1.6e-2)
    assert not torch.equal(tiled[prompt_rows], rows[prompt_rows])  # the tiles sum in another order
    assert torch.equal(tiled[~prompt_rows], rows[~prompt_rows])  # generated rows keep the row kernel, to the bit


@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (10, 30.0)])
@pytest.mark.parametrize("case_args", CASES[:3])
def test_prompt_rows_on_tiles_with_attention_sinks_match_naive(case_args, window, softcap):
    seq_lens, q_lens, prompts, kv_heads, groups, dim, bs = case_args
    needs_tiles(dim)
    case = make_case(seq_lens, q_lens, kv_heads, groups, dim, bs, dtype=torch.bfloat16, paged_layout=True)
    prompt_rows = torch.cat([torch.arange(q) < p for q, p in zip(q_lens, prompts)])
    sinks = sink_logits(kv_heads * groups)
    tiled = attend(case, 0.125, window, softcap, prompt_rows, sinks)
    expected = naive_attention(case, 0.125, window, softcap, sinks)
    torch.testing.assert_close(tiled.double(), expected, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("chunk", [1, 5, 16, 23])
def test_a_prompt_row_is_the_same_to_the_bit_in_any_chunking_and_beside_any_rows(chunk, window):
    """A prompt of 150 tokens attended in one call, or in chunks (each over the keys of the chunks before it), or
    beside another sequence's rows: every row's output is the same, bit for bit."""
    needs_tiles(64)
    length = 150
    case = make_case([length, 60], [length, 60], 3, 3, 64, 4, dtype=torch.bfloat16, paged_layout=True)
    whole = attend(case, 0.125, window, prompt_rows=torch.ones(length + 60, dtype=torch.bool))[:length]
    for start in range(0, length, chunk):
        end = min(length, start + chunk)
        part = dict(case, query=case["query"][start:end], seq_lens=torch.tensor([end], dtype=torch.int32),
                    block_tables=case["block_tables"][:1], max_query_len=end - start,
                    query_start_loc=torch.tensor([0, end - start], dtype=torch.int32))
        got = attend(part, 0.125, window, prompt_rows=torch.ones(end - start, dtype=torch.bool))
        assert torch.equal(got, whole[start:end]), (start, end)


def test_fp32_prompt_rows_keep_the_row_kernel():
    case = make_case([50], [50], 2, 3, 64, 16, dtype=torch.float32, paged_layout=True)
    assert torch.equal(attend(case, 0.125, prompt_rows=torch.ones(50, dtype=torch.bool)), attend(case, 0.125))


@pytest.mark.parametrize("prompt_rows", [torch.ones(49, dtype=torch.bool), torch.ones(50, dtype=torch.uint8)])
def test_prompt_rows_other_than_one_bool_per_query_row_are_refused(prompt_rows):
    case = make_case([50], [50], 2, 3, 64, 16, dtype=torch.bfloat16, paged_layout=True)
    with pytest.raises(ValueError, match=r"prompt_rows must be one bool per query row \(50\)"):
        attend(case, 0.125, prompt_rows=prompt_rows)
