"""OpenAI's wire format: request bodies, their mapping onto `SamplingParams`, and response and chunk builders.

Fields that OpenAI marks optional may also be sent as ``null``; either way the documented default applies. Besides
OpenAI's own fields, the requests accept vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``,
``allowed_token_ids``, ``bad_words``, ``prompt_logprobs``, ``return_token_ids``, ``truncate_prompt_tokens`` and
``structured_outputs`` (with its older spellings ``guided_json``, ``guided_regex``, ``guided_choice`` and
``guided_grammar``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..chat_template import TEMPLATE_PARAMETERS, short_call_ids, template_content
from ..generation import (
    CompletionOutput, InvalidParameter, RequestOutput, RequestOutputKind, SamplingParams, StructuredOutputsParams,
)
from ..reasoning import ReasoningParser, ReasoningStream
from .tool_calls import ToolCallParser, calls_schema, tool_functions

if TYPE_CHECKING:
    from .tokenization import TokenText

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy /v1/completions default


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices; with it, vLLM's
    ``continuous_usage_stats`` puts the usage so far on every chunk."""

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Fields of OpenAI's API and of vLLM's extensions to it that change the output and that this server does not
# implement, with the values that ask for nothing more than it does. Any other value is refused by name rather than
# ignored; fields that are not known at all are ignored, as vLLM does.
# ``tools`` and ``tool_choice`` are fields of the chat endpoint; elsewhere (``/v1/completions``) they are refused here.
_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "tools": lambda value: not value,
    "tool_choice": lambda value: value in (None, "none", "auto"),
    "functions": lambda value: not value,
    "function_call": lambda value: value in (None, "none", "auto"),
    "echo": lambda value: not value,
    "chat_template": lambda value: value is None,
    "documents": lambda value: not value,
    "generation_config": lambda value: value is None,  # transformers serve's
    "guided_whitespace_pattern": lambda value: value is None,  # vLLM's older spelling: structured_outputs' own
}

# Other servers' names (llama.cpp's, TGI's) for what this one takes under OpenAI's or vLLM's, with the values that
# ask for nothing (their "off"): any other value is refused with the name to use, since ignoring it would change the
# output silently (an unconstrained ``grammar``, a default length).
_OTHER_NAMES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "n_predict": ("max_tokens", lambda value: value is None),
    "max_new_tokens": ("max_tokens", lambda value: value is None),
    "repeat_penalty": ("repetition_penalty", lambda value: value in (None, 1, 1.0)),
    "grammar": ("structured_outputs: {\"grammar\": ...}", lambda value: not value),
    "json_schema": ("response_format: {\"type\": \"json_schema\", \"json_schema\": {\"schema\": ...}}",
                    lambda value: not value),
    "n_probs": ("logprobs / top_logprobs", lambda value: not value),
    "typical_p": ("nothing: typical sampling is not supported", lambda value: value in (None, 1, 1.0)),
    "mirostat": ("nothing: mirostat sampling is not supported", lambda value: not value),
}


_SPEC_NAME = re.compile(r"^SamplingParams\.structured_outputs(\.\w+)?")


@dataclass
class Constraint:
    """A structured-output constraint and the request field that asked for it.

    ``label`` names it in errors; ``{kind}`` in it stands for ``.json``, ``.regex``, ... where the error names one.
    """

    param: str
    label: str
    spec: StructuredOutputsParams

    def error(self, err: ValueError) -> InvalidParameter:
        return _field_error(self.param, self.label, err)

    @classmethod
    def of(cls, param: str, label: str, **spec) -> "Constraint":
        try:
            return cls(param, label, StructuredOutputsParams(**spec))
        except ValueError as err:
            raise _field_error(param, label, err) from None


