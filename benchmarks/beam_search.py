"""Beam search side by side in one process: ``--num-requests`` prompts of random words, each searched with
``--beam-width`` beams for exactly ``--max-tokens`` tokens (no EOS, so both sides do the same work):

* ``hf_paged``: one `ContinuousBatchGenerator.run` of all of them (``SamplingParams(use_beam_search=True)``): the
  searches share the batch, each one's beams share their blocks;
* ``transformers``: Transformers ``generate(num_beams=...)``, the prompts in one left-padded batch.

Sides take turns over ``--rounds`` rounds; prints beam tokens/s (requests x width x tokens per second) per round,
the median ratio, and how many prompts got the same beams on both sides (a padded batch rounds differently, so a
few may part).

Usage:
    python benchmarks/beam_search.py --num-requests 8 --beam-width 4 --max-tokens 32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random

from common import WORDS, padded_generate, side_by_side_parser, take_turns  # first: it sets up the import path

import torch  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = side_by_side_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    return parser.parse_args(argv)


def transformers_beams(model, tokenizer, prompts: list[list[int]], width: int, max_tokens: int) -> list:
    rows = padded_generate(model, tokenizer, prompts, max_tokens, num_beams=width, num_return_sequences=width)
    return [rows[i * width : (i + 1) * width] for i in range(len(prompts))]


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import ContinuousBatchGenerator, SamplingParams
    from hf_paged.default_model import resolve_model

    path, dtype = resolve_model(args.model), getattr(torch, args.dtype)
    rng = random.Random(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))).input_ids
               for _ in range(args.num_requests)]
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="paged")
    generator = ContinuousBatchGenerator(model, tokenizer,
                                         max_num_seqs=max(args.num_requests * args.beam_width, 1))
    params = SamplingParams(n=args.beam_width, use_beam_search=True, max_tokens=args.max_tokens, ignore_eos=True)

    def ours():
        return [[beam.token_ids for beam in o.outputs] for o in generator.run(prompts, params, use_tqdm=False)]

    runs = {"hf_paged": ours,
            "transformers": lambda: transformers_beams(plain, tokenizer, prompts, args.beam_width, args.max_tokens)}
    work = args.num_requests * args.beam_width * args.max_tokens
    results, median = take_turns(runs, args.rounds, work, "beam tokens/s")
    same = sum(a == b for a, b in zip(results["hf_paged"], results["transformers"]))
    print(f"\n{args.num_requests} prompts x {args.beam_width} beams x {args.max_tokens} tokens, {args.dtype}: "
          f"hf_paged {median['hf_paged']:.1f}, transformers {median['transformers']:.1f} beam tokens/s (median of "
          f"{args.rounds}); hf_paged / transformers = {median['hf_paged'] / median['transformers']:.2f}x; "
          f"{same} of {len(prompts)} prompts' beams identical")


if __name__ == "__main__":
    main()
