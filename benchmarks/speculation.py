"""Speculative decoding against none, side by side in one process: the same model, two generators (one with
``--speculative-config``, one without), taking turns over ``--rounds`` rounds on the same seeded workload.

By default the requests run one at a time (one user: each request's output tokens/s is what speculation is for); with
``--at-once`` they all arrive together, as in `throughput.py` (speculation then only runs while few are left).
Prefix caching is off, so that every round prefills its prompts in full, as the first one does. Every other flag is
`throughput.py`'s and picks the workload, model, dtype and engine sizes, e.g. ``--workload grounded``.

The variants take turns at every request (with ``--at-once``, at every round), in alternating order, so that both see
the machine's drifting speed alike. The report gives each variant's output tokens/s in every round (output tokens over
its wall time, prompts included) and decode tokens/s (the tokens after each request's first over the time after its
first: what speculation can speed up, as `decode.py` measures), the ratios of the two variants in every round, whether
the greedy tokens of the first round were identical, and the guesses kept.

Usage:
    python benchmarks/speculation.py --workload grounded --num-requests 6 --min-prompt 192 --max-prompt 192 \\
        --min-output 128 --max-output 128 --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    python benchmarks/speculation.py --at-once --speculative-config '{"method": "ngram"}'   # the default workload
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import throughput  # before `common`, which takes this folder off sys.path

from common import HelpFormatter

VARIANTS = ("off", "on")


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add = parser.add_argument
    add("--speculative-config", required=True, help="JSON, as for `hf-paged serve`, e.g. '{\"method\": \"ngram\"}'")
    add("--rounds", type=int, default=3, help="turns each variant takes")
    add("--at-once", action="store_true", help="all requests together instead of one at a time")
    add("--json", default=None, help="also write the report to this JSON file")
    own, rest = parser.parse_known_args(argv)
    if own.rounds < 1:
        parser.error("--rounds must be >= 1")
    workload_args = throughput.parse_args([*rest, "--engines", "ours", "--no-prefix-caching"])
    return own, workload_args


def greedy(lengths: list[int]):
    from hf_paged import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]


def timed(generator, prompts: list, lengths: list[int]) -> tuple[float, float, list[list[int]]]:
    """Seconds to serve the prompts together, the seconds of the requests after their first tokens (summed), and
    each request's tokens."""
    start = time.perf_counter()
    outputs = generator.run(prompts, greedy(lengths), use_tqdm=False)
    wall = time.perf_counter() - start
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests refused, e.g. {errors[0]}")
    decode = sum(o.metrics.finished_time - o.metrics.first_token_time for o in outputs)
    return wall, decode, [list(o.outputs[0].token_ids) for o in outputs]


def spec_counts(generator) -> tuple[int, int, int]:
    s = generator.stats()
    return s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens


def run(own, args) -> dict:
    import torch

    from hf_paged.default_model import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    args.model = resolve_model(args.model)
    model, tokenizer = throughput.load_model(args.model, args.dtype, "paged", args.round_weights, args.device)
    workload = throughput.make_workload(args, tokenizer)
    prompts, lengths = workload["prompts"], workload["output_lens"]
    generators = {}
    for name, spec in zip(VARIANTS, (None, own.speculative_config)):
        args.speculative_config = spec
        generators[name] = throughput.make_generator(args, model, tokenizer)
        warm = throughput.warmup_workload(throughput.vocab_ids(tokenizer))
        timed(generators[name], warm["prompts"], warm["output_lens"])
    before = spec_counts(generators["on"])
    # The variants take turns at every unit (all requests, or each request), in alternating order.
    units = [(prompts, lengths)] if own.at_once else [([p], [n]) for p, n in zip(prompts, lengths)]
    walls, tokens = {name: [0.0] * own.rounds for name in VARIANTS}, {name: [] for name in VARIANTS}
    decodes = {name: [0.0] * own.rounds for name in VARIANTS}
    for r in range(own.rounds):
        for i, (unit_prompts, unit_lengths) in enumerate(units):
            for name in VARIANTS if (r + i) % 2 == 0 else VARIANTS[::-1]:
                wall, decode, unit_tokens = timed(generators[name], unit_prompts, unit_lengths)
                walls[name][r] += wall
                decodes[name][r] += decode
                if r == 0:
                    tokens[name] += unit_tokens
    drafts, guessed, kept = (b - a for a, b in zip(before, spec_counts(generators["on"])))
    output_tokens = sum(lengths)
    ratios = [off / on for off, on in zip(walls["off"], walls["on"])]
    decode_ratios = [off / on for off, on in zip(decodes["off"], decodes["on"])]
    settings = {k: v for k, v in vars(args).items() if not k.startswith("worker")}
    settings.update(speculative_config=own.speculative_config, rounds=own.rounds, at_once=own.at_once)
    return dict(settings=settings,
                workload=throughput.workload_summary(workload), seconds=walls, decode_seconds=decodes,
                output_tok_s={name: [output_tokens / w for w in ws] for name, ws in walls.items()},
                ratios=ratios, ratio_median=statistics.median(ratios),
                decode_tok_s={name: [(output_tokens - len(lengths)) / d for d in ds] for name, ds in decodes.items()},
                decode_ratios=decode_ratios, decode_ratio_median=statistics.median(decode_ratios),
                identical=sum(a == b for a, b in zip(tokens["off"], tokens["on"])),
                acceptance_rate=kept / guessed if guessed else None,
                tokens_per_verification=1 + kept / drafts if drafts else None)


def print_report(report: dict) -> None:
    w, s = report["workload"], report["settings"]
    how = "all at once" if s["at_once"] else "one at a time"
    print(f"\n{w['num_requests']} requests {how}, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, "
          f"{s['dtype']}; speculative_config {s['speculative_config']}")
    for measure, speeds, ratios, median in (("output tok/s", "output_tok_s", "ratios", "ratio_median"),
                                            ("decode tok/s", "decode_tok_s", "decode_ratios", "decode_ratio_median")):
        print(f"{measure:<16}" + "".join(f"{f'round {i + 1}':>10}" for i in range(s["rounds"])))
        for name, label in (("off", "no speculation"), ("on", "speculation")):
            print(f"{label:<16}" + "".join(f"{x:10.1f}" for x in report[speeds][name]))
        print(f"{'ratio on/off':<16}" + "".join(f"{x:9.2f}x" for x in report[ratios])
              + f"   median {report[median]:.2f}x")
    kept = report["acceptance_rate"]
    guesses = (f"{kept:.0%} of guesses kept, {report['tokens_per_verification']:.2f} tokens per verifying step"
               if kept is not None else "no guesses made")
    print(f"greedy tokens identical: {report['identical']} of {w['num_requests']} requests; {guesses}")


def main(argv=None) -> dict:
    own, args = parse_args(argv)
    report = run(own, args)
    print_report(report)
    if own.json:
        Path(own.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
