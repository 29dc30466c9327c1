"""Embeddings of texts by a causal LM: its last hidden states pooled into one vector per input (vLLM's pooling runner,
OpenAI's ``/v1/embeddings``).

How they are pooled follows the model directory's sentence-transformers files where it has them (``modules.json``
and its Pooling module's ``config.json``: the last token, the mean or the first token; a Normalize module), as
Qwen3-Embedding's do; otherwise the last token's state, normalized, as vLLM pools a causal LM by default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLINGS = ("last", "mean", "cls")
# sentence-transformers' Pooling config flags, and what they mean here.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling is one of {', '.join(POOLINGS)}, got {self.pooling!r}")

    @classmethod
    def from_vllm(cls, config: dict) -> "PoolingConfig":
        """vLLM's ``--pooler-config`` (``{"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool}``); what it
        leaves out is the default's."""
        unknown = sorted(set(config) - {"pooling_type", "normalize"})
        if unknown:
            raise ValueError(f"pooler config keys are pooling_type and normalize, got {', '.join(map(repr, unknown))}")
        kind = config.get("pooling_type", "LAST")
        if not isinstance(kind, str) or kind.lower() not in POOLINGS:
            raise ValueError(f"pooling_type is one of {', '.join(p.upper() for p in POOLINGS)}, got {kind!r}")
        normalize = config.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize is true or false, got {normalize!r}")
        return cls(kind.lower(), normalize)

    @classmethod
    def of_model(cls, model_dir: str | Path | None) -> "PoolingConfig":
        """The pooling a model directory's sentence-transformers modules ask for, else the default."""
        modules = _read_json(Path(model_dir or ""), "modules.json")
        if not isinstance(modules, list):
            return cls()
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        pooling = "last"
        if "Pooling" in types:
            config = _read_json(Path(model_dir) / str(types["Pooling"].get("path", "")), "config.json") or {}
            pooling = next((mode for flag, mode in _MODES.items() if config.get(flag)), "last")
        return cls(pooling, "Normalize" in types)


def _read_json(directory: Path, name: str):
    try:
        return json.loads((directory / name).read_text())
    except (OSError, ValueError):
        return None


def check_dimensions(model, dimensions: int | None) -> None:
    """``dimensions`` (OpenAI's: the embedding's first N values) must be 1 to the model's hidden size."""
    width = model.config.get_text_config().hidden_size
    if dimensions is not None and not 1 <= dimensions <= width:
        raise ValueError(f"dimensions must be 1 to the model's {width}, got {dimensions}")


@torch.inference_mode()
def embed(model, prompts: list[list[int]], config: PoolingConfig, dimensions: int | None = None) -> list[list[float]]:
    """One embedding per prompt (token ids): the base model's last hidden states, pooled, cut to their first
    ``dimensions`` (a Matryoshka embedding's prefix), then normalized if the config says so. Prompts of one length
    run as one batch."""
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    pooled: list[torch.Tensor | None] = [None] * len(prompts)
    device = next(model.parameters()).device
    for indices in by_length.values():
        input_ids = torch.tensor([prompts[i] for i in indices], device=device)
        states = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state.float()
        vectors = {"last": states[:, -1], "mean": states.mean(dim=1), "cls": states[:, 0]}[config.pooling]
        for index, vector in zip(indices, vectors):
            pooled[index] = vector
    result = []
    for vector in pooled:
        vector = vector[:dimensions] if dimensions is not None else vector
        result.append((torch.nn.functional.normalize(vector, dim=0) if config.normalize else vector).tolist())
    return result


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """One prompt's embedding, as vLLM's ``LLM.embed`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
