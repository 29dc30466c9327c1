"""The Triton kernels against a float64 run of the torch reference (:mod:`hf_paged.kernels.torch_ops`).

Without a GPU the kernels run under Triton's interpreter on CPU tensors. ``TRITON_INTERPRET=1`` must be in the
environment before anything imports ``triton``: the interpreter needs ``triton.language``'s own ``@jit`` helpers
(``tl.zeros``, ...) to have been decorated in interpreter mode. ``import hf_paged`` pulls ``triton`` in (through
Transformers), so ``tests/conftest.py`` sets the variable before that import; the line below only covers running this
file on its own. The ``ops`` fixture fails loudly if interpretation is not in effect. With a GPU the compiled kernels
are tested instead, on CUDA tensors.

Shapes are kept small so the interpreter gets through the whole file in well under a minute on two cores.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

from hf_paged.kernels import torch_ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture(scope="module")
def ops():
    """:mod:`hf_paged.kernels.triton_ops`, interpreted when there is no GPU."""
    module = importlib.import_module("hf_paged.kernels.triton_ops")
    if DEVICE == "cpu":
        import triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(tl.zeros, InterpretedFunction):
            pytest.fail("set TRITON_INTERPRET=1 before triton is first imported (see tests/conftest.py)")
        if not isinstance(module._decode_kernel, InterpretedFunction):
            module = importlib.reload(module)
    return module


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype):
    """Random caches plus block tables whose blocks are shuffled over the pool (and whose padding is garbage)."""
    per_seq = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    # Unused table entries point at real blocks of other sequences: reading them would corrupt the result.
    tables = torch.randint(0, num_blocks, (len(seq_lens), max(per_seq)), generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    used = 0
    for s, n in enumerate(per_seq):
        tables[s, :n] = order[used:used + n]
        used += n
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), tables.to(torch.int32).to(DEVICE), seq_lens.to(DEVICE)


def _queries(gen, num_tokens, num_heads, num_kv_heads, head_dim, dtype, packed_qkv):
    """Queries scaled up so softmax and softcap matter; optionally a strided view into a fused qkv tensor."""
    width = num_heads + 2 * num_kv_heads if packed_qkv else num_heads
    qkv = (2 * torch.randn(num_tokens, width, head_dim, generator=gen)).to(dtype).to(DEVICE)
    return qkv[:, :num_heads]


def _f64(*tensors):
    return [t.double() for t in tensors]


# dtype, block_size, (Hq, Hkv), head_dim, sliding_window, softcap, seq_lens
DECODE_CASES = [
    (torch.float32, 16, (4, 4), 64, None, None, [1, 17, 64, 100]),
    (torch.float32, 8, (6, 2), 80, 20, None, [5, 8, 33, 90]),
    (torch.float32, 32, (8, 2), 96, None, 5.0, [1, 31, 70]),
    (torch.float32, 16, (8, 1), 128, 7, 30.0, [3, 16, 99]),
    (torch.float32, 8, (3, 1), 64, 1, None, [1, 2, 9]),
    (torch.bfloat16, 16, (8, 2), 128, None, None, [1, 40, 77]),
    (torch.bfloat16, 8, (6, 2), 80, 16, 10.0, [7, 25, 64]),
    (torch.float16, 32, (4, 1), 96, None, 10.0, [2, 45, 100]),
    (torch.float16, 16, (8, 1), 64, 30, None, [1, 29, 81]),
]


def _split_keys(ops, monkeypatch, splits):
    """Decode over ``splits`` programs per (sequence, kv head); None keeps the kernels' own choice (one on CPU)."""
    if splits is not None:
        monkeypatch.setattr(ops, "_num_splits", lambda *args: splits)


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("dtype, block_size, heads, head_dim, window, softcap, seq_lens", DECODE_CASES)
def test_decode_matches_reference(ops, monkeypatch, dtype, block_size, heads, head_dim, window, softcap, seq_lens,
                                  splits):
    _split_keys(ops, monkeypatch, splits)
    gen = torch.Generator().manual_seed(sum(seq_lens) * 31 + head_dim)
    num_heads, num_kv_heads = heads
    k_cache, v_cache, tables, lens = _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = _queries(gen, len(seq_lens), num_heads, num_kv_heads, head_dim, dtype, packed_qkv=block_size == 8)
    scale = head_dim**-0.5

    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, window, softcap)
    ref = torch_ops.paged_decode_attention(*_f64(query, k_cache, v_cache), tables, lens, scale, window, softcap)

    assert out.dtype == dtype and out.shape == query.shape
    assert _rel_err(out, ref) < TOLERANCE[dtype]