def _field_error(param: str, label: str, err: ValueError) -> InvalidParameter:
    """``err`` from `StructuredOutputsParams` or its compilation, worded after the request field."""
    return InvalidParameter(param, _SPEC_NAME.sub(lambda m: label.format(kind=m.group(1) or ""), str(err)))


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``; without a ``schema`` any JSON value is allowed."""

    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")  # e.g. llama.cpp's json_object "schema", which would go unenforced
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class GenerationRequest(BaseModel):
    """The fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: int | None = None
    priority: StrictInt = 0  # vLLM's: lower runs first, under --scheduling-policy priority
    # vLLM's: the prompt's prefix-cache blocks are shared only with requests of the same salt
    cache_salt: StrictStr | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) added to the prompt; None: to a completion's text, not to a
    # chat's rendered template (which wrote its own)
    add_special_tokens: StrictBool | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, StrictInt | StrictFloat] | None = None  # not llama.cpp's false (a ban), taken as 0
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's --return-tokens-as-token-ids
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool | None = None  # vLLM's: a beam search of width n (see `SamplingParams.use_beam_search`)
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None

    def constraints(self) -> list[Constraint]:
        """Every structured-output constraint the request asks for (raises ``InvalidParameter`` for a bad one)."""
        asked = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(Constraint.of("response_format", "response_format", json_object=True))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidParameter("response_format", "response_format of type json_schema needs its json_schema")
            schema = fmt.json_schema.schema_
            asked.append(Constraint.of("response_format", "response_format.json_schema.schema",
                                       json=schema if schema is not None else {}))
        if self.structured_outputs is not None:
            given = self.structured_outputs.model_dump(exclude_none=True)
            spec = {("json" if k == "json_" else k): v for k, v in given.items()}
            asked.append(Constraint.of("structured_outputs", "structured_outputs{kind}", **spec))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                asked.append(Constraint.of(f"guided_{kind}", f"guided_{kind}", **{kind: value}))
        return asked

    def constraint(self) -> Constraint | None:
        """The one structured-output constraint of the request, or None."""
        asked = self.constraints()
        if len(asked) > 1:
            raise InvalidParameter(asked[1].param, f"{asked[0].param} and {asked[1].param} cannot be combined")
        return asked[0] if asked else None

    def token_limit(self) -> tuple[str, int | None]:
        """The field that limits the output's tokens, and the limit the request itself sets (None: none)."""
        return "max_tokens", self.max_tokens

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict) -> SamplingParams:
        """The request as `SamplingParams`, ``defaults`` (`SamplingParams.model_defaults`) where it sets nothing;
        raises ``ValueError`` naming the bad field."""
        given = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens, "logit_bias": self._logit_bias(),
            "allowed_token_ids": self.allowed_token_ids, "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens, "use_beam_search": self.use_beam_search,
            "length_penalty": self.length_penalty, "early_stopping": self.early_stopping,
        }
        values = {**defaults, **{name: value for name, value in given.items() if value is not None}}
        cap = values.pop("max_tokens", None)
        if cap is not None:  # as vLLM's: a generation config's max_new_tokens bounds every request on the server
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        constraint = self.constraint()
        if constraint is not None and self.use_beam_search:
            raise InvalidParameter(constraint.param, f"{constraint.param} cannot be used with use_beam_search (beam "
                                   "search ranks beams by the model's own log-probabilities)")
        # The server merges each request's deltas itself (see `engine.RequestStream`).
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, output_kind=RequestOutputKind.DELTA,
                              structured_outputs=constraint.spec if constraint else None,
                              prompt_logprobs=self._prompt_logprobs(), **values)

    def count_whole_vocabulary(self, vocab_size: int) -> set[str]:
        """vLLM's -1 log-probabilities per token (the whole vocabulary's) as the number they are, so that limits and
        answers count them as any other; returns the fields that asked so."""
        whole = {name for name in ("logprobs", "top_logprobs", "prompt_logprobs") if getattr(self, name, None) == -1}
        for name in whole:
            setattr(self, name, vocab_size)
        return whole

    def prompt_logprob_entries(self, n: int) -> int:
        """Log-probabilities the answer holds per prompt token: vLLM's ``prompt_logprobs``, in each of a prompt's
        ``n`` choices."""
        return 0 if self.prompt_logprobs is None or self.stream else (self.prompt_logprobs + 1) * n

    def _prompt_logprobs(self) -> int | None:
        """vLLM's ``prompt_logprobs``, which a stream cannot carry: a count above 0 is refused with ``stream``, as
        vLLM's, and 0 computes nothing there."""
        if self.stream and self.prompt_logprobs:
            raise InvalidParameter("prompt_logprobs", "prompt_logprobs are not available when stream is true")
        return None if self.stream else self.prompt_logprobs

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys, so as strings."""
        if self.logit_bias is None:
            return None
        bad = [token for token in self.logit_bias if not (token.isascii() and token.isdigit() and len(token) <= 18)]
        if bad:
            raise InvalidParameter("logit_bias", f"SamplingParams.logit_bias keys must be token ids, got "
                                   f"{[t[:20] for t in bad[:5]]}")
        return {int(token): bias for token, bias in self.logit_bias.items()}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def unsupported_field(self) -> tuple[str, str] | None:
        """The first field that asks for something this server does not do, with the reason; or None."""
        extra = self.model_extra or {}
        for name, harmless in _UNSUPPORTED.items():
            if name in extra and not harmless(extra[name]):
                return name, f"{name} is not supported by this server"
        best_of, n = extra.get("best_of"), self.n or 1
        if isinstance(best_of, int) and best_of < n:
            return "best_of", f"best_of ({best_of}) must be at least n ({n})"
        if best_of not in (None, n):
            return "best_of", "best_of is not supported by this server"
        for name, (ours, harmless) in _OTHER_NAMES.items():
            if name in extra and not harmless(extra[name]):
                return name, (f"{name} is not a field of this server's API (OpenAI's, with vLLM's extensions); "
                              f"use {ours}")
        return None

    def ignored_fields(self) -> list[str]:
        """The fields this server does not know, which it ignores (as vLLM, which logs them too)."""
        return sorted(set(self.model_extra or ()) - set(_UNSUPPORTED) - set(_OTHER_NAMES) - {"best_of"})


class CompletionRequest(GenerationRequest):
    """Body of ``POST /v1/completions``: one prompt (text or token ids) or a list of them."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]  # not true/false as token ids
    logprobs: int | None = Field(default=None, ge=-1)  # vLLM's -1: the whole vocabulary's
    echo: bool | None = False
    suffix: str | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported by this server"
        return super().unsupported_field()

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.prompt and all(isinstance(p, int) for p in self.prompt):
            return [self.prompt]
        return list(self.prompt)

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.echo and self.truncate_prompt_tokens is not None:  # the echo would not be the prompt served
            raise InvalidParameter("truncate_prompt_tokens", "truncate_prompt_tokens cannot be combined with echo")
        default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, defaults.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS))
        max_tokens = default if self.max_tokens is None else self.max_tokens
        if self.echo and max_tokens == 0:  # the prompt alone (its logprobs, say), as OpenAI's and vLLM's
            max_tokens = 1
        params = self.sampling_params(max_tokens, self.logprobs, defaults)
        if not self.echo or self.logprobs is None:
            return params
        return params.replace(prompt_logprobs=max(self.logprobs, params.prompt_logprobs or 0))

    def logprobs_param(self) -> tuple[str, int | None]:
        """The field that asks for log-probabilities, and how many alternatives per token (None: not asked)."""
        return "logprobs", self.logprobs

    def prompt_logprob_entries(self, n: int) -> int:
        echoed = n * (self.logprobs + 1) if self.echo and self.logprobs is not None else 0
        return super().prompt_logprob_entries(n) + echoed


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text"}`` parts can be served."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """The function of an earlier tool call in the conversation; ``arguments`` is JSON text, as OpenAI sends it (an
    object is taken too)."""

    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(BaseModel):
    """An earlier tool call in an assistant message."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


class ChatMessage(BaseModel):
    """A chat message; fields beyond ``role``, ``content`` and ``tool_calls`` are passed on to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None

    def to_template_dict(self, content_format: str = "string") -> dict[str, Any]:
        """The message as the chat template expects it: its text parts joined into one string (``"string"``), or
        its content as OpenAI's list of text parts (``"openai"``, for templates that loop over them)."""
        message = self.model_dump(exclude_none=True)
        if self.content is not None:
            message["content"] = template_content(message["content"], content_format)
        elif not self.tool_calls:  # as vLLM reads it; templates index message.content
            message["content"] = ""
        return message


