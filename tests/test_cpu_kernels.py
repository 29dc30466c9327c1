"""The native CPU kernel (``hf_paged/kernels/cpu_attention.cpp``) against the float64 token-by-token reference."""

import pytest
import torch

import hf_paged.kernels as kernels
from hf_paged.cache.metadata import PagedMetadata
from hf_paged.kernels import cpu_ops, native, torch_ops
from kernel_cases import make_case, naive_attention, sink_logits, slot_index

# Without a C++ compiler hf_paged runs the torch path (tested in test_torch_kernels.py) and there is no kernel to test.
# With one, as in CI and the README set-up, a kernel that fails to build fails test_kernel_builds instead of skipping.
pytestmark = pytest.mark.skipif(
    native.compiler() is None, reason="no C++ compiler ($CXX, g++ or c++): hf_paged uses the torch path instead"
)

def test_kernel_builds():
    assert cpu_ops.available()


CASES = [
    # seq_lens, kv heads, GQA groups, head dim, block size
    ([1, 17, 32, 40], 2, 1, 64, 8),
    ([9, 16, 33], 1, 3, 80, 16),
    ([50, 7], 2, 4, 96, 32),
    ([20, 3, 64, 130], 3, 3, 64, 16),
    ([200], 1, 8, 128, 16),
    ([9, 40], 1, 6, 64, 16),  # query heads in runs of 4 and 2
    ([30, 5], 2, 2, 40, 16),  # a head_dim without an unrolled kernel
    ([70], 1, 3, 256, 16),
]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("paged_layout", [False, True], ids=["contiguous", "paged-layout"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0), (10, 30.0)])
@pytest.mark.parametrize("case_args", CASES)
def test_decode_matches_naive(case_args, window, softcap, paged_layout, dtype):
    seq_lens, kv_heads, groups, dim, bs = case_args
    case = make_case(seq_lens, [1] * len(seq_lens), kv_heads, groups, dim, bs, dtype=dtype, paged_layout=paged_layout)
    scale = dim**-0.5
    got = cpu_ops.paged_decode_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                         case["seq_lens"], scale, window, softcap)
    assert got.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), naive_attention(case, scale, window, softcap), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunks", [[], [6, 12]], ids=["decodes", "decodes-and-chunks"])
@pytest.mark.parametrize("num_decodes", [1, "many"])
def test_task_plans_match_naive(num_decodes, chunks, dtype):
    """Decodes get one task per sequence and kv head while they are few (one decode is always fewer than twice the
    threads), one per sequence with all its heads once there are at least twice as many as threads; multi-query
    chunks get tasks per head, each head's queries dealt out over several while there are fewer heads than twice the
    threads (3 heads here: 2 tasks per head at 2 threads)."""
    if num_decodes == "many":
        num_decodes = 2 * torch.get_num_threads() + 1
    seq_lens = [5 + 13 * i % 70 for i in range(num_decodes)] + [20, 33][: len(chunks)]
    q_lens = [1] * num_decodes + chunks
    case = make_case(seq_lens, q_lens, 3, 3, 64, 16, dtype=dtype, paged_layout=True)
    got = cpu_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                          case["seq_lens"], case["query_start_loc"], case["max_query_len"], 0.125, 24)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125, 24), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [3, 6])
def test_a_decode_alone_equals_the_same_decode_in_a_batch_bit_for_bit(groups, dtype):
    """Alone, a decode gets one task per kv head; in a large batch all its heads are one task. The attention source
    is built with -ffast-math, so this holds only while both plans run a head in the same unrolled kernel: splitting a
    group's query heads between tasks (runs of 1 and 2 heads instead of 3) changed results by an ulp."""
    many = 2 * torch.get_num_threads() + 1
    case = make_case([5 + 29 * i % 200 for i in range(many)], [1] * many, 3, groups, 64, 16, dtype=dtype,
                     paged_layout=True)
    args = (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], 0.125)
    batched = cpu_ops.paged_decode_attention(*args)
    for i in (0, many - 1):
        alone = cpu_ops.paged_decode_attention(case["query"][i:i + 1], case["k_cache"], case["v_cache"],
                                               case["block_tables"][i:i + 1], case["seq_lens"][i:i + 1], 0.125)
        assert torch.equal(alone[0], batched[i])