# dtype, block_size, (Hq, Hkv), head_dim, sliding_window, softcap, cached context lens, new query lens
PREFILL_CASES = [
    (torch.float32, 16, (4, 4), 64, None, None, [0, 13, 40], [9, 4, 23]),
    (torch.float32, 8, (3, 1), 80, 12, None, [5, 0, 30], [1, 20, 7]),
    (torch.float32, 32, (8, 2), 96, None, 5.0, [0, 50], [70, 3]),  # 70 queries: two BLOCK_M tiles
    (torch.float32, 16, (8, 1), 128, 9, 30.0, [17, 0, 2], [6, 11, 1]),
    (torch.bfloat16, 16, (4, 1), 128, None, 10.0, [0, 21, 33], [18, 5, 1]),
    (torch.bfloat16, 8, (6, 2), 64, 20, None, [40, 3], [12, 16]),
    (torch.float16, 32, (8, 2), 80, None, None, [0, 37], [25, 8]),
    (torch.float16, 8, (3, 3), 96, 6, 20.0, [11, 0], [5, 14]),
]


@pytest.mark.parametrize(
    "dtype, block_size, heads, head_dim, window, softcap, ctx_lens, q_lens", PREFILL_CASES
)
def test_prefill_matches_reference(ops, dtype, block_size, heads, head_dim, window, softcap, ctx_lens, q_lens):
    gen = torch.Generator().manual_seed(sum(ctx_lens) * 17 + sum(q_lens) + head_dim)
    num_heads, num_kv_heads = heads
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    k_cache, v_cache, tables, lens = _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    query = _queries(gen, sum(q_lens), num_heads, num_kv_heads, head_dim, dtype, packed_qkv=window is not None)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    out = ops.paged_prefill_attention(
        query, k_cache, v_cache, tables, lens, starts, max(q_lens), scale, window, softcap
    )
    ref = torch_ops.paged_prefill_attention(
        *_f64(query, k_cache, v_cache), tables, lens, starts, max(q_lens), scale, window, softcap
    )

    assert out.dtype == dtype and out.shape == query.shape
    assert _rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("splits", [None, 4])
def test_decode_empty_sequence_outputs_zeros(ops, monkeypatch, splits):
    """A sequence with no keys (e.g. a padded batch slot) returns zeros; its neighbours are unaffected."""
    _split_keys(ops, monkeypatch, splits)
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache, tables, lens = _paged_cache(gen, [0, 11, 0, 3], 8, 2, 64, torch.float32)
    query = _queries(gen, 4, 4, 2, 64, torch.float32, packed_qkv=False)
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, None, 20.0)
    ref = torch_ops.paged_decode_attention(*_f64(query, k_cache, v_cache), tables, lens, 0.125, None, 20.0)
    assert torch.count_nonzero(out[[0, 2]]) == 0
    assert _rel_err(out[[1, 3]], ref[[1, 3]]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype, window, splits", [(torch.float32, None, None), (torch.bfloat16, 6, None),
                                                   (torch.float32, None, 5)])
