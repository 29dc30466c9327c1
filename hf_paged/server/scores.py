"""vLLM's scoring endpoints over the served model's embeddings (`hf_paged.pooling`): ``POST /score`` (and
``/v1/score``) scores pairs of texts, ``POST /rerank`` (and ``/v1/rerank``, ``/v2/rerank``, Jina's and Cohere's shape)
orders documents by their score against a query. A score is the cosine similarity of the two texts' embeddings, as
vLLM scores with an embedding model (a bi-encoder)."""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict

from .embeddings import TruncatePromptTokens


class ScoreRequest(BaseModel):
    """Body of ``POST /score``: ``text_1`` scored against each of ``text_2``, or the two lists pair by pair."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: TruncatePromptTokens = None
    user: str | None = None


class RerankRequest(BaseModel):
    """Body of ``POST /rerank``: the ``documents`` by their score against ``query``, the best ``top_n`` (0 or less:
    all, as vLLM reads it)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0
    truncate_prompt_tokens: TruncatePromptTokens = None
    user: str | None = None


def score_response(scores: list[float], model: str, prompt_tokens: int) -> dict:
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                                    "completion_tokens": 0}}


def rerank_response(scores: list[float], documents: list[str], top_n: int, model: str, total_tokens: int) -> dict:
    """The documents from the best score down (ties in their order), the first ``top_n`` of them (0 or less: all)."""
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n if top_n > 0 else None]
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]} for i in order]
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": total_tokens},
            "results": results}
