"""LoRA serving side by side in one process, on ``--num-adapters`` random PEFT adapters of rank ``--rank`` on every
linear layer of the model (made here with PEFT, nothing downloaded), ``--num-requests`` greedy requests of
``--max-tokens`` tokens, each under adapter ``i % num_adapters`` (with ``--base-share``, every so many under none):

* ``hf_paged``: one `ContinuousBatchGenerator.run` of all of them (``enable_lora``, ``max_loras`` = the adapters);
* ``hf_paged base``: the same requests with no adapter, what the adapters cost the engine;
* ``peft``: PEFT over Transformers ``generate``, the requests in one left-padded batch, each row under its own
  adapter (PEFT's mixed-adapter batches, ``adapter_names``).

Sides take turns over ``--rounds`` rounds; prints output tokens/s per round, the median ratios, and how many answers
are the same tokens under hf_paged and PEFT (a padded batch rounds differently, so a few may part late).

Usage:
    python benchmarks/lora.py --num-requests 16 --max-tokens 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile

from common import WORDS, padded_generate, side_by_side_parser, take_turns  # first: it sets up the import path

import torch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = side_by_side_parser(__doc__)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--base-share", type=int, default=0,
                        help="every N-th request runs under no adapter (0: all run under one)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    return parser.parse_args(argv)


def make_adapters(base, count: int, rank: int, root: str) -> list[str]:
    import peft

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        adapted = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                            target_modules=TARGETS,
                                                                            init_lora_weights=False))
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.02)
        paths.append(f"{root}/adapter{i}")
        adapted.save_pretrained(paths[-1])
    return paths




def main(argv=None) -> None:
    args = parse_args(argv)
    try:
        import peft
    except ImportError:
        sys.exit("benchmarks/lora.py compares with PEFT: pip install peft (the test extra has it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import ContinuousBatchGenerator, LoRARequest, SamplingParams
    from hf_paged.default_model import resolve_model

    path, dtype = resolve_model(args.model), getattr(torch, args.dtype)
    rng = random.Random(args.seed)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer(" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))).input_ids
               for _ in range(args.num_requests)]
    root = tempfile.mkdtemp(prefix="hf_paged_lora_")
    paths = make_adapters(plain, args.num_adapters, args.rank, root)
    loras = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
    chosen = [None if args.base_share and i % args.base_share == 0 else loras[i % len(loras)]
              for i in range(len(prompts))]

    tuned = peft.PeftModel.from_pretrained(copy.deepcopy(plain), paths[0], adapter_name="adapter0")
    for i, adapter in enumerate(paths[1:], 1):
        tuned.load_adapter(adapter, adapter_name=f"adapter{i}")
    tuned.eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="paged")
    generator = ContinuousBatchGenerator(model, tokenizer, enable_lora=True, max_loras=len(loras),
                                         max_cpu_loras=len(loras), max_num_seqs=max(args.num_requests, 1))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    names = ["__base__" if lora is None else lora.lora_name for lora in chosen]

    def ours(lora_requests):
        return [o.outputs[0].token_ids for o in generator.run(prompts, params, use_tqdm=False,
                                                               lora_request=lora_requests)]

    runs = {"hf_paged": lambda: ours(chosen), "hf_paged base": lambda: ours(None),
            "peft": lambda: padded_generate(tuned, tokenizer, prompts, args.max_tokens, adapter_names=names)}
    tokens = args.num_requests * args.max_tokens
    results, median = take_turns(runs, args.rounds, tokens, "output tokens/s")
    same = sum(a == b for a, b in zip(results["hf_paged"], results["peft"]))
    print(f"\n{args.num_requests} requests x {args.max_tokens} tokens, {args.num_adapters} adapters of rank "
          f"{args.rank}, {args.dtype}: hf_paged {median['hf_paged']:.1f}, hf_paged base {median['hf_paged base']:.1f}, "
          f"peft {median['peft']:.1f} output tokens/s (median of {args.rounds}); hf_paged / peft = "
          f"{median['hf_paged'] / median['peft']:.2f}x, hf_paged / hf_paged base = "
          f"{median['hf_paged'] / median['hf_paged base']:.2f}x; {same} of {len(prompts)} answers identical to PEFT's")


if __name__ == "__main__":
    main()
