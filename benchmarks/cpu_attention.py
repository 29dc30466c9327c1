"""hf_paged's CPU attention kernels on prompt chunks, side by side in one process: the row kernel
(``cpu_attention.cpp``), the AMX tiles that bf16 prompt rows take where the CPU has them (``cpu_tile_attention.cpp``),
and torch's SDPA over the gathered blocks (``torch_ops``, the path for chunks longer than the kernel takes).

For each (chunk, earlier keys) point, one sequence's chunk of fresh prompt rows attends causally over the keys
before it and its own, on a paged cache with shuffled blocks. The three take turns call by call (``--turns`` each,
fastest kept), so the machine's drifting speed falls on all of them alike; at the points small enough for it (chunk
x keys up to 65536) each is also checked against float64 attention. Heads default to SmolLM2-135M's (9 query heads,
3 kv heads, head_dim 64).

Usage:
    python benchmarks/cpu_attention.py [--dtype bfloat16] [--points 512:0,512:512,128:2048] [--heads 9,3]
    python benchmarks/cpu_attention.py --smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from common import HelpFormatter

from hf_paged.kernels import cpu_ops, torch_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kernel_cases import make_case, naive_attention  # noqa: E402

DEFAULT_POINTS = "64:0,235:0,512:0,16:1024,512:512,128:2048,512:2048"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--points", default=DEFAULT_POINTS, help="comma list of CHUNK:EARLIER_KEYS")
    parser.add_argument("--heads", default="9,3", help="query,kv heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--turns", type=int, default=15, help="calls of each kernel per point")
    parser.add_argument("--smoke", action="store_true", help="two small points, three turns (quick check)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.heads = tuple(int(x) for x in args.heads.split(","))
    if args.smoke:
        args.points, args.turns = "20:0,33:40", 3
    args.points = [tuple(int(x) for x in point.split(":")) for point in args.points.split(",")]
    return args


def kernels(args, case) -> dict:
    """The ways to attend the case's chunk, each a function of no arguments."""
    call = (case["query"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"],
            case["query_start_loc"], case["max_query_len"], args.head_dim**-0.5)
    prompt = torch.ones(case["query"].shape[0], dtype=torch.bool)
    ways = {"rows": lambda: cpu_ops.paged_prefill_attention(*call)}
    if cpu_ops.tile_attention(args.dtype, args.head_dim):
        ways["tiles"] = lambda: cpu_ops.paged_prefill_attention(*call, prompt_rows=prompt)
    ways["sdpa"] = lambda: torch_ops.paged_prefill_attention(*call)
    return ways


def point(args, chunk: int, earlier: int) -> dict:
    heads, kv_heads = args.heads
    case = make_case([earlier + chunk], [chunk], kv_heads, heads // kv_heads, args.head_dim, args.block_size,
                     dtype=args.dtype, paged_layout=True)
    ways = kernels(args, case)
    reference = naive_attention(case, args.head_dim**-0.5) if chunk * (earlier + chunk) <= 1 << 16 else None
    row = dict(chunk=chunk, earlier=earlier)
    for name, fn in ways.items():
        out = fn()  # warm-up, and the output checked
        row[f"{name}_err"] = None if reference is None else (out.double() - reference).abs().max().item()
    times = {name: [] for name in ways}
    for _ in range(args.turns):
        for name, fn in ways.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name in ways:
        row[f"{name}_ms"] = min(times[name])
    return row


def main(argv=None) -> int:
    args = parse_args(argv)
    if not cpu_ops.available():
        raise SystemExit("the native CPU kernels are not built (no C++ compiler?)")
    rows = [point(args, chunk, earlier) for chunk, earlier in args.points]
    tiles = "tiles_ms" in rows[0]
    print(f"dtype {str(args.dtype)[6:]}, heads {args.heads}, head_dim {args.head_dim}, block {args.block_size}, "
          f"{torch.get_num_threads()} threads; AMX tiles for prompt rows: {'yes' if tiles else 'no'}")
    print(f"{'chunk':>6}{'earlier':>9}{'rows ms':>10}{'tiles ms':>10}{'sdpa ms':>10}{'rows/sdpa':>11}"
          f"{'tiles/rows':>12}{'tiles/sdpa':>12}")
    for r in rows:
        t = r.get("tiles_ms")
        cells = (f"{t:>10.2f}", f"{r['rows_ms'] / t:>11.2f}x", f"{r['sdpa_ms'] / t:>11.2f}x") if t else (
            f"{'-':>10}", f"{'-':>12}", f"{'-':>12}")
        print(f"{r['chunk']:>6}{r['earlier']:>9}{r['rows_ms']:>10.2f}{cells[0]}{r['sdpa_ms']:>10.2f}"
              f"{r['sdpa_ms'] / r['rows_ms']:>10.2f}x{cells[1]}{cells[2]}")
    errors = [v for r in rows for k, v in r.items() if k.endswith("_err") and v is not None]
    correct = all(e < TOLERANCE[args.dtype] for e in errors)
    print(f"{len(errors)} outputs checked against float64 attention: {'all correct' if correct else 'NOT correct'}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(rows=rows, tiles=tiles, all_correct=correct), indent=1))
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
