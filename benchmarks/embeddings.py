"""Embeddings side by side in one process: `hf_paged.pooling.embed` over the engine's model against plain Transformers
(the same checkpoint under its default attention, sentence-transformers' way: batches of ``--batch-size`` inputs in
order, padded to the longest, last token pooled and normalized), taking turns over ``--rounds`` rounds on the same
seeded texts of ``--min-words`` to ``--max-words`` words. Prints input tokens/s per round, the median ratio, the
largest difference between the two sides' vectors and their lowest cosine similarity.

Usage:
    python benchmarks/embeddings.py --num-inputs 256 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random

from common import WORDS, side_by_side_parser, take_turns  # first: it sets up the import path

import torch  # noqa: E402



def parse_args(argv=None) -> argparse.Namespace:
    parser = side_by_side_parser(__doc__)
    parser.add_argument("--num-inputs", type=int, default=256)
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=120)
    parser.add_argument("--batch-size", type=int, default=32, help="Transformers' batch size")
    return parser.parse_args(argv)


def transformers_embed(model, tokenizer, texts: list[str], batch_size: int) -> list[list[float]]:
    vectors = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], padding=True, return_tensors="pt")
            states = model(**batch).last_hidden_state.float()
            last = states[torch.arange(len(states)), batch.attention_mask.sum(dim=1) - 1]
            vectors += torch.nn.functional.normalize(last, dim=-1).tolist()
    return vectors


def main(argv=None) -> None:
    args = parse_args(argv)
    from transformers import AutoModel

    from hf_paged import ContinuousBatchGenerator
    from hf_paged.default_model import resolve_model
    from hf_paged.loading import load_model
    from hf_paged.pooling import PoolingConfig, embed

    rng = random.Random(args.seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(args.min_words, args.max_words)))
             for _ in range(args.num_inputs)]
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ContinuousBatchGenerator(model, tokenizer, num_blocks=16)  # the engine's model, as a server runs it
    plain = AutoModel.from_pretrained(resolve_model(args.model), dtype=getattr(torch, args.dtype)).eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    ids = [tokenizer(text).input_ids for text in texts]
    tokens = sum(map(len, ids))
    runs = {"hf_paged": lambda: embed(model, ids, PoolingConfig()),
            "transformers": lambda: transformers_embed(plain, tokenizer, texts, args.batch_size)}
    results, median = take_turns(runs, args.rounds, tokens, "input tokens/s")
    ours_vectors, their_vectors = torch.tensor(results["hf_paged"]), torch.tensor(results["transformers"])
    gap = (ours_vectors - their_vectors).abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(ours_vectors, their_vectors, dim=-1).min().item()
    ours, theirs = median["hf_paged"], median["transformers"]
    print(f"\n{args.num_inputs} inputs, {tokens} tokens, {args.dtype}: hf_paged {ours:.0f} vs Transformers "
          f"{theirs:.0f} input tokens/s (median of {args.rounds}) = {ours / theirs:.2f}x; largest vector difference "
          f"{gap:.2e}, lowest cosine similarity {cosine:.6f}")


if __name__ == "__main__":
    main()
