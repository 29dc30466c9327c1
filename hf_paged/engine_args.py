"""vLLM's ``EngineArgs`` and ``AsyncEngineArgs``: the model to load and the engine's options in one value."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .generation.config import EngineConfig


@dataclass(frozen=True)
class EngineArgs(EngineConfig):
    """What `LLM` and `AsyncLLM` take, as one value checked when it is made: the model and how to load it (``model``
    None: the embedded default), and the `EngineConfig` fields. Code written for vLLM keeps its shape:
    ``LLM(**dataclasses.asdict(args))``, ``AsyncLLM.from_engine_args(args)``."""

    model: str | os.PathLike | None = None
    tokenizer: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    quantization: str | None = None

    def keyword_arguments(self) -> dict:
        """The fields as keyword arguments of `LLM` or `AsyncLLM` (nested configs kept as they are)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of an `AsyncLLM`: the same fields as `EngineArgs`."""
