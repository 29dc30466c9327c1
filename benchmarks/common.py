"""What the benchmark scripts share. Import it before anything else from this folder's scripts.

Importing it takes this folder off ``sys.path`` (``benchmarks/kernels.py`` would shadow the ``kernels`` package that
Transformers probes for) and puts the repository root on it, so that ``hf_paged`` imports without being installed.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))


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