PREFILL_CASES = [
    # seq_lens, q_lens, kv heads, GQA groups, head dim, block size
    ([1, 17, 32, 40], [1, 5, 32, 3], 2, 1, 64, 8),
    ([9, 16, 33], [9, 2, 1], 1, 3, 80, 16),
    ([50, 7], [4, 7], 2, 4, 96, 32),
    ([20, 3, 64], [6, 3, 1], 3, 3, 64, 16),
    ([30, 12], [30, 12], 2, 2, 40, 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
@pytest.mark.parametrize("case_args", PREFILL_CASES)
def test_prefill_matches_naive(case_args, window, softcap, dtype):
    seq_lens, q_lens, kv_heads, groups, dim, bs = case_args
    case = make_case(seq_lens, q_lens, kv_heads, groups, dim, bs, dtype=dtype, paged_layout=True)
    scale = dim**-0.5
    got = cpu_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                          case["seq_lens"], case["query_start_loc"], case["max_query_len"], scale,
                                          window, softcap)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), naive_attention(case, scale, window, softcap), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (10, 30.0)])
@pytest.mark.parametrize("case_args", PREFILL_CASES[:3])
def test_attention_sinks_match_naive(case_args, window, softcap, dtype):
    """Decodes and prefill chunks (the row kernel), with a sink logit per query head in every row's softmax."""
    seq_lens, q_lens, kv_heads, groups, dim, bs = case_args
    case = make_case(seq_lens, q_lens, kv_heads, groups, dim, bs, dtype=dtype, paged_layout=True)
    sinks = sink_logits(kv_heads * groups)
    got = cpu_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                          case["seq_lens"], case["query_start_loc"], case["max_query_len"], 0.125,
                                          window, softcap, sinks)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125, window, softcap, sinks), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="one logit per query head"):
        cpu_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                        case["seq_lens"], case["query_start_loc"], case["max_query_len"], 0.125,
                                        sinks=sinks[:-1])


def test_prefill_left_padding_queries_return_zeros():
    """Queries before the first stored key (left padding under `generate`) see nothing and return zeros."""
    case = make_case([3, 6], [5, 6], 1, 2, 64, 8)
    got = cpu_ops.paged_prefill_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                          case["seq_lens"], case["query_start_loc"], case["max_query_len"], 0.125)
    assert torch.count_nonzero(got[:2]) == 0
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125), rtol=1e-5, atol=1e-5)


def test_empty_sequence_outputs_zeros_and_neighbours_are_unaffected():
    case = make_case([0, 11, 0, 3], [1] * 4, 2, 2, 64, 8)
    got = cpu_ops.paged_decode_attention(case["query"], case["k_cache"], case["v_cache"], case["block_tables"],
                                         case["seq_lens"], 0.125)
    assert torch.count_nonzero(got[[0, 2]]) == 0
    torch.testing.assert_close(got[[1, 3]].double(), naive_attention(case, 0.125)[[1, 3]], rtol=1e-5, atol=1e-5)


