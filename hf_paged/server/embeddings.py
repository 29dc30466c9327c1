"""OpenAI's ``POST /v1/embeddings`` over the served model (`hf_paged.pooling`): its request and its answer.

Inputs are tokenized as completion prompts are; their forwards run on the engine thread, one call of at most
`hf_paged.pooling.BATCH_TOKENS` tokens (or one longer input) between two generation steps, so generation goes on.
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt


def _truncation(keep: int | None) -> int | None:
    if keep is not None and keep != -1 and keep < 1:
        raise ValueError("must be >= 1, or -1 (what the context holds)")
    return keep


# vLLM's: each input's last N tokens (-1: all that the context holds), as `SamplingParams` checks it.
TruncatePromptTokens = Annotated[int | None, Field(ge=-1), AfterValidator(_truncation)]


class EmbeddingRequest(BaseModel):
    """Body of ``POST /v1/embeddings``: one input (text or token ids) or a list of them."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None

    def inputs(self) -> list[str | list[int]]:
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(token, int) for token in given)):
            return [given]
        return list(given)


def embedding_response(vectors: list[list[float]], encoding_format: str, model: str, prompt_tokens: int) -> dict:
    """OpenAI's answer: a list of ``embedding`` objects (float lists, or base64 of little-endian float32s)."""
    def encoded(vector: list[float]):
        if encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")

    data = [{"object": "embedding", "index": i, "embedding": encoded(vector)} for i, vector in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