def test_attention_sinks_match_reference(ops, monkeypatch, dtype, window, splits):
    """A sink logit per query head in every row's softmax, decode and prefill; a sequence without keys still
    returns zeros."""
    _split_keys(ops, monkeypatch, splits)
    gen = torch.Generator().manual_seed(11)
    seq_lens, q_lens = [0, 13, 40], [1, 5, 17]
    k_cache, v_cache, tables, lens = _paged_cache(gen, seq_lens, 8, 2, 64, dtype)
    sinks = (2 * torch.randn(6, generator=gen)).to(DEVICE)
    query = _queries(gen, len(seq_lens), 6, 2, 64, dtype, packed_qkv=False)
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125, window, None, sinks)
    ref = torch_ops.paged_decode_attention(*_f64(query, k_cache, v_cache), tables, lens, 0.125, window, None,
                                           sinks.double())
    assert torch.count_nonzero(out[0]) == 0 and _rel_err(out[1:], ref[1:]) < TOLERANCE[dtype]
    query = _queries(gen, sum(q_lens), 6, 2, 64, dtype, packed_qkv=False)
    starts = torch.tensor([0, 1, 6, 23], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([1, 13, 40], dtype=torch.int32, device=DEVICE)
    out = ops.paged_prefill_attention(query, k_cache, v_cache, tables, lens, starts, 17, 0.125, window, None, sinks)
    ref = torch_ops.paged_prefill_attention(*_f64(query, k_cache, v_cache), tables, lens, starts, 17, 0.125, window,
                                            None, sinks.double())
    assert _rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("seed", range(12))
def test_random_configurations(ops, monkeypatch, seed):
    """Seeded random mixes of everything above, decode and prefill over the same pages."""
    rng = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=rng))]

    _split_keys(ops, monkeypatch, pick([None, 2, 5, 16]))

    dtype = pick([torch.float32, torch.float32, torch.float16, torch.bfloat16])
    block_size, head_dim = pick([8, 16, 32]), pick([64, 80, 96, 128])
    num_kv_heads, group = pick([1, 2, 3]), pick([1, 3, 4, 8])
    window, softcap = pick([None, None, 1, 5, 24]), pick([None, 3.0, 50.0])
    num_seqs = int(torch.randint(1, 5, (1,), generator=rng))
    q_lens = torch.randint(1, 24, (num_seqs,), generator=rng).tolist()
    seq_lens = [q + int(torch.randint(0, 80, (1,), generator=rng)) for q in q_lens]
    num_heads, scale = num_kv_heads * group, head_dim**-0.5
    k_cache, v_cache, tables, lens = _paged_cache(rng, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    f64 = _f64(k_cache, v_cache)

    query = _queries(rng, num_seqs, num_heads, num_kv_heads, head_dim, dtype, packed_qkv=seed % 2 == 0)
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, window, softcap)
    ref = torch_ops.paged_decode_attention(query.double(), *f64, tables, lens, scale, window, softcap)
    assert _rel_err(out, ref) < TOLERANCE[dtype]

    query = _queries(rng, sum(q_lens), num_heads, num_kv_heads, head_dim, dtype, packed_qkv=seed % 2 == 1)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    args = (tables, lens, starts, max(q_lens), scale, window, softcap)
    out = ops.paged_prefill_attention(query, k_cache, v_cache, *args)
    ref = torch_ops.paged_prefill_attention(query.double(), *f64, *args)
    assert _rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [None, 4])
