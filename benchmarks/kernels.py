"""hf_paged's Triton paged-attention kernels: correctness against the torch reference, speed against torch SDPA.

On a GPU, for every (batch, context) of a grid (batch 1-256, contexts 128-32k for decode; fresh prompts up to 64k tokens
per batch for prefill; points that would not fit in memory are skipped):

* correctness: the Triton output against ``hf_paged.kernels.torch_ops`` run in float64 on the same paged cache, as a
  relative error (norm of the difference over norm of the reference), on the points small enough for that reference;
* speed: ``triton.testing.do_bench`` (median) of the Triton kernel on the paged cache against
  ``F.scaled_dot_product_attention`` on the same keys/values stored contiguously as ``[B, H, L, D]``;
* the decode kernel's split of each sequence's keys over several programs (flash-decoding) against one program per
  (sequence, kv head): the number of splits, and the unsplit kernel's time beside it;
* achieved bandwidth: bytes of K and V read divided by the time, against a device-to-device copy (``dst.copy_(src)``,
  counted as bytes read + written).

Decode uses one query per sequence; SDPA gets the query heads of a KV group as rows (``[B, Hkv, G, D]``), the usual
way to run grouped-query decode without copying KV heads. Prefill is a fresh causal prompt; SDPA gets its KV heads
repeated to the query heads (compute-bound, so that barely changes its cost).

Without CUDA the Triton interpreter runs a reduced grid of tiny shapes on CPU, timed with ``time.perf_counter``
(timings and bandwidths are then meaningless; the run exists so that this script keeps working).

Usage:
    python benchmarks/kernels.py [--dtype bfloat16] [--heads 32,8] [--head-dim 128] [--json out.json]
    python benchmarks/kernels.py --smoke            # smallest grid, quick (CI)
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # must happen before anything imports triton (hf_paged does, via Transformers)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from common import HelpFormatter  # noqa: E402

from hf_paged.kernels import torch_ops, triton_ops  # noqa: E402

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # tf32 / fp16 / bf16 level
REFERENCE_TOKENS = 1 << 17  # largest batch * context checked against the float64 reference (decode)
REFERENCE_PREFILL_LEN = 2048  # longest prompt checked against the float64 reference (prefill: L x L scores)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="KV and query dtype (default: bfloat16 on GPU, float32 on CPU)")
    parser.add_argument("--heads", default=None, help="query,kv heads (default: 32,8 on GPU, 4,2 on CPU)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dimension (default: 128 on GPU, 32 on CPU)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--layout", choices=("block-major", "token-major"), default="block-major",
                        help="cache memory layout: block-major ([blocks, kv heads, block_size, head_dim]) is what "
                             "PagedCache allocates")
    parser.add_argument("--smoke", action="store_true", help="smallest grid only (quick check)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random queries and caches")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if GPU else "float32"))
    try:
        args.heads = tuple(int(h) for h in (args.heads or ("32,8" if GPU else "4,2")).split(","))
    except ValueError:
        args.heads = ()
    if len(args.heads) != 2 or min(args.heads) < 1 or args.heads[0] % args.heads[1]:
        parser.error("--heads takes QUERY,KV head counts, positive, with QUERY a multiple of KV (e.g. 32,8)")
    args.head_dim = args.head_dim or (128 if GPU else 32)
    return args


def grids(args) -> tuple[list, list]:
    """(batch, context) points for decode and for prefill."""
    if not GPU:
        points = [(1, 32), (3, 64)] if args.smoke else [(1, 32), (3, 64), (2, 160)]
        return points, points
    batches, contexts = ([1, 16], [128, 4096]) if args.smoke else ([1, 4, 16, 64, 256], [128, 1024, 4096, 16384, 32768])
    decode = [(b, c) for b in batches for c in contexts]
    prefill = [(b, c) for b in (1, 4, 16) for c in contexts if b * c <= 65536]
    return decode, prefill


# ----------------------------------------------------------------------------------------------------- problems
def make_problem(args, batch: int, context: int, gen: torch.Generator) -> dict:
    """Keys/values stored contiguously ``[B, Hkv, L, D]`` and the same values in a paged cache with shuffled blocks."""
    hq, hkv = args.heads
    bs, d = args.block_size, args.head_dim
    nb = -(-context // bs)
    keys = torch.randn(batch, hkv, nb * bs, d, generator=gen, device=DEVICE, dtype=args.dtype)
    values = torch.randn(batch, hkv, nb * bs, d, generator=gen, device=DEVICE, dtype=args.dtype)
    tables = torch.randperm(batch * nb + 1, generator=gen, device=DEVICE)[: batch * nb].view(batch, nb)
    k_cache, v_cache = (paged_copy(args, t, tables) for t in (keys, values))
    return dict(keys=keys[:, :, :context], values=values[:, :, :context], k_cache=k_cache, v_cache=v_cache,
                tables=tables.to(torch.int32), seq_lens=torch.full((batch,), context, dtype=torch.int32, device=DEVICE))


def paged_copy(args, dense: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """A ``[num_blocks, block_size, Hkv, D]`` cache holding ``dense [B, Hkv, nb * bs, D]`` at the ``tables`` blocks."""
    batch, hkv, length, d = dense.shape
    bs, nb = args.block_size, length // args.block_size
    num_blocks = batch * nb + 1
    blocks = dense.view(batch, hkv, nb, bs, d)
    if args.layout == "block-major":
        storage = torch.zeros(num_blocks, hkv, bs, d, dtype=dense.dtype, device=DEVICE)
        storage[tables.flatten()] = blocks.permute(0, 2, 1, 3, 4).reshape(batch * nb, hkv, bs, d)
        return storage.transpose(1, 2)
    storage = torch.zeros(num_blocks, bs, hkv, d, dtype=dense.dtype, device=DEVICE)
    storage[tables.flatten()] = blocks.permute(0, 2, 3, 1, 4).reshape(batch * nb, bs, hkv, d)
    return storage


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------------------- timing
def bench(fn) -> float:
    """Median milliseconds of ``fn``: do_bench on a GPU, a few perf_counter runs on CPU."""
    if GPU:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(smoke: bool) -> float:
    """GB/s of a large device-to-device copy, counting the bytes read and written."""
    nbytes = (1 << 24 if smoke else 1 << 30) if GPU else 1 << 24
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src)) / 1e6


def fits(args, batch: int, context: int, prefill: bool) -> bool:
    """Whether a point's tensors fit in 80% of the free GPU memory.

    Decode holds K and V twice (contiguous and paged) plus one transient copy while paging; prefill adds K and V
    repeated to the query heads and three query-sized tensors (queries, packed queries, output).
    """
    if not GPU:
        return True
    hq, hkv = args.heads
    one_kv = batch * context * hkv * args.head_dim * torch.empty((), dtype=args.dtype).element_size()
    need = 5 * one_kv + (5 * one_kv * hq // hkv if prefill else 0)
    return need < 0.8 * torch.cuda.mem_get_info()[0]


# ------------------------------------------------------------------------------------------------------ benches
def decode_point(args, batch: int, context: int, gen: torch.Generator) -> dict:
    hq, hkv = args.heads
    p = make_problem(args, batch, context, gen)
    query = torch.randn(batch, hq, args.head_dim, generator=gen, device=DEVICE, dtype=args.dtype)
    scale = args.head_dim ** -0.5
    paged = (query, p["k_cache"], p["v_cache"], p["tables"], p["seq_lens"], scale)
    row = dict(kind="decode", batch=batch, context=context, rel_err=None)
    if batch * context <= REFERENCE_TOKENS:
        ref = torch_ops.paged_decode_attention(query.double(), p["k_cache"].double(), p["v_cache"].double(),
                                               *paged[3:])
        row["rel_err"] = rel_err(triton_ops.paged_decode_attention(*paged), ref)
    grouped = query.view(batch, hkv, hq // hkv, args.head_dim)
    row["triton_ms"] = bench(lambda: triton_ops.paged_decode_attention(*paged))
    row["splits"] = triton_ops._num_splits(batch, hkv, query.device)
    row["unsplit_ms"] = bench(lambda: unsplit_decode(paged)) if row["splits"] > 1 else row["triton_ms"]
    row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(grouped, p["keys"], p["values"], scale=scale))
    row["kv_bytes"] = 2 * p["keys"].numel() * p["keys"].element_size()
    return row


def unsplit_decode(paged: tuple) -> torch.Tensor:
    """The decode kernel with one program per (sequence, kv head), as before the keys were split."""
    chosen = triton_ops._num_splits
    triton_ops._num_splits = lambda *args: 1
    try:
        return triton_ops.paged_decode_attention(*paged)
    finally:
        triton_ops._num_splits = chosen


def prefill_point(args, batch: int, context: int, gen: torch.Generator) -> dict:
    hq, hkv = args.heads
    p = make_problem(args, batch, context, gen)
    query = torch.randn(batch, hq, context, args.head_dim, generator=gen, device=DEVICE, dtype=args.dtype)
    packed = query.transpose(1, 2).reshape(batch * context, hq, args.head_dim)
    starts = torch.arange(0, batch * context + 1, context, dtype=torch.int32, device=DEVICE)
    scale = args.head_dim ** -0.5
    paged = (packed, p["k_cache"], p["v_cache"], p["tables"], p["seq_lens"], starts, context, scale)
    row = dict(kind="prefill", batch=batch, context=context, rel_err=None)
    if context <= REFERENCE_PREFILL_LEN:
        ref = torch_ops.paged_prefill_attention(packed.double(), p["k_cache"].double(), p["v_cache"].double(),
                                                *paged[3:])
        row["rel_err"] = rel_err(triton_ops.paged_prefill_attention(*paged), ref)
    keys, values = (t.repeat_interleave(hq // hkv, dim=1) for t in (p["keys"], p["values"]))
    row["triton_ms"] = bench(lambda: triton_ops.paged_prefill_attention(*paged))
    row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale))
    row["kv_bytes"] = 2 * p["keys"].numel() * p["keys"].element_size()
    row["flops"] = 2 * batch * hq * context * context * args.head_dim  # causal: half of 4 * B * H * L^2 * D
    return row


def finish_row(row: dict, args, copy_gbps: float) -> dict:
    for engine in ("triton", "sdpa"):
        row[f"{engine}_gbps"] = row["kv_bytes"] / row[f"{engine}_ms"] / 1e6
        if "flops" in row:
            row[f"{engine}_tflops"] = row["flops"] / row[f"{engine}_ms"] / 1e9
    row["triton_vs_copy"] = row["triton_gbps"] / copy_gbps
    row["ok"] = row["rel_err"] is None or row["rel_err"] < TOLERANCE[args.dtype]
    return row


def print_table(rows: list[dict], copy_gbps: float) -> None:
    print(f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)")
    print(f"{'kind':<8}{'B':>5}{'ctx':>7}{'triton ms':>11}{'sdpa ms':>10}{'triton GB/s':>12}{'sdpa GB/s':>11}"
          f"{'% copy':>8}{'TFLOP/s tri/sdpa':>18}{'rel err':>10}  ok  splits (1 split ms)")
    for r in rows:
        if "skipped" in r:
            print(f"{r['kind']:<8}{r['batch']:>5}{r['context']:>7}  skipped: {r['skipped']}")
            continue
        tflops = f"{r['triton_tflops']:.1f}/{r['sdpa_tflops']:.1f}" if "flops" in r else "-"
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        print(f"{r['kind']:<8}{r['batch']:>5}{r['context']:>7}{r['triton_ms']:>11.3f}{r['sdpa_ms']:>10.3f}"
              f"{r['triton_gbps']:>12.1f}{r['sdpa_gbps']:>11.1f}{r['triton_vs_copy']:>8.0%}{tflops:>18}{err:>10}"
              f"  {'yes' if r['ok'] else 'NO '}{split_note(r)}")


def split_note(row: dict) -> str:
    if row.get("splits", 1) == 1:
        return ""
    return f"  {row['splits']} ({row['unsplit_ms']:.3f}, {row['unsplit_ms'] / row['triton_ms']:.2f}x)"


def main(argv=None) -> int:
    args = parse_args(argv)
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    mode = "GPU" if GPU else "CPU, Triton interpreter (tiny shapes; timings are not meaningful)"
    print(f"{mode}: dtype {str(args.dtype)[6:]}, heads {args.heads}, head_dim {args.head_dim}, "
          f"block {args.block_size}, {args.layout}")
    copy_gbps = copy_bandwidth(args.smoke)
    decode, prefill = grids(args)
    rows = []
    for kind, points, run in (("decode", decode, decode_point), ("prefill", prefill, prefill_point)):
        for batch, context in points:
            if not fits(args, batch, context, kind == "prefill"):
                rows.append(dict(kind=kind, batch=batch, context=context, skipped="would not fit in memory"))
                continue
            rows.append(finish_row(run(args, batch, context, gen), args, copy_gbps))
            if GPU:
                torch.cuda.empty_cache()
    print_table(rows, copy_gbps)
    all_correct = all(r.get("ok", True) for r in rows)
    print("all checked points correct" if all_correct else "SOME POINTS EXCEED THE TOLERANCE")
    if args.json:
        report = dict(device=torch.cuda.get_device_name() if GPU else "cpu (triton interpreter)",
                      dtype=str(args.dtype)[6:], heads=args.heads, head_dim=args.head_dim, layout=args.layout,
                      block_size=args.block_size, copy_gbps=copy_gbps, all_correct=all_correct, rows=rows)
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all_correct else 1


if __name__ == "__main__":
    sys.exit(main())
