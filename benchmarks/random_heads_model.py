"""Write a random-weight copy of a model's architecture with other head counts, for tensor-parallel benchmarks.

SmolLM2-135M has 9 query and 3 KV heads, which 2 or 4 ranks cannot split. Throughput does not depend on the weights'
values, so a model of the same size whose heads do split (8 query heads of 72 dims instead of 9 of 64, the hidden
size unchanged) measures what tensor parallelism does to a model of that size:

    python benchmarks/random_heads_model.py /tmp/smollm2-8h --heads 8 --kv-heads 2
    python benchmarks/throughput.py --model /tmp/smollm2-8h --engines ours --tensor-parallel-size 2 --threads 1
"""

from __future__ import annotations

import argparse

import common  # noqa: F401  (first: it sets up the import path)
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from hf_paged.default_model import resolve_model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="directory to write the model and its tokenizer to")
    parser.add_argument("--model", default=None, help="architecture to copy (default: the embedded SmolLM2-135M)")
    parser.add_argument("--heads", type=int, required=True, help="query heads (must divide the hidden size)")
    parser.add_argument("--kv-heads", type=int, required=True, help="KV heads (must divide --heads)")
    args = parser.parse_args(argv)
    path = resolve_model(args.model)
    config = AutoConfig.from_pretrained(path)
    if config.hidden_size % args.heads or args.heads % args.kv_heads:
        parser.error(f"--heads must divide the hidden size {config.hidden_size} and --kv-heads must divide --heads")
    config.num_attention_heads, config.num_key_value_heads = args.heads, args.kv_heads
    config.head_dim = config.hidden_size // args.heads
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(args.out)
    AutoTokenizer.from_pretrained(path).save_pretrained(args.out)
    print(f"wrote {args.out}: {config.num_hidden_layers} layers, {args.heads} heads of {config.head_dim}, "
          f"{args.kv_heads} KV heads, random weights")


if __name__ == "__main__":
    main()