def test_prefill_left_padding_sees_nothing(ops, window):
    """Queries past the keys (``seq_len < q_len``) are padding: they output zeros, the rest match the reference."""
    gen = torch.Generator().manual_seed(7)
    head_dim, block_size, num_heads, num_kv_heads = 64, 8, 4, 2
    q_lens, seq_lens = [10, 6, 3], [4, 6, 1]  # 6 padded queries, none, 2 padded
    k_cache, v_cache, tables, lens = _paged_cache(gen, seq_lens, block_size, num_kv_heads, head_dim, torch.float32)
    query = _queries(gen, sum(q_lens), num_heads, num_kv_heads, head_dim, torch.float32, packed_qkv=False)
    starts = torch.tensor([0, 10, 16, 19], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5

    # max_query_len may overestimate: the extra query tiles have nothing to do.
    out = ops.paged_prefill_attention(query, k_cache, v_cache, tables, lens, starts, 40, scale, window)
    ref = torch_ops.paged_prefill_attention(*_f64(query, k_cache, v_cache), tables, lens, starts, 10, scale, window)

    padded = torch.zeros(sum(q_lens), dtype=torch.bool)
    padded[[0, 1, 2, 3, 4, 5, 16, 17]] = True
    assert torch.count_nonzero(out[padded]) == 0
    assert out[~padded].abs().amin(dim=-1).gt(0).any()
    assert _rel_err(out, ref) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "dtype, src_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 80), (1, 128)])
def test_reshape_and_cache_matches_reference(ops, dtype, src_dtype, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks, block_size, num_tokens = 6, 16, 11
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    # Keys/values as strided views into a fused projection.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(src_dtype).to(DEVICE)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:2 * num_kv_heads]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 4, 10]] = -1
    slots = slots.to(DEVICE)

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    torch_ops.reshape_and_cache(key, value, expected_k, expected_v, slots)
    ops.reshape_and_cache(key, value, k_cache, v_cache, slots)

    if dtype != src_dtype and DEVICE == "cpu":
        # The interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest: allow one ulp.
        torch.testing.assert_close(k_cache, expected_k, rtol=2**-7, atol=0)
        torch.testing.assert_close(v_cache, expected_v, rtol=2**-7, atol=0)
    else:
        assert torch.equal(k_cache, expected_k)
        assert torch.equal(v_cache, expected_v)


def test_reshape_and_cache_then_decode(ops):
    """Tokens written by the Triton cache writer are the ones the Triton decode kernel reads back."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim, num_heads = 8, 2, 64, 4
    k_cache = torch.zeros(5, block_size, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    tables = torch.tensor([[3, 0, 4]], dtype=torch.int32, device=DEVICE)
    keys = torch.randn(20, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    values = torch.randn(20, num_kv_heads, head_dim, generator=gen).to(DEVICE)
    positions = torch.arange(20, device=DEVICE)
    slots = tables[0, positions // block_size].long() * block_size + positions % block_size
    ops.reshape_and_cache(keys, values, k_cache, v_cache, slots)

    query = torch.randn(1, num_heads, head_dim, generator=gen).to(DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    out = ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.double().transpose(0, 1), keys.double().transpose(0, 1).repeat_interleave(2, 0),
        values.double().transpose(0, 1).repeat_interleave(2, 0), scale=head_dim**-0.5,
    ).transpose(0, 1)
    assert _rel_err(out, ref) < TOLERANCE[torch.float32]


def test_dispatch_follows_hf_paged_kernels(ops, monkeypatch):
    import hf_paged.kernels as kernels

    probe = torch.zeros(1, device=DEVICE)
    monkeypatch.setenv("HF_PAGED_KERNELS", "triton")
    assert kernels.use_triton(probe)
    assert kernels._impl(probe) is ops

    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, tables, lens = _paged_cache(gen, [5, 19], 8, 2, 64, torch.float32)
    query = _queries(gen, 2, 4, 2, 64, torch.float32, packed_qkv=False)
    via_dispatch = kernels.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(via_dispatch, ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125))

    monkeypatch.setenv("HF_PAGED_KERNELS", "torch")
    assert kernels._impl(probe) is torch_ops


def test_paged_layout_cache_views_match_torch():
    """PagedCache hands the kernels transposed views of its block-major storage; the Triton kernels follow their strides."""
    from hf_paged.kernels import torch_ops, triton_ops
    from kernel_cases import make_case

    def on_device(case: dict) -> dict:  # strides kept: the caches stay transposed views
        return {key: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for key, value in case.items()}

    case = on_device(make_case([5, 19, 33], [1, 1, 1], 2, 3, 64, 8, paged_layout=True))
    assert not case["k_cache"].is_contiguous()
    args = (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], 0.125)
    torch.testing.assert_close(triton_ops.paged_decode_attention(*args), torch_ops.paged_decode_attention(*args),
                               rtol=1e-5, atol=1e-5)
    case = on_device(make_case([5, 19, 33], [5, 4, 9], 2, 3, 64, 8, paged_layout=True))
    args = (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
            case["query_start_loc"], case["max_query_len"], 0.125)
    torch.testing.assert_close(triton_ops.paged_prefill_attention(*args), torch_ops.paged_prefill_attention(*args),
                               rtol=1e-5, atol=1e-5)
