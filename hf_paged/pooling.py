"""Embeddings of texts by a causal LM: its last hidden states pooled into one vector per input (vLLM's pooling runner,
OpenAI's ``/v1/embeddings``), and scores of pairs of texts by their embeddings' cosine similarity (vLLM's bi-encoder
scoring: ``LLM.score``, ``/score``, ``/rerank``).

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
# sentence-transformers' Pooling config flags, and what they mean here (others, such as max or weighted mean, are not
# served); with none set, it pools the mean.
_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_MODULES = {"Transformer", "Pooling", "Normalize"}  # what the pooled state goes through here
BATCH_TOKENS = 2048  # most tokens in one forward of several inputs


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
        """The pooling a model directory's sentence-transformers modules ask for, else the default; raises
        ``ValueError`` for modules or a pooling mode that are not served here (a Dense projection, max pooling)."""
        modules = _read_json(Path(model_dir), "modules.json") if model_dir else None
        if not isinstance(modules, list):
            return cls()
        types = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        unserved = sorted(set(types) - _MODULES)
        if unserved:
            raise ValueError(f"its sentence-transformers modules include {', '.join(unserved)}, which are not served "
                             "here (only Transformer, Pooling and Normalize)")
        pooling = "last"
        if "Pooling" in types:
            config = _read_json(Path(model_dir) / str(types["Pooling"].get("path", "")), "config.json") or {}
            asked = [flag for flag in (*_MODES, *_OTHER_MODES) if config.get(flag)]
            if len(asked) > 1 or set(asked) & set(_OTHER_MODES):
                raise ValueError(f"its pooling ({', '.join(asked)}) is not served here: one of last token, mean or "
                                 "first token")
            pooling = _MODES[asked[0]] if asked else "mean"
        return cls(pooling, "Normalize" in types)


def _read_json(directory: Path, name: str):
    try:
        return json.loads((directory / name).read_text())
    except (OSError, ValueError):
        return None


def check_dimensions(model, dimensions: int | None) -> None:
    """``dimensions`` (OpenAI's: the embedding's first N values) must be 1 to the model's hidden size, and one of
    the model's ``matryoshka_dimensions`` where its config names those it was trained for (as vLLM checks; a model
    naming none is cut anywhere)."""
    width = model.config.get_text_config().hidden_size
    if dimensions is not None and not 1 <= dimensions <= width:
        raise ValueError(f"dimensions must be 1 to the model's {width}, got {dimensions}")
    trained = getattr(model.config, "matryoshka_dimensions", None)
    if dimensions is not None and trained and dimensions not in trained:
        raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions {sorted(trained)} (the "
                         f"embedding's lengths it was trained to be cut to), got {dimensions}")


def padded_batches(lengths: list[int], batch_tokens: int = BATCH_TOKENS) -> list[list[int]]:
    """Prompt indices by length, in batches whose padded size (prompts x the longest) is at most ``batch_tokens``
    (a longer prompt alone)."""
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batches and (len(batches[-1]) + 1) * lengths[index] <= batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


@torch.inference_mode()
def embed(model, prompts: list[list[int]], config: PoolingConfig, dimensions: int | None = None) -> list[list[float]]:
    """One embedding per prompt (token ids): the base model's last hidden states, pooled, cut to their first
    ``dimensions`` (a Matryoshka embedding's prefix), then normalized if the config says so. Prompts run in
    `padded_batches`, padded on the right under an attention mask (none where their lengths are equal)."""
    pooled: list[list[float]] = [[]] * len(prompts)
    device = next(model.parameters()).device
    lengths = [len(prompt) for prompt in prompts]
    for batch in padded_batches(lengths):
        longest = lengths[batch[-1]]
        sizes = torch.tensor([lengths[i] for i in batch], device=device)
        input_ids = torch.tensor([prompts[i] + [0] * (longest - lengths[i]) for i in batch], device=device)
        mask = (torch.arange(longest, device=device) < sizes[:, None]).long()
        states = model.base_model(input_ids=input_ids, attention_mask=None if bool(mask.all()) else mask,
                                  use_cache=False).last_hidden_state.float()
        rows = torch.arange(len(batch), device=device)
        vectors = {"last": lambda: states[rows, sizes - 1], "cls": lambda: states[:, 0],
                   "mean": lambda: (states * mask[..., None]).sum(dim=1) / sizes[:, None]}[config.pooling]()
        vectors = vectors[:, :dimensions]
        if config.normalize:
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
        for index, vector in zip(batch, vectors.tolist()):
            pooled[index] = vector
    return pooled


def score_pairs(first: int, second: int, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[int, int]]:
    """Which of ``first`` and ``second`` inputs are scored together, as vLLM pairs them: one with each of the second,
    or as many with as many, in turn; ``ValueError`` (naming them by ``names``) otherwise."""
    if not first or not second:
        raise ValueError(f"{names[1] if first else names[0]} is empty: scoring needs a text on each side")
    if first == 1:
        return [(0, j) for j in range(second)]
    if first == second:
        return [(i, i) for i in range(first)]
    raise ValueError(f"{names[0]} has {first} texts and {names[1]} {second}: score one text against any number, or "
                     "as many against as many (each with its counterpart)")


def cosine_scores(first: list[list[float]], second: list[list[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair of embeddings (``first[i]``, ``second[j]``), in float64."""
    a = torch.tensor([first[i] for i, _ in pairs], dtype=torch.float64)
    b = torch.tensor([second[j] for _, j in pairs], dtype=torch.float64)
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).tolist()


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


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score, as vLLM's ``LLM.score`` returns it (the pair's token ids, first then second)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