class ChatCompletionRequest(GenerationRequest):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=-1)  # vLLM's -1: the whole vocabulary's
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's reasoning out of the reply
    reasoning_effort: str | None = None  # OpenAI's; as vLLM, the chat template's variable of that name

    def tool_choice_mode(self) -> tuple[str, str | None]:
        """``("none" | "auto" | "required", None)``, or ``("named", the function's name)``; raises
        ``InvalidParameter``."""
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        mode, name = choice, None
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type", "function") == "function" else None
            mode, name = "named", function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str):
                raise InvalidParameter("tool_choice", 'a named tool_choice is {"type": "function", "function": '
                                                       '{"name": ...}}')
        if mode != "none" and not self.tools:
            raise InvalidParameter("tool_choice", f"tool_choice {name or mode!r} needs tools")
        return mode, name

    def tool_parser(self, tokenizer, prompt: str) -> ToolCallParser | None:
        """What reads tool calls out of this request's outputs, or None when it reads none."""
        mode, _ = self.tool_choice_mode()
        if mode == "none":
            return None
        return ToolCallParser("auto" if mode == "auto" else "json", tokenizer, prompt, self.tools,
                              named=mode == "named", short_ids=short_call_ids(tokenizer))

    def constraints(self) -> list[Constraint]:
        asked = super().constraints()
        mode, name = self.tool_choice_mode()
        try:  # checked whatever the choice: the tools go into the prompt
            functions = tool_functions(self.tools or [])
        except ValueError as err:
            raise InvalidParameter("tools", str(err)) from None
        if mode in ("none", "auto"):
            return asked
        if mode == "named" and name not in functions:
            raise InvalidParameter("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        schema = calls_schema(functions, name)
        if self.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return [Constraint.of("tools", "tools", json=schema)] + asked

    def template_options(self) -> dict:
        """What the chat template is asked beyond the messages and tools, as vLLM's fields ask it (empty: nothing);
        raises ``InvalidParameter``."""
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidParameter("continue_final_message", "continue_final_message continues the last message "
                                                              "instead of opening a new one: set add_generation_prompt "
                                                              "to false with it")
        reserved = sorted(set(self.chat_template_kwargs or ()) & TEMPLATE_PARAMETERS)
        if reserved:
            raise InvalidParameter("chat_template_kwargs", f"chat_template_kwargs are the template's variables; "
                                                            f"{', '.join(reserved)} cannot be set through them")
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise InvalidParameter("reasoning_effort", f"reasoning_effort is one of {', '.join(REASONING_EFFORTS)}, "
                                                        f"got {self.reasoning_effort!r}")
        options = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:  # chat_template_kwargs' own reasoning_effort wins
            options.setdefault("reasoning_effort", self.reasoning_effort)
        if not self.add_generation_prompt:
            options["add_generation_prompt"] = False
        if self.continue_final_message:
            options["continue_final_message"] = True
        return options

    def needs_own_rendering(self) -> bool:
        """Whether the prompt holds tools or earlier tool calls, or asks the template for more than a new turn, so
        it is rendered by `tool_calls.render_prompt`."""
        return bool(self.tools) or any(m.tool_calls for m in self.messages) or bool(self.template_options())

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: accepted alone, as vLLM accepts it
            raise InvalidParameter("top_logprobs", "logprobs must be true when top_logprobs asks for entries")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.max_completion_tokens is None:
            max_tokens = self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens")
            return self.sampling_params(max_tokens, logprobs, defaults)
        try:
            return self.sampling_params(self.max_completion_tokens, logprobs, defaults)
        except InvalidParameter as err:
            if err.param != "max_tokens":
                raise
            message = str(err).removeprefix("SamplingParams.max_tokens")
            raise InvalidParameter("max_completion_tokens", "max_completion_tokens" + message) from None


    def logprobs_param(self) -> tuple[str, int | None]:
        """The field that asks for log-probabilities, and how many alternatives per token (None: not asked)."""
        return "top_logprobs", (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprob_entries(self, n: int) -> int:
        return super().prompt_logprob_entries(1)  # once, at the top of the response

    def token_limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens


# --------------------------------------------------------------------------------------------------- responses
class TokenizeRequest(BaseModel):
    """Body of vLLM's ``POST /tokenize`` for a completion's ``prompt`` (a chat's ``messages`` come as a
    `ChatCompletionRequest`: its template options and tools render them)."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str
    return_token_strs: bool = False
    add_special_tokens: StrictBool | None = None  # as a completion's (default: added)


class DetokenizeRequest(BaseModel):
    """Body of vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[StrictInt]


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict:
    """An error in OpenAI's shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _ranked(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of a step's tokens; the generator reports the top ``logprobs`` and the sampled one."""
    return sorted(top.items(), key=lambda item: -item[1])[:k]


def _ranked_with(top: dict[int, float], k: int, token: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of a step's tokens, and ``token`` (the one sampled, or the prompt's) after them when it
    is not among them."""
    ranked = _ranked(top, k)
    return ranked if any(t == token for t, _ in ranked) else ranked + [(token, top[token])]


class CompletionFormat:
    """Choices of ``/v1/completions`` (``text_completion`` objects)."""

    object = "text_completion"
    chunk_object = "text_completion"
    prompt_top: int | None = None  # vLLM's ``prompt_logprobs`` of the call (None: not asked)
    return_token_ids = False  # vLLM's ``return_token_ids``: each choice's token ids, and its prompt's
    tokens_as_ids = False  # vLLM's ``return_tokens_as_token_ids``: logprobs name tokens "token_id:<id>"
    prompt_fields_at = "choice"  # where a prompt's logprobs and ids go: in each of its choices, or (chat) the response

    def __init__(self, decode: TokenText, top_k: int | None, echo: list[str] | None = None,
                 prompt_only: bool = False):
        self.decode, self.top_k = decode, top_k
        self.echo = echo  # with ``echo``: each prompt's text, put before its choices' text
        self.prompt_only = prompt_only  # echo with max_tokens 0: the prompt alone (one token is generated, unsaid)

    def echoed(self, prompt_index: int, output: RequestOutput, choice: CompletionOutput) -> CompletionOutput:
        """``choice`` with its prompt before it, as ``echo`` asks (logprobs too: the first token's are None)."""
        if self.prompt_only:
            choice = dataclasses.replace(choice, text="", token_ids=[], finish_reason="length",
                                         logprobs=[] if choice.logprobs is not None else None)
        scores = output.prompt_logprobs
        logprobs = None if choice.logprobs is None or scores is None else scores + choice.logprobs
        return dataclasses.replace(choice, text=self.echo[prompt_index] + choice.text,
                                   token_ids=output.prompt_token_ids + choice.token_ids, logprobs=logprobs)

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float] | None] | None,
                 offset: int) -> dict | None:
        if logprobs is None or self.top_k is None:
            return None
        return {
            "tokens": [self.token(t) for t in token_ids],
            "token_logprobs": [None if top is None else top[t] for t, top in zip(token_ids, logprobs)],
            "top_logprobs": [None if top is None else self._top(top, t) for t, top in zip(token_ids, logprobs)],
            "text_offset": self.text_offsets(token_ids, offset)[0],
        }

    def _top(self, top: dict[int, float], token: int) -> dict[str, float]:
        """As OpenAI's: the k most likely tokens by name, then the sampled one when it is not among them. Tokens of one
        name (pieces of a character, each "\ufffd") share a key: the likelier one's, but the sampled token's own."""
        named: dict[str, float] = {}
        for other, logprob in _ranked_with(top, self.top_k, token):
            named.setdefault(self.token(other), logprob)
        named[self.token(token)] = top[token]
        return named

    def text_offsets(self, token_ids: list[int], offset: int) -> tuple[list[int], int]:
        """Where each token's text starts in the choice's text, from ``offset`` on, and where the text after them
        starts. Counted in characters from the tokens' bytes, so that a character split over several tokens counts
        once; a token that starts within a character gets that character's offset."""
        offsets = []
        for token in token_ids:
            data = self.decode.bytes(token)
            within = bool(data) and data[0] & 0xC0 == 0x80 and offset > 0  # a UTF-8 continuation byte first
            offsets.append(offset - within)
            offset += sum(byte & 0xC0 != 0x80 for byte in data)
        return offsets, offset

    def token(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or ``"token_id:<id>"``."""
        return f"token_id:{token_id}" if self.tokens_as_ids else self.decode(token_id)

    def prompt_logprobs(self, output: RequestOutput) -> list[dict | None] | None:
        """vLLM's ``prompt_logprobs`` of ``output``: per prompt token (None for the first) its own and the
        ``prompt_top`` likeliest tokens' logprobs, keyed by token id, each with its rank and text."""
        if self.prompt_top is None or output.prompt_logprobs is None:
            return None

        def entry(token: int, logprob: float, rank: int) -> dict:
            return {"logprob": logprob, "rank": rank, "decoded_token": self.decode(token)}

        scored: list[dict | None] = [None]
        for token, top, rank in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:],
                                    output.prompt_ranks[1:]):
            entries = {str(token): entry(token, top[token], rank)}
            for place, (other, logprob) in enumerate(_ranked(top, self.prompt_top), 1):
                entries.setdefault(str(other), entry(other, logprob, place))
            scored.append(entries)
        return scored

    def choice(self, index: int, output: CompletionOutput) -> dict:
        return {"index": index, "text": output.text, "logprobs": self.logprobs(output.token_ids, output.logprobs, 0),
                "finish_reason": output.finish_reason, "stop_reason": output.stop_reason}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                     text_offset: int, finish_reason: str | None, stop_reason: str | int | None = None) -> dict | None:
        """A stream chunk's choice; None when it would carry nothing."""
        return {"index": index, "text": text, "logprobs": self.logprobs(token_ids, logprobs, text_offset),
                "finish_reason": finish_reason, "stop_reason": stop_reason}

    def opening_choice(self, index: int) -> dict | None:
        return None


