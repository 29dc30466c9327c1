"""Decode speed at small batch sizes, side by side in one sitting: hf_paged (its native CPU decoder), hf_paged with
``--enforce-eager`` (every step through the Transformers forward), an older checkout of hf_paged (``--baseline``),
Transformers' own ``generate``, and llama.cpp (``--llama-bench`` with ``--gguf``).

Each variant decodes B requests of ``--prompt`` prompt tokens and ``--output`` greedy tokens at once, in a fresh
process (`throughput.py` runs it); its decode tokens/s is B over the median time per output token. llama.cpp's is
S_TG of ``llama-batched-bench -npp P -ntg O -npl B -t THREADS -fa on`` on the same weights converted to GGUF. The
variants take turns over ``--rounds`` rounds, since the machine's speed drifts; each cell is the median of its
rounds, and the ratios compare cells of the same row.

Usage:
    python benchmarks/decode.py --batch-sizes 1,4,8 --dtypes float32,bfloat16 --baseline /tmp/hf_paged-old \\
        --llama-bench /opt/llama.cpp/build/bin/llama-batched-bench --gguf /tmp/smollm2-f32.gguf,/tmp/smollm2-bf16.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("ours", "eager", "baseline", "generate", "llama.cpp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default=None, help="local model directory (default: the embedded SmolLM2-135M-Instruct)")
    add("--batch-sizes", default="1,4,8", help="comma list of batch sizes (default: 1,4,8)")
    add("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16 (default: both)")
    add("--prompt", type=int, default=128, help="prompt tokens of every request (default: 128)")
    add("--output", type=int, default=128, help="greedy output tokens of every request (default: 128)")
    add("--rounds", type=int, default=2, help="turns each variant takes (default: 2)")
    add("--threads", type=int, default=None, help="torch and llama.cpp threads (default: all cores)")
    add("--device", default="cpu", help="where hf_paged and generate run, cpu or cuda (ours: CUDA graphs, eager: none)")
    add("--variants", default="ours,eager,baseline,generate,llama.cpp",
        help="comma list of the variants to run, a subset of " + ",".join(VARIANTS))
    add("--baseline", default=None, help="a checkout of an older hf_paged (its benchmarks/throughput.py runs it)")
    add("--llama-bench", default=None, help="a built llama-batched-bench binary")
    add("--gguf", default=None, help="comma list of GGUF files, in --dtypes order, for llama.cpp")
    add("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.variants = [v for v in args.variants.split(",") if v]
    if set(args.variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(args.variants) - set(VARIANTS))}")
    if "baseline" in args.variants and not args.baseline:
        args.variants.remove("baseline")
    if "llama.cpp" in args.variants and not (args.llama_bench and args.gguf):
        args.variants.remove("llama.cpp")
    if args.gguf:
        args.gguf = dict(zip(args.dtypes, args.gguf.split(",")))
    return args


def throughput_run(args, variant: str, dtype: str, batch: int) -> float:
    """Decode tokens/s of one hf_paged or generate run."""
    root = Path(args.baseline).resolve() if variant == "baseline" else HERE.parent
    engine = "static" if variant == "generate" else "ours"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp, "report.json")
        cmd = [sys.executable, str(root / "benchmarks" / "throughput.py"), "--engines", engine, "--dtype", dtype,
               "--num-requests", str(batch), "--min-prompt", str(args.prompt), "--max-prompt", str(args.prompt),
               "--min-output", str(args.output), "--max-output", str(args.output),
               "--static-batch-size", str(batch), "--json", str(report)]
        if args.model:
            cmd += ["--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.device != "cpu":
            cmd += ["--device", args.device]
        if variant == "eager":
            cmd += ["--enforce-eager"]
        # The tree first, before what the caller put on the path (a newer Transformers, say), which stays.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} failed: {proc.stderr[-2000:]}")
        (row,) = [r for r in json.loads(report.read_text())["rows"] if r["engine"] == engine]
    if row.get("error"):
        raise RuntimeError(f"{variant} failed: {row['error'][-2000:]}")
    return batch / row["tpot_p50"]


def llama_run(args, dtype: str) -> dict[int, float]:
    """llama.cpp's S_TG at every batch size, in one llama-batched-bench call."""
    cmd = [args.llama_bench, "-m", args.gguf[dtype], "-c", str(max(args.batch_sizes) * (args.prompt + args.output)),
           "-npp", str(args.prompt), "-ntg", str(args.output), "-npl", ",".join(map(str, args.batch_sizes)),
           "-t", str(args.threads or os.cpu_count()), "-fa", "on"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed: {proc.stderr[-2000:]}")
    return decode_speeds(proc.stdout)


def decode_speeds(table: str) -> dict[int, float]:
    """S_TG by batch size from llama-batched-bench's table (``| PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s |
    S_TG t/s | ...``)."""
    speeds = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit() and re.fullmatch(r"[\d.]+", cells[7]):
            speeds[int(cells[2])] = float(cells[7])
    return speeds


def measure(args) -> dict:
    """``results[dtype][batch][variant]``: the tokens/s of every round."""
    results = {d: {b: {v: [] for v in args.variants} for b in args.batch_sizes} for d in args.dtypes}
    for round_ in range(args.rounds):
        for dtype in args.dtypes:
            if "llama.cpp" in args.variants:
                for batch, speed in llama_run(args, dtype).items():
                    if batch in results[dtype]:
                        results[dtype][batch]["llama.cpp"].append(speed)
            for batch in args.batch_sizes:
                for variant in [v for v in args.variants if v != "llama.cpp"]:
                    speed = throughput_run(args, variant, dtype, batch)
                    results[dtype][batch][variant].append(speed)
                    print(f"round {round_ + 1}: {dtype} B={batch} {variant}: {speed:.1f} tok/s", file=sys.stderr)
    return results


def print_table(args, results: dict) -> None:
    peers = [v for v in args.variants if v != "ours"]
    header = f"{'dtype':<9}{'B':>3}" + "".join(f"{v:>11}" for v in args.variants) + "".join(
        f"{'ours/' + v:>16}" for v in peers)
    print("\ndecode tokens/s (median of rounds)\n" + header + "\n" + "-" * len(header))
    for dtype, by_batch in results.items():
        for batch, cells in by_batch.items():
            med = {v: statistics.median(cells[v]) if cells[v] else None for v in args.variants}
            line = f"{dtype:<9}{batch:>3}" + "".join(f"{med[v]:>11.1f}" if med[v] else f"{'-':>11}"
                                                     for v in args.variants)
            for v in peers:
                ratio = med["ours"] / med[v] if med.get("ours") and med[v] else None
                line += f"{ratio:>15.2f}x" if ratio else f"{'-':>16}"
            print(line)


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = measure(args)
    print_table(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(settings=vars(args), results=results), indent=2))
    return results


if __name__ == "__main__":
    main()
