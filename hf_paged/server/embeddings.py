"""OpenAI's ``POST /v1/embeddings`` over the served model (`hf_paged.pooling`): its request and its answer.

Inputs are tokenized as completion prompts are; their forwards run on the engine thread, one call of at most
`hf_paged.pooling.BATCH_TOKENS` tokens (or one longer input) between two generation steps, so generation goes on.
"""

from __future__ import annotations

import base64
import sys
import time
import uuid
from typing import Annotated, Literal

import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from .protocol import ChatCompletionRequest, ChatMessage

# vLLM's ``embed_dtype`` names: what a base64 embedding's numbers are written as.
EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_SAME_WIDTH_INTEGERS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _truncation(keep: int | None) -> int | None:
    if keep is not None and keep != -1 and keep < 1:
        raise ValueError("must be >= 1, or -1 (what the context holds)")
    return keep


# Fields of vLLM's chat embedding request that this server's chat endpoint refuses too (`ChatCompletionRequest`).
_RENDERING_FIELDS = ("chat_template", "documents")

# vLLM's: each input's last N tokens (-1: all that the context holds), as `SamplingParams` checks it.
TruncatePromptTokens = Annotated[int | None, Field(ge=-1), AfterValidator(_truncation)]


class EmbeddingRequest(BaseModel):
    """Body of ``POST /v1/embeddings``: one input (text or token ids) or a list of them, or, as vLLM takes it, one
    conversation in ``messages``, rendered by the chat template (with no generation prompt unless asked)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None
    # vLLM's: normalize (None: as the model's pooling does), how base64 writes the numbers, the tokenizer's BOS.
    normalize: bool | None = None
    embed_dtype: Literal[tuple(EMBED_DTYPES)] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    # None: added to an input's text, not to a rendered conversation (its template wrote its own)
    add_special_tokens: StrictBool | None = None

    @model_validator(mode="after")
    def _one_kind_of_input(self):
        if (self.input is None) == (self.messages is None):
            raise ValueError("give the text to embed in input, or a conversation in messages: one of the two")
        return self

    def chat(self) -> ChatCompletionRequest:
        """The conversation as a chat request, which renders it as a chat completion's prompt is rendered (and
        refuses the template options a chat completion refuses)."""
        rendering = {name: value for name, value in (self.model_extra or {}).items() if name in _RENDERING_FIELDS}
        return ChatCompletionRequest(
            **rendering, messages=self.messages, add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message, chat_template_kwargs=self.chat_template_kwargs,
            add_special_tokens=self.add_special_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens)

    def inputs(self) -> list[str | list[int]]:
        given = self.input
        if isinstance(given, str) or (given and all(isinstance(token, int) for token in given)):
            return [given]
        return list(given)


def embedding_response(vectors: list[list[float]], body: EmbeddingRequest, model: str, prompt_tokens: int) -> dict:
    """OpenAI's answer: a list of ``embedding`` objects (float lists, or base64 of the numbers as ``embed_dtype`` and
    ``endianness`` ask: by default float32 in this machine's order, which OpenAI's little-endian is here)."""
    def encoded(vector: list[float]):
        if body.encoding_format == "float":
            return vector
        return base64.b64encode(_packed(vector, body.embed_dtype, body.endianness)).decode("ascii")

    data = [{"object": "embedding", "index": i, "embedding": encoded(vector)} for i, vector in enumerate(vectors)]
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "data": data,
            "model": model, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def _packed(vector: list[float], embed_dtype: str, endianness: str) -> bytes:
    numbers = torch.tensor(vector, dtype=torch.float32).to(EMBED_DTYPES[embed_dtype])
    raw = numbers.view(_SAME_WIDTH_INTEGERS[numbers.element_size()]).numpy()
    order = sys.byteorder if endianness == "native" else endianness
    return raw.astype(raw.dtype.newbyteorder("<" if order == "little" else ">")).tobytes()