def test_reads_only_listed_blocks():
    """Poisoning every block no table lists changes nothing: the kernel reads through the block tables only."""
    case = make_case([5, 19, 33], [1, 1, 1], 2, 3, 64, 8, paged_layout=True)
    args = lambda: (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], 0.125)
    before = cpu_ops.paged_decode_attention(*args())
    listed = set()
    for table, length in zip(case["block_tables"].tolist(), case["seq_lens"].tolist()):
        listed.update(table[: -(-length // 8)])
    for block in set(range(case["k_cache"].shape[0])) - listed:
        case["k_cache"][block] = float("nan")
        case["v_cache"][block] = float("nan")
    assert torch.equal(cpu_ops.paged_decode_attention(*args()), before)


def test_tables_outside_the_cache_are_refused_not_read():
    case = make_case([5, 19], [1, 1], 2, 3, 64, 8, paged_layout=True)
    args = dict(query=case["query"], k_cache=case["k_cache"], v_cache=case["v_cache"], scale=0.125)
    bad_block = case["block_tables"].clone()
    bad_block[1, 0] = case["k_cache"].shape[0]
    with pytest.raises(ValueError, match="outside"):
        cpu_ops.paged_decode_attention(block_tables=bad_block, seq_lens=case["seq_lens"], **args)
    too_long = torch.tensor([5, 8 * case["block_tables"].shape[1] + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="longer than its block table"):
        cpu_ops.paged_decode_attention(block_tables=case["block_tables"], seq_lens=too_long, **args)


def test_inconsistent_shapes_are_refused_not_read():
    case = make_case([5, 19], [1, 1], 2, 3, 64, 8, paged_layout=True)
    tables, lens, k, v = case["block_tables"], case["seq_lens"], case["k_cache"], case["v_cache"]
    with pytest.raises(ValueError, match="do not fit the cache"):  # head_dim 128 against a 64-wide cache
        cpu_ops.paged_decode_attention(torch.randn(2, 6, 128), k, v, tables, lens, 0.125)
    with pytest.raises(ValueError, match="do not fit the cache"):
        cpu_ops.paged_decode_attention(case["query"], k, v[:-1], tables, lens, 0.125)
    with pytest.raises(ValueError, match="a row per sequence"):  # one table row for two sequences
        cpu_ops.paged_decode_attention(case["query"], k, v, tables[:1], lens, 0.125)
    with pytest.raises(ValueError, match="must not decrease"):
        cpu_ops.paged_prefill_attention(torch.randn(2, 6, 64), k, v, tables, lens, torch.tensor([0, 3, 2]), 3, 0.125)
    # What the pointer arithmetic would misread: another dtype, K and V laid out differently, a strided head_dim.
    layouts = "one dtype, K and V laid out alike, with contiguous head_dim"
    with pytest.raises(ValueError, match=layouts):
        cpu_ops.paged_decode_attention(case["query"], k.bfloat16(), v.bfloat16(), tables, lens, 0.125)
    with pytest.raises(ValueError, match=layouts):
        cpu_ops.paged_decode_attention(case["query"], k, v.contiguous(), tables, lens, 0.125)
    with pytest.raises(ValueError, match=layouts):
        cpu_ops.paged_decode_attention(torch.randn(2, 6, 128)[..., ::2], k, v, tables, lens, 0.125)
    with pytest.raises(ValueError, match="outside int32"):
        cpu_ops.paged_decode_attention(case["query"], k, v, tables.long() + 2**32, lens, 0.125)
    with pytest.raises(ValueError, match="no sequences"):
        cpu_ops.paged_prefill_attention(torch.randn(3, 6, 64), k, v, tables[:0], lens[:0], torch.tensor([0]), 3, 0.125)


def _step_with_new_rows(seq_lens, q_lens, dtype=torch.float32):
    """A mixed step (decodes first) whose new rows are cut out of the cache: their slots hold NaN, and the rows come
    as separate keys/values, as a layer hands them to `paged_attention`."""
    case = make_case(seq_lens, q_lens, 2, 3, 64, 8, dtype=dtype, paged_layout=True)
    slots = []
    for s, (length, q_len) in enumerate(zip(seq_lens, q_lens)):
        table = case["block_tables"][s].tolist()
        slots += [table[p // 8] * 8 + p % 8 for p in range(length - q_len, length)]
    slot_mapping = torch.tensor(slots)
    full_k, full_v = case["k_cache"].clone(), case["v_cache"].clone()
    index = slot_index(slot_mapping, 8)
    key, value = full_k[index], full_v[index]
    case["k_cache"][index] = float("nan")
    case["v_cache"][index] = float("nan")
    metadata = PagedMetadata(slot_mapping, case["block_tables"], case["seq_lens"], case["query_start_loc"],
                             max(q_lens), sum(q == 1 for q in q_lens))
    return case, key, value, metadata, full_k, full_v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_call_stores_the_new_rows_then_attends(dtype):
    case, key, value, metadata, full_k, full_v = _step_with_new_rows([9, 20, 33, 7], [1, 1, 5, 7], dtype)
    got = cpu_ops.paged_attention(case["query"], key, value, case["k_cache"], case["v_cache"], metadata, 0.125)
    assert torch.equal(case["k_cache"], full_k) and torch.equal(case["v_cache"], full_v)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125), rtol=tol, atol=tol)


def test_padding_rows_are_not_stored():
    case, key, value, metadata, full_k, full_v = _step_with_new_rows([6, 13], [6, 1])
    skipped = int(metadata.slot_mapping[0])
    metadata.slot_mapping[0] = -1  # a left-padding token under `generate`
    cpu_ops.paged_attention(case["query"], key, value, case["k_cache"], case["v_cache"], metadata, 0.125)
    assert case["k_cache"][skipped // 8, skipped % 8].isnan().all()
    stored = slot_index(metadata.slot_mapping[1:], 8)
    assert torch.equal(case["k_cache"][stored], full_k[stored])


def test_slots_outside_the_cache_are_refused_not_written():
    case, key, value, metadata, *_ = _step_with_new_rows([5, 19], [1, 1])
    metadata.slot_mapping[1] = case["k_cache"].shape[0] * 8
    before = case["k_cache"].clone()
    with pytest.raises(ValueError, match="slot outside the cache"):
        cpu_ops.paged_attention(case["query"], key, value, case["k_cache"], case["v_cache"], metadata, 0.125)
    assert torch.equal(case["k_cache"].nan_to_num(), before.nan_to_num())
    with pytest.raises(ValueError, match="do not match"):
        cpu_ops.paged_attention(case["query"], key[:1], value, case["k_cache"], case["v_cache"], metadata, 0.125)


def test_dispatcher_stores_and_attends_alike_on_every_path(monkeypatch):
    results = {}
    for path in ("", "torch"):
        monkeypatch.setenv("HF_PAGED_KERNELS", path)
        case, key, value, metadata, full_k, _ = _step_with_new_rows([9, 20, 33, 7], [1, 1, 5, 7])
        results[path] = kernels.paged_attention(case["query"], key, value, case["k_cache"], case["v_cache"],
                                                metadata, 0.125)
        assert torch.equal(case["k_cache"], full_k)
    torch.testing.assert_close(results[""], results["torch"], rtol=1e-5, atol=1e-5)
    calls = []
    monkeypatch.setattr(cpu_ops, "paged_attention", lambda *args: calls.append(args) or args[0])
    monkeypatch.setenv("HF_PAGED_KERNELS", "")
    case, key, value, metadata, *_ = _step_with_new_rows([9, 20], [1, 1])
    kernels.paged_attention(case["query"], key, value, case["k_cache"], case["v_cache"], metadata, 0.125)
    assert len(calls) == 1  # one native call for the whole step
    metadata.max_query_len = cpu_ops.MAX_NATIVE_QUERY_LEN + 1  # a long chunk in the step: torch's SDPA for it
    kernels.paged_attention(case["query"], key, value, case["k_cache"], case["v_cache"], metadata, 0.125)
    assert len(calls) == 1


def test_bf16_dot_products_are_built_where_the_cpu_has_them():
    assert cpu_ops.available()
    has = "avx512_bf16" in native._cpu_id().split()
    assert [bool(cpu_ops._library.hf_paged_has_bf16_dot(d)) for d in (32, 64, 80, 96, 128, 160, 256)] == [
        False, has, False, has, has, False, has]


def test_long_bf16_chunks_go_native_only_with_bf16_dot_products(monkeypatch):
    case = make_case([200], [129], 2, 3, 64, 16, dtype=torch.bfloat16, paged_layout=True)
    args = [case[k] for k in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc",
                              "max_query_len")] + [0.125]
    calls = []
    native = cpu_ops.paged_prefill_attention
    monkeypatch.setattr(cpu_ops, "paged_prefill_attention", lambda *a: calls.append(a) or native(*a))
    monkeypatch.delenv("HF_PAGED_KERNELS", raising=False)
    got = kernels.paged_prefill_attention(*args)
    assert len(calls) == cpu_ops._library.hf_paged_has_bf16_dot(64)
    torch.testing.assert_close(got.double(), naive_attention(case, 0.125), rtol=1.6e-2, atol=1.6e-2)
    head_dim_80 = make_case([200], [129], 2, 3, 80, 16, dtype=torch.bfloat16, paged_layout=True)
    kernels.paged_prefill_attention(*[head_dim_80[k] for k in ("query", "k_cache", "v_cache", "block_tables",
                                                               "seq_lens", "query_start_loc", "max_query_len")], 0.1)
    assert len(calls) == cpu_ops._library.hf_paged_has_bf16_dot(64)  # head_dim 80 has no bf16 score path: SDPA


def test_dispatcher_takes_the_native_kernel_on_cpu(monkeypatch):
    case = make_case([5, 19], [1, 1], 2, 3, 64, 8, paged_layout=True)
    query, k_cache, v_cache = case["query"], case["k_cache"], case["v_cache"]
    args = (query, k_cache, v_cache, case["block_tables"], case["seq_lens"], 0.125)
    monkeypatch.delenv("HF_PAGED_KERNELS", raising=False)
    assert torch.equal(kernels.paged_decode_attention(*args), cpu_ops.paged_decode_attention(*args))
    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    assert torch.equal(kernels.paged_decode_attention(*args), torch_ops.paged_decode_attention(*args))
    prefill = make_case([5, 19], [5, 4], 2, 3, 64, 8, paged_layout=True)
    prefill_args = [prefill[k] for k in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc",
                                         "max_query_len")] + [0.125]
    monkeypatch.delenv("HF_PAGED_KERNELS")
    assert torch.equal(kernels.paged_prefill_attention(*prefill_args), cpu_ops.paged_prefill_attention(*prefill_args))
    prefill_args[6] = cpu_ops.MAX_NATIVE_QUERY_LEN + 1  # a long chunk: torch's SDPA path
    assert torch.equal(kernels.paged_prefill_attention(*prefill_args), torch_ops.paged_prefill_attention(*prefill_args))
    # float64 (the reference dtype) is not a native dtype: the torch path takes it.
    assert not cpu_ops.supports(query.double(), k_cache.double(), v_cache.double())
