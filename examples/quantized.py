"""Quantize the embedded SmolLM2 to 4-bit GPTQ or AWQ on CPU (or load a quantized checkpoint) and serve it through the
continuous-batching engine.

    pip install "hf-paged[quant]"
    python examples/quantized.py --method gptq            # quantizes once into ~/.cache/hf_paged (a few minutes)
    python examples/quantized.py --model /path/to/gptq-or-awq-checkpoint
"""

import argparse
import time
from pathlib import Path

from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.default_model import cache_root, default_model_path
from hf_paged.loading import load_model
from hf_paged.quantization import quantize_checkpoint

CALIBRATION = [
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A good loaf of bread needs flour, water, salt, yeast and patience.",
    "The function returns a sorted list, or an empty list when the input is empty.",
    "Regular exercise, enough sleep and a varied diet improve health for most people.",
    "The train to the coast leaves at seven forty and arrives shortly after noon.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar and oxygen.",
] * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GPTQ or AWQ checkpoint directory (skips quantization)")
    parser.add_argument("--method", choices=["gptq", "awq"], default="gptq", help="how to quantize the default model")
    parser.add_argument("--group-size", type=int, default=64, help="quantization group size")
    args = parser.parse_args()

    path = args.model
    if path is None:
        path = cache_root() / f"SmolLM2-135M-Instruct-{args.method}-g{args.group_size}"
        if not (path / "config.json").exists():
            print(f"quantizing the default model to {args.method.upper()} in {path} ...")
            quantize_checkpoint(default_model_path(), path, CALIBRATION, method=args.method, group_size=args.group_size)
    model, tokenizer = load_model(str(Path(path)))
    generator = ContinuousBatchGenerator(model, tokenizer)
    questions = ["What is the capital of France?", "Give me a synonym for happy.", "What is 3 plus 4?"]
    start = time.perf_counter()
    outputs = generator.run([[{"role": "user", "content": q}] for q in questions],
                            SamplingParams(temperature=0, max_tokens=48))
    for question, output in zip(questions, outputs):
        print(f"\n### {question}\n{output.outputs[0].text.strip()}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    layer = type(model.model.layers[0].mlp.up_proj).__name__
    print(f"\n{tokens} tokens in {time.perf_counter() - start:.1f} s with {layer}")


if __name__ == "__main__":
    main()