class ChatFormat(CompletionFormat):
    """Choices of ``/v1/chat/completions`` (``chat.completion`` objects). With a `ReasoningParser`, an answer's
    reasoning goes in ``message.reasoning`` (vLLM's field) and ``message.reasoning_content`` (its former name, and
    DeepSeek's), streamed in ``delta`` fields of the same names; without ``include_reasoning`` it is left out."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prompt_fields_at = "response"
    role = "assistant"  # the reply's (vLLM's --response-role, or the role of the message it continues)

    def __init__(self, decode: TokenText, top_k: int | None, reasoning: ReasoningParser | None = None,
                 include_reasoning: bool = True):
        super().__init__(decode, top_k)
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        self.reasoned: dict[int, str] = {}  # each choice's reasoning so far, answered or left out (its usage counts it)

    def logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]] | None, offset: int) -> dict | None:
        if logprobs is None or self.top_k is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": self.token(token_id), "logprob": logprob, "bytes": list(self.decode.bytes(token_id))}

        content = [
            {**entry(t, top[t]), "top_logprobs": [entry(i, lp) for i, lp in _ranked(top, self.top_k)]}
            for t, top in zip(token_ids, logprobs)
        ]
        return {"content": content}

    def choice(self, index: int, output: CompletionOutput) -> dict:
        reasoning, content = (None, output.text) if self.reasoning is None else self.reasoning.split(output.text)
        self.reasoned[index] = reasoning or ""
        reasoning = reasoning if self.include_reasoning else None
        return {"index": index, "message": {"role": self.role, "content": content, **_reasoning_fields(reasoning)},
                "logprobs": self.logprobs(output.token_ids, output.logprobs, 0), "finish_reason": output.finish_reason,
                "stop_reason": output.stop_reason}

    def chunk_choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                     text_offset: int, finish_reason: str | None, stop_reason: str | int | None = None) -> dict | None:
        reasoning, content = self.split_piece(index, text, finish_reason is not None)
        return self.chunk(index, reasoning, content, self.logprobs(token_ids, logprobs, text_offset), finish_reason,
                          stop_reason)

    def split_piece(self, index: int, text: str, last: bool) -> tuple[str, str]:
        """A streamed piece of choice ``index`` as ``(reasoning, content)`` (all content without a parser)."""
        if self.reasoning is None:
            return "", text
        stream = self.reasoning_streams.setdefault(index, self.reasoning.stream())
        reasoning, content = stream.feed(text)
        if last:
            rest_reasoning, rest_content = stream.finish()
            reasoning, content = reasoning + rest_reasoning, content + rest_content
        self.reasoned[index] = self.reasoned.get(index, "") + reasoning
        return reasoning if self.include_reasoning else "", content

    @staticmethod
    def chunk(index: int, reasoning: str, content: str, logprobs: dict | None, finish_reason: str | None,
              stop_reason: str | int | None, tool_calls: list[dict] | None = None) -> dict | None:
        delta = {**_reasoning_fields(reasoning or None), **({"content": content} if content else {}),
                 **({"tool_calls": tool_calls} if tool_calls else {})}
        if not delta and logprobs is None and finish_reason is None:
            return None  # text a parser holds back: nothing to send yet
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
                "stop_reason": stop_reason}

    def opening_choice(self, index: int) -> dict | None:
        return {"index": index, "delta": {"role": self.role, "content": ""}, "logprobs": None, "finish_reason": None}


class ToolChatFormat(ChatFormat):
    """Chat choices whose text may hold tool calls: those are answered as ``message.tool_calls`` (streamed as
    ``delta.tool_calls``, see `tool_calls.ToolCallStream`) with ``finish_reason="tool_calls"`` (see `_finish`). With
    ``one_call`` (``parallel_tool_calls: false``) only the first call is answered, as vLLM keeps it where no
    constraint held the model to one."""

    def __init__(self, decode: TokenText, top_k: int | None, parser: ToolCallParser,
                 reasoning: ReasoningParser | None = None, include_reasoning: bool = True, one_call: bool = False):
        super().__init__(decode, top_k, reasoning, include_reasoning)
        self.parser = parser
        self.one_call = one_call
        self.streams = {}
        self.arguments: dict[int, dict[int, str]] = {}  # per choice, each streamed call's arguments so far

    def choice(self, index: int, output: CompletionOutput) -> dict:
        choice = super().choice(index, output)
        content, calls = self.parser.parse(choice["message"]["content"] or "")  # calls come after any reasoning
        calls = calls[:1] if self.one_call else calls
        if calls:
            choice["message"].update(content=content, tool_calls=[call.to_dict() for call in calls])
            choice["finish_reason"] = self._finish(output.finish_reason, [call.arguments for call in calls])
        return choice

    def chunk_choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                     text_offset: int, finish_reason: str | None, stop_reason: str | int | None = None) -> dict | None:
        reasoning, text = self.split_piece(index, text, finish_reason is not None)
        stream = self.streams.setdefault(index, self.parser.stream())
        content, calls = stream.feed(text)
        called = False
        if finish_reason is not None:
            rest, last, called = stream.finish()
            content, calls = content + rest, calls + last
        calls = [call for call in calls if call["index"] == 0] if self.one_call else calls
        arguments = self.arguments.setdefault(index, {})  # each call's, as sent
        for call in calls:
            arguments[call["index"]] = arguments.get(call["index"], "") + call["function"].get("arguments", "")
        finish_reason = self._finish(finish_reason, arguments.values()) if called else finish_reason
        return self.chunk(index, reasoning, content, self.logprobs(token_ids, logprobs, text_offset), finish_reason,
                          stop_reason, calls)

    def _finish(self, finish_reason: str | None, arguments) -> str | None:
        """As OpenAI's and vLLM's: "tool_calls" for calls of ``tool_choice`` auto or required; a call of a named
        function ends as it ended ("stop"), and so do calls whose ``arguments`` are not whole JSON (cut by a stop
        string, say, or written wrong): a client that sees "tool_calls" runs them."""
        whole = all(map(_is_json, arguments))
        return "tool_calls" if finish_reason == "stop" and not self.parser.named and whole else finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _reasoning_fields(reasoning: str | None) -> dict:
    return {} if reasoning is None else {"reasoning": reasoning, "reasoning_content": reasoning}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """The ``usage`` object of a response; with ``cached_tokens`` (the prompt tokens read from the prefix cache),
    OpenAI's ``prompt_tokens_details``."""
    used = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    return used if cached_tokens is None else {**used, "prompt_tokens_details": {"cached_tokens": cached_tokens}}
