"""vLLM's ``EngineArgs`` and ``AsyncEngineArgs``: the model to load and the engine's options in one value."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .generation.config import EngineConfig
from .quantization import QUANTIZATIONS
from .loading import LOAD_FORMATS


@dataclass(frozen=True)
class EngineArgs(EngineConfig):
    """What `LLM` and `AsyncLLM` take, as one value whose options are checked when it is made (the checkpoint is
    read when the engine loads): the model and how to load it (``model`` None: the embedded default), and the
    `EngineConfig` fields. Code written for vLLM keeps its shape: ``AsyncLLM.from_engine_args(args)``, and
    ``LLM(**dataclasses.asdict(args))`` (which copies what the fields hold, a draft model object too:
    ``LLM(**args.keyword_arguments())`` does not)."""

    model: str | os.PathLike | None = None
    tokenizer: str | os.PathLike | None = None
    dtype: str = "auto"
    device: str = "auto"
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    quantization: str | None = None
    revision: str | None = None  # of a hub id's cached copy
    download_dir: str | os.PathLike | None = None  # the cache holding it
    load_format: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"EngineArgs.load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"EngineArgs.tensor_parallel_size must be a positive integer, got {size!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"EngineArgs.quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")

    def keyword_arguments(self) -> dict:
        """The fields as keyword arguments of `LLM` or `AsyncLLM` (nested configs kept as they are)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the arguments of an `AsyncLLM`: the same fields as `EngineArgs`."""
