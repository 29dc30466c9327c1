"""Serve a batch of prompts at once with the ContinuousBatchGenerator (the embedded SmolLM2 by default).

    python examples/offline_batch.py [--model PATH] [--temperature 0.7]
"""

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.default_model import resolve_model

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "Give three tips for learning a new language.",
    "What does a compiler do?",
    "Why is the sky blue?",
    "Name the largest planet in the solar system.",
    "Describe a cat in five words.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="local model directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=torch.float32)
    generator = ContinuousBatchGenerator(model, tokenizer)

    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=args.temperature, top_p=0.95, max_tokens=args.max_tokens, seed=0)
    start = time.perf_counter()
    outputs = generator.run(prompts, params)
    elapsed = time.perf_counter() - start

    for question, output in zip(QUESTIONS, outputs):
        print(f"\n### {question}\n{output.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{len(outputs)} requests, {tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tokens/s)")
    print(generator.stats())


if __name__ == "__main__":
    main()
