"""What the benchmark scripts share. Import it before anything else from this folder's scripts.

Importing it takes this folder off ``sys.path`` (``benchmarks/kernels.py`` would shadow the ``kernels`` package that
Transformers probes for) and puts the repository root on it, so that ``hf_paged`` imports without being installed.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))


WORDS = ("the cat sat on a mat while rain fell over quiet hills and rivers ran past old stone bridges near towns where "
         "people walked slowly home after long days of work in fields and shops").split()


def take_turns(runs: dict[str, Callable[[], object]], rounds: int, work: int, unit: str) -> tuple[dict, dict]:
    """Run each of ``runs`` once a round, in turns (the order reversed every other round: the machine's speed drifts);
    returns each one's last result and its median speed (``work`` ``unit`` per second; each round's printed as it
    comes)."""
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    results = {}
    for round_number in range(rounds):
        for name in (list(runs) if round_number % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            results[name] = runs[name]()
            speeds[name].append(work / (time.perf_counter() - start))
            print(f"round {round_number + 1}: {name}: {speeds[name][-1]:.1f} {unit}", flush=True)
    return results, {name: statistics.median(values) for name, values in speeds.items()}


def padded_generate(model, tokenizer, prompts: list[list[int]], max_tokens: int, **options) -> list[list[int]]:
    """Transformers ``generate`` of exactly ``max_tokens`` new tokens (no EOS) for ``prompts`` in one left-padded
    batch, greedy unless ``options`` say otherwise; each returned row's new tokens."""
    import torch

    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=pad, **options)
    return out[:, width:].tolist()


def side_by_side_parser(description: str) -> argparse.ArgumentParser:
    """The flags of a comparison run in one process, sides taking turns: ``--model``, ``--dtype``, ``--rounds``,
    ``--seed``; the script adds its own."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    return parser


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the module docstring's layout and shows each flag's default where the help text does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not any(action.default is x for x in (None, False, argparse.SUPPRESS)) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile with linear interpolation between ranks (None for no values)."""
    if not values:
        return None
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)
