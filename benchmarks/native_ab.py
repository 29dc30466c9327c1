"""Builds of the native decoder (``hf_paged/kernels/cpu_decoder.cpp``) side by side in one process: the engine decodes
B sequences and the builds take turns step by step, so that the machine's drifting speed falls on all of them alike.

Each variant is a source file of the decoder, optionally followed by ``@`` and compiler flags (``new.cpp@-DX=1``);
each is compiled with the package's own flags and linked with the package's attention kernels. The report gives each
variant's median time of a B-token decode step and its speed relative to the first variant.

Usage:
    git show HEAD~1:hf_paged/kernels/cpu_decoder.cpp > /tmp/old.cpp
    python benchmarks/native_ab.py /tmp/old.cpp hf_paged/kernels/cpu_decoder.cpp --dtypes bfloat16 --batch-sizes 2,5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import throughput  # before `common`, which takes this folder off sys.path

from common import HelpFormatter


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("variants", nargs="+", help="decoder sources, each optionally SOURCE@FLAGS (flags split at spaces)")
    add("--model", default=None, help="local model directory (default: the embedded SmolLM2-135M-Instruct)")
    add("--dtypes", default="float32,bfloat16", help="comma list of float32, bfloat16")
    add("--batch-sizes", default="1,2,4,8", help="comma list of decode batch sizes, 1-8")
    add("--prompt", type=int, default=128, help="prompt tokens of every request")
    add("--output", type=int, default=128, help="greedy output tokens of every request")
    add("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not all(1 <= b <= 8 for b in args.batch_sizes):
        parser.error("--batch-sizes must lie in 1-8 (the native decoder's steps)")
    return args


def build_variants(variants: list[str], out_dir: Path) -> list[ctypes.CDLL]:
    """One shared library per variant: its decoder source with the package's flags (and its own), the package's
    attention sources as they are."""
    from hf_paged.kernels import cpu_decoder, native

    compiler = native.compiler()
    if compiler is None:
        raise SystemExit("no C++ compiler ($CXX, g++ or c++)")
    decoder = next(s for s in native.SOURCES if s.name == "cpu_decoder.cpp")
    include = f"-I{decoder.parent}"
    others = []  # the objects of the other sources
    for source in (s for s in native.SOURCES if s != decoder):
        others.append(str(out_dir / f"{source.stem}.o"))
        subprocess.run([compiler, *native.SOURCES[source], include, "-c", str(source), "-o", others[-1]], check=True)
    libraries = []
    for i, variant in enumerate(variants):
        source, _, flags = variant.partition("@")
        obj, lib = out_dir / f"decoder{i}.o", out_dir / f"variant{i}.so"
        subprocess.run([compiler, *native.SOURCES[decoder], *flags.split(), include, "-c", source, "-o", str(obj)],
                       check=True)
        subprocess.run([compiler, *native.LINK_FLAGS, str(obj), *others, "-o", str(lib)], check=True)
        library = ctypes.CDLL(str(lib))
        cpu_decoder._bind(library)  # the same checks as the package's own build
        libraries.append(library)
    return libraries


def time_steps(args, dtype: str, libraries: list[ctypes.CDLL]) -> dict[int, list[float]]:
    """Median seconds of a B-sequence decode step per variant, for each batch size."""
    from hf_paged import SamplingParams
    from hf_paged.kernels import cpu_decoder

    model, tokenizer = throughput.load_model(args.model, dtype, "paged")
    workload_args = throughput.parse_args(["--num-requests", str(max(args.batch_sizes)), "--min-prompt",
                                           str(args.prompt), "--max-prompt", str(args.prompt)])
    prompts = throughput.make_workload(workload_args, tokenizer)["prompts"]
    generator = throughput.make_generator(workload_args, model, tokenizer)
    if generator.runner.native is None:
        raise SystemExit(f"the native decoder does not run {type(model).__name__} in {dtype}: nothing to compare")
    times, turn, execute = defaultdict(list), [0], generator.runner.execute

    def timed_execute(batch):
        start = time.perf_counter()
        result = execute(batch)
        times[(sum(batch.num_tokens), turn[0])].append(time.perf_counter() - start)
        return result

    generator.runner.execute = timed_execute
    medians = {}
    for b in args.batch_sizes:
        for prompt in prompts[:b]:
            generator.add_request(prompt, SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True))
        step = 0
        while generator.has_unfinished_requests():
            turn[0] = step % len(libraries)
            cpu_decoder._library = libraries[turn[0]]  # the library the native decoder calls this step
            generator.step()
            step += 1
        medians[b] = [statistics.median(times[(b, i)]) for i in range(len(libraries))]
    return medians


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    from hf_paged.default_model import resolve_model
    from hf_paged.kernels import cpu_decoder

    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = resolve_model(args.model)
    if not cpu_decoder.available():
        raise SystemExit("the package's native library does not build here")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        libraries = build_variants(args.variants, Path(tmp))
        for dtype in args.dtypes:
            results[dtype] = time_steps(args, dtype, libraries)
    print(f"\nmedian decode step, ms (x: speed relative to {args.variants[0]})")
    for dtype, rows in results.items():
        for b, medians in rows.items():
            cells = " | ".join(f"{v}: {m * 1e3:.2f} ({medians[0] / m:.3f}x)" for v, m in zip(args.variants, medians))
            print(f"{dtype} B={b}: {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(variants=args.variants, median_step_s=results), indent=2))
    return results


if __name__ == "__main__":
    main()
