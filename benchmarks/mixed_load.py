"""Short chats arriving while a long prompt is computed: how long each waits for its first token, side by side.

One request of ``--long-prompt`` tokens arrives at t=0; ``--chats`` short chat requests arrive from ``--first-chat-at``
seconds on, one every ``--interval`` seconds, while it is prefilled. The engine is stepped in this process as a server's
loop steps it, a request joining at the first step after its arrival time. Reported for every variant: the chats' time
to first token (from their arrival times, p50 and max), the largest gap between two tokens of a chat, the long prompt's
time to first token, and the wall time of the whole load.

The variants are this checkout (``ours``), an older checkout (``--baseline``) and this checkout under other engine
options (``--variant NAME=JSON``, keyword arguments of `ContinuousBatchGenerator`). Each run is a fresh process, warmed
by one small request first; the variants take turns over ``--rounds`` rounds (the order reversed every other round,
since the machine's speed drifts), each cell is the median of its rounds and the ratios compare a variant with ours.

Usage:
    python benchmarks/mixed_load.py --baseline /tmp/hf_paged-old --rounds 3
    python benchmarks/mixed_load.py --variant 'uncapped={"long_prefill_token_threshold": 0}' --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import WORDS, HelpFormatter  # first: takes this folder off sys.path

HERE = Path(__file__).resolve().parent
METRICS = ("chat_ttft_p50", "chat_ttft_max", "chat_gap_max", "long_ttft", "wall")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--model", default=None, help="local model directory (default: the embedded SmolLM2-135M-Instruct)")
    add("--dtype", choices=("float32", "bfloat16"), default="float32")
    add("--long-prompt", type=int, default=4000, help="tokens of the long prompt")
    add("--long-output", type=int, default=8, help="output tokens of the long request")
    add("--chats", type=int, default=6, help="short chat requests")
    add("--chat-output", type=int, default=32, help="output tokens of each chat")
    add("--first-chat-at", type=float, default=0.5, help="seconds after the long prompt that the first chat arrives")
    add("--interval", type=float, default=0.7, help="seconds between two chats' arrivals")
    add("--baseline", default=None, help="a checkout of an older hf_paged, run as the variant `baseline`")
    add("--variant", action="append", default=[], metavar="NAME=JSON",
        help="this checkout under other ContinuousBatchGenerator options, e.g. "
             "'small={\"max_num_batched_tokens\": 512}'")
    add("--rounds", type=int, default=3, help="turns each variant takes")
    add("--threads", type=int, default=None, help="torch threads of each run (default: torch's choice)")
    add("--json", default=None, help="also write the results to this JSON file")
    add("--worker", nargs=3, default=None, metavar=("TREE", "OPTIONS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.chats < 1:
        parser.error("--rounds and --chats must be at least 1")
    args.variants = {"ours": (HERE.parent, {})}
    if args.baseline:
        args.variants["baseline"] = (Path(args.baseline).resolve(), {})
    for spec in args.variant:
        name, sep, options = spec.partition("=")
        try:
            args.variants[name] = (HERE.parent, json.loads(options))
        except json.JSONDecodeError as exc:
            parser.error(f"--variant {spec!r}: the options after NAME= must be a JSON object ({exc})")
        if not sep or not name or not isinstance(args.variants[name][1], dict):
            parser.error(f"--variant {spec!r}: expected NAME={{JSON object}}")
    return args


def workload(args, tokenizer) -> list[tuple[float, str, list[int], int]]:
    """``(arrival seconds, request id, prompt ids, output tokens)`` of every request, in arrival order."""
    rng, long_ids = random.Random(0), []
    while len(long_ids) < args.long_prompt:
        long_ids += tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(200)), add_special_tokens=False)
    requests = [(0.0, "long", long_ids[:args.long_prompt], args.long_output)]
    for i in range(args.chats):
        messages = [{"role": "user", "content": f"Question {i}: tell me a short fact about the number {i}."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        requests.append((args.first_chat_at + i * args.interval, f"chat{i}", ids, args.chat_output))
    return requests


def serve(generator, requests: list, params) -> dict[str, dict]:
    """Step ``generator`` through the arrivals; each request's arrival and token times (seconds from the start)."""
    pending, times = list(requests), {}
    start = time.perf_counter()
    while pending or generator.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            arrival, request_id, ids, max_tokens = pending.pop(0)
            generator.add_request({"prompt_token_ids": ids}, params(max_tokens), request_id=request_id)
            times[request_id] = {"arrival": arrival, "tokens": []}
        if not generator.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outputs = generator.step()
        done = time.perf_counter() - start
        for output in outputs:
            times[output.request_id]["tokens"] += [done] * len(output.outputs[0].token_ids)
    return times


