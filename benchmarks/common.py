"""What the benchmark scripts share. Import it before anything else from this folder's scripts.

Importing it takes this folder off ``sys.path`` (``benchmarks/kernels.py`` would shadow the ``kernels`` package that
Transformers probes for) and puts the repository root on it, so that ``hf_paged`` imports without being installed.
"""

from __future__ import annotations

import argparse
import math
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
    returns each one's last result and its speeds (``work`` ``unit`` per second), each printed as it comes."""
    speeds: dict[str, list[float]] = {name: [] for name in runs}
    results = {}
    for round_number in range(rounds):
        for name in (list(runs) if round_number % 2 == 0 else list(runs)[::-1]):
            start = time.perf_counter()
            results[name] = runs[name]()
            speeds[name].append(work / (time.perf_counter() - start))
            print(f"round {round_number + 1}: {name}: {speeds[name][-1]:.1f} {unit}", flush=True)
    return results, speeds


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