def run_worker(args) -> None:
    """One variant's run in this process, of the hf_paged in the tree that the parent named."""
    sys.path.insert(0, args.worker[0])
    import torch

    from hf_paged import ContinuousBatchGenerator, SamplingParams
    from hf_paged.generation.outputs import RequestOutputKind
    from hf_paged.loading import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    generator = ContinuousBatchGenerator(model, tokenizer, **json.loads(args.worker[1]))

    def params(max_tokens: int):
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    serve(generator, [(0.0, "warm-up", tokenizer.encode("a warm-up prompt")[:16], 4)], params)
    times = serve(generator, workload(args, tokenizer), params)
    Path(args.worker[2]).write_text(json.dumps(times))


def summary(times: dict[str, dict]) -> dict[str, float]:
    """The reported figures of one run (seconds)."""
    chats = [t for request_id, t in times.items() if request_id.startswith("chat")]
    ttft = [t["tokens"][0] - t["arrival"] for t in chats]
    gaps = [b - a for t in chats for a, b in zip(t["tokens"], t["tokens"][1:])]
    return dict(chat_ttft_p50=statistics.median(ttft), chat_ttft_max=max(ttft), chat_gap_max=max(gaps, default=0.0),
                long_ttft=times["long"]["tokens"][0], wall=max(t["tokens"][-1] for t in times.values()))


def run_variant(args, root: Path, options: dict) -> dict[str, float]:
    """One run in a fresh process: the figures of `summary`."""
    workload_flags = ["--dtype", args.dtype, "--long-prompt", args.long_prompt, "--long-output", args.long_output,
                      "--chats", args.chats, "--chat-output", args.chat_output, "--first-chat-at", args.first_chat_at,
                      "--interval", args.interval]
    workload_flags += ["--model", args.model] * bool(args.model) + ["--threads", args.threads] * bool(args.threads)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "times.json")
        proc = subprocess.run([sys.executable, __file__, *map(str, workload_flags), "--worker", str(root),
                               json.dumps(options), str(out)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"a run from {root} with {options} failed:\n{proc.stderr[-3000:]}")
        return summary(json.loads(out.read_text()))


def measure(args) -> dict[str, list[dict]]:
    """Every variant's figures in every round, the variants taking turns."""
    results: dict[str, list[dict]] = {name: [] for name in args.variants}
    for round_number in range(args.rounds):
        names = list(args.variants) if round_number % 2 == 0 else list(args.variants)[::-1]
        for name in names:
            results[name].append(run_variant(args, *args.variants[name]))
            figures = " ".join(f"{k}={v:.2f}" for k, v in results[name][-1].items())
            print(f"round {round_number + 1}: {name}: {figures}", file=sys.stderr, flush=True)
    return results


def print_table(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    medians = {name: {m: statistics.median(r[m] for r in runs) for m in METRICS} for name, runs in results.items()}
    header = f"{'variant':<14}" + "".join(f"{m:>15}" for m in METRICS) + f"{'ttft p50 / ours':>17}"
    print("\nseconds (median of rounds)\n" + header + "\n" + "-" * len(header))
    for name, cells in medians.items():
        ratio = cells["chat_ttft_p50"] / medians["ours"]["chat_ttft_p50"]
        print(f"{name:<14}" + "".join(f"{cells[m]:>15.2f}" for m in METRICS) + f"{ratio:>16.2f}x")
    return medians


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    results = measure(args)
    report = dict(settings={k: v for k, v in vars(args).items() if k != "variants"}, results=results,
                  medians=print_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
