"""OpenAI's Responses API (``POST /v1/responses``), stateless as vLLM's is without a store.

A request becomes a chat request: ``instructions`` and the ``input`` items as messages (function calls and their
outputs as tool calls and tool messages), ``text.format`` as ``response_format``, function tools as chat tools,
``max_output_tokens`` as ``max_completion_tokens``; fields of neither API's core (vLLM's ``top_k``,
``structured_outputs``, ``chat_template_kwargs``, ...) pass on as they are. It runs as that chat request does, and its
answer is written as output items: the reasoning (with a reasoning parser), the message, the function calls.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..generation.sampling_params import InvalidParameter
from .protocol import APIError, ChatCompletionRequest

_TEXT_PARTS = ("input_text", "output_text", "text")
# OpenAI's ``include`` values that ask nothing of this server (its tools and images are refused where given, and
# reasoning items carry their text in the clear); logprobs are not served here.
_INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
               "message.input_image.image_url", "computer_call_output.output.image_url",
               "code_interpreter_call.outputs", "reasoning.encrypted_content")
_ITEMS = "message, function_call, function_call_output, reasoning"
_ROLES = ("user", "assistant", "system", "developer")
# The chat request's fields that stand for this API's, as errors name them.
_FIELDS_OF_CHAT = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens",
                   "reasoning_effort": "reasoning.effort"}
_CHAT_NAMES = re.compile(r"(?<![\w.$#/])(" + "|".join(_FIELDS_OF_CHAT) + r")\b")
_QUOTED = re.compile(r"((?<!\w)'[^'\s]*'(?!\w)|\"[^\"\s]*\")")  # a quoted name, not what lies between apostrophes


def renamed(err: APIError) -> APIError:
    """An error of the chat request a response runs as, naming this API's fields (``text.format`` for
    ``response_format``)."""
    message = err.message.replace("response_format.json_schema.schema", "text.format.schema")
    # A quoted name is one the client chose (a tool's, a schema key), unless it is the field the error is about.
    parts = _QUOTED.split(message)
    err.message = "".join(part if i % 2 and part[1:-1] != err.param else _CHAT_NAMES.sub(_this_apis_name, part)
                          for i, part in enumerate(parts))
    err.param = _FIELDS_OF_CHAT.get(err.param, err.param)
    return err


def _this_apis_name(match: re.Match) -> str:
    return "text.format" if match.group(1) == "response_format" else _FIELDS_OF_CHAT[match.group(1)]


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    store: bool | None = None  # nothing is stored here: the answer says false
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None  # effort: the chat template's reasoning_effort (summary: none here)
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    background: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is added here
    top_logprobs: int | None = None

    def _check_stored(self) -> None:
        """Refuse what needs a store of responses, which this server does not keep."""
        if self.previous_response_id is not None:  # an id unknown here, as every id is (vLLM and OpenAI: a 404)
            raise APIError(404, f"no response {self.previous_response_id[:100]!r} is stored to continue: this server "
                                "keeps no responses; send the whole conversation in input",
                           param="previous_response_id", code="not_found")
        for stored in ("conversation", "prompt"):
            if getattr(self, stored) is not None:
                raise InvalidParameter(stored, f"{stored} names what is stored on OpenAI's side, which this server "
                                       "does not keep: send the whole conversation in input (and instructions)")
        if self.background:
            raise InvalidParameter("background", "background responses are fetched later from a store, which this "
                                   "server does not keep: ask without background (or stream)")

    def _check_served(self) -> None:
        """Refuse what this server does not serve on this API, naming the field."""
        if self.truncation not in (None, "disabled"):
            raise InvalidParameter("truncation", f"truncation {self.truncation!r} is not supported: the input must "
                                   "fit the model's context (truncation 'disabled')")
        for i, value in enumerate(self.include or []):
            if value == "message.output_text.logprobs":
                raise InvalidParameter("include", "include: message.output_text.logprobs is not served on "
                                       "/v1/responses here (the chat endpoint serves logprobs)")
            if value not in _INCLUDABLE:
                raise InvalidParameter("include", f"include[{i}]: {value!r} is not one of OpenAI's values "
                                       f"({', '.join(_INCLUDABLE)}, message.output_text.logprobs)")
        extra = self.model_extra or {}
        for param, asked in (("top_logprobs", self.top_logprobs), ("logprobs", extra.get("logprobs"))):
            if asked:
                raise InvalidParameter(param, f"{param} are not served on /v1/responses here (the chat endpoint "
                                              "serves logprobs)")
        if "response_format" in extra:
            raise InvalidParameter("response_format", "a response's format is text.format, not response_format")
        if extra.get("n") not in (None, 1):
            raise InvalidParameter("n", "a response has one answer: n must be 1")

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this one runs as; raises `InvalidParameter` naming the field it cannot take (and
        `APIError` 404 for a previous response, as none is stored)."""
        self._check_stored()
        self._check_served()
        _check_metadata(self.metadata or {})
        instructions = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages, origins = _messages(self.input)
        fields = {**(self.model_extra or {}), "model": self.model, "messages": instructions + messages,
                  "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
                  "top_p": self.top_p, "stream": self.stream, "stream_options": self.stream_options, "user": self.user,
                  "tools": None if self.tools is None else [_chat_tool(i, t) for i, t in enumerate(self.tools)],
                  "tool_choice": _chat_tool_choice(self.tool_choice), "parallel_tool_calls": self.parallel_tool_calls,
                  "response_format": _response_format(self.text),
                  "reasoning_effort": (self.reasoning or {}).get("effort")}
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as err:
            problem = err.errors()[0]
            where = [str(part) for part in problem.get("loc", ())] or ["input"]
            if where[0] == "messages" and len(where) > 1 and where[1].isdigit():  # the input item it came from
                index = int(where[1]) - len(instructions)
                where = ["instructions"] if index < 0 else ["input", str(origins[index]), *where[2:]]
            param = _FIELDS_OF_CHAT.get(where[0], where[0])
            raise InvalidParameter(param, f"{param}: {'.'.join(where[1:]) or 'value'}: "
                                          f"{problem.get('msg', 'invalid')}") from None

    def answer(self, response_id: str, created: int, model: str, status: str, output: list[dict],
               usage: dict | None) -> dict:
        """The ``response`` object, with ``output`` items as far as they are written."""
        return {"id": response_id, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "metadata": self.metadata or {}, "parallel_tool_calls": self.parallel_tool_calls is not False,
                "previous_response_id": None, "reasoning": self.reasoning, "store": False,
                "temperature": self.temperature, "top_p": self.top_p,
                "text": self.text or {"format": {"type": "text"}}, "tool_choice": self.tool_choice or "auto",
                "tools": self.tools or [], "truncation": "disabled", "usage": usage, "user": self.user}


def _check_metadata(metadata: dict[str, str]) -> None:
    """OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512."""
    if len(metadata) > 16:
        raise InvalidParameter("metadata", f"metadata holds at most 16 pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > 64 or len(value) > 512:
            raise InvalidParameter("metadata", f"metadata keys are at most 64 characters and values at most 512: "
                                               f"{key[:64]!r} is not")


def _messages(given: str | list[dict]) -> tuple[list[dict], list[int]]:
    """The ``input`` as chat messages, and the index of the input item each came from. A reasoning item's text goes
    to the assistant turn after it as ``reasoning_content`` (which templates such as Qwen3's render in a tool loop)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}], [0]
    messages, origins, reasoning = [], [], None
    for i, item in enumerate(given):
        kind = item.get("type", "message")
        _check_item(i, kind, item)
        if kind == "reasoning":
            reasoning = _reasoning_text(item)
            continue
        if kind == "message":
            role, text = item.get("role"), _text(item.get("content"), f"input[{i}].content")
            if role == "assistant" and messages and messages[-1].get("tool_calls") and text is not None:
                # Text written after the answer's calls (a stream adds it as an item of its own): the same turn.
                messages[-1]["content"] = (messages[-1]["content"] or "") + text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if messages and messages[-1]["role"] == "assistant":
                # The text and calls of one answer, or parallel calls: one assistant turn, as the model wrote it.
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else _text(output, f"input[{i}].output")})
        else:
            raise InvalidParameter("input", f"input[{i}] is of type {kind!r}; this server takes {_ITEMS} items")
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("reasoning_content", reasoning)
        reasoning = None
        origins += [i] * (len(messages) - len(origins))
    return messages, origins


def _reasoning_text(item: dict) -> str | None:
    """The text of a reasoning item's ``reasoning_text`` parts (as this server writes them), None without any."""
    parts = item.get("content")
    texts = [part.get("text") for part in parts if isinstance(part, dict) and part.get("type") == "reasoning_text"
             and isinstance(part.get("text"), str)] if isinstance(parts, list) else []
    return "\n".join(texts) if texts else None


def _check_item(i: int, kind: str, item: dict) -> None:
    """Refuse an input item that lacks what OpenAI requires of its type (a tool's result is a
    ``function_call_output`` item, not a message of role ``tool``)."""
    if kind == "message" and item.get("role") not in _ROLES:
        raise InvalidParameter("input", f"input[{i}].role is one of {', '.join(_ROLES)}, got {item.get('role')!r}")
    if kind == "message" and item.get("content") is None:
        raise InvalidParameter("input", f"input[{i}].content is required: a string or a list of text parts")
    required = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id",)}
    for field in required.get(kind, ()):
        if not isinstance(item.get(field), str):
            raise InvalidParameter("input", f"input[{i}].{field} is required (a string) in a {kind} item")
    if kind == "function_call_output" and item.get("output") is None:
        raise InvalidParameter("input", f"input[{i}].output is required: the call's result, a string or text parts")


def _text(content, where: str) -> str | None:
    """A message's content as text: a string, or its text parts joined (``where`` names it in errors)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS
                                                 and isinstance(p.get("text", ""), str) for p in content):
        raise InvalidParameter("input", f"{where}: only text parts ({', '.join(_TEXT_PARTS[:2])}) are supported")
    return "\n".join(part.get("text", "") for part in content)


def _chat_tool(index: int, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise InvalidParameter("tools", f"tools[{index}] is of type {tool.get('type')!r}: this server runs "
                                        "function tools only")
    return {"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters",
                                                                           "strict") if key in tool}}


def _chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidParameter("tool_choice", "tool_choice is none, auto, required or {\"type\": \"function\", "
                                              "\"name\": ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: dict | None) -> dict | None:
    """``text.format`` as a chat ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict) or (fmt.get("type") == "json_schema" and not isinstance(fmt.get("schema"), dict)):
        raise InvalidParameter("text", 'text.format is {"type": "text"}, {"type": "json_object"} or {"type": '
                                       '"json_schema", "name": ..., "schema": {...}}')
    if fmt.get("type") != "json_schema":
        return fmt
    schema = {key: fmt[key] for key in ("name", "description", "schema", "strict") if key in fmt}
    return {"type": "json_schema", "json_schema": schema}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(message: dict, status: str) -> list[dict]:
    """A finished chat message as output items: its reasoning, its text, its calls (the last of them has the
    response's ``status``: ``incomplete`` when cut, as a stream ends it)."""
    items = []
    if message.get("reasoning"):
        items.append(_text_item("reasoning", message["reasoning"], "completed"))
    if message.get("content"):
        items.append(_text_item("message", message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(_call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed"))
    if items:
        items[-1]["status"] = status
    return items


def _text_item(kind: str, text: str, status: str) -> dict:
    """A ``reasoning`` or ``message`` output item holding ``text``."""
    if kind == "reasoning":
        return {"type": "reasoning", "id": _item_id("rs"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}
    return {"type": "message", "id": _item_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict:
    # Written to the cache: the prompt tokens computed (the rest were read from the prefix cache).
    details = {"cached_tokens": cached_tokens, "cache_write_tokens": input_tokens - cached_tokens}
    return {"input_tokens": input_tokens, "input_tokens_details": details,
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


class ResponseEvents:
    """The server-sent events of a streamed response, from the deltas of its chat chunks: each output item is
    added, written (text, reasoning text, call arguments) and done in turn, and ``response.completed`` (or
    ``response.incomplete``) ends the stream with the whole response."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id, self.created = _item_id("resp"), int(time.time())
        self.number = 0  # each event's sequence_number
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, dict] = {}  # function_call items by the chat delta's call index

    def event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self) -> list[str]:
        response = self.request.answer(self.id, self.created, self.model, "in_progress", [], None)
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def delta(self, delta: dict) -> list[str]:
        """The events of one chat chunk's ``delta``. A chunk that holds several tokens' deltas (speculation, or a
        reader that fell behind) may hold the end of a call already open and the text after it: the call's
        arguments were written first, so they are sent first, before its item is done."""
        calls = delta.get("tool_calls") or []
        open_calls = [call for call in calls if call["index"] in self.calls]
        events = [event for call in open_calls for event in self._call(call)]
        if delta.get("reasoning"):
            events += self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in calls:
            if call not in open_calls:
                events += self._call(call)
        return events

    def _text(self, kind: str, text: str) -> list[str]:
        events = [] if self.open is not None and self.open["type"] == kind else self._close("completed")
        if self.open is None:
            self.open = _text_item(kind, "", "in_progress")
            events += self._added(self.open)
            events.append(self.event("response.content_part.added", **self._where(self.open), content_index=0,
                                      part=self.open["content"][0]))
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, **self._where(self.open), content_index=0, delta=text, **extra))
        return events

    def _close(self, status: str) -> list[str]:
        """The events that finish the item being written, if one is."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "function_call":
            return [self.event("response.function_call_arguments.done", **self._where(item),
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=self.output.index(item), item=item)]
        part = item["content"][0]
        name = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        return [self.event(name, **self._where(item), content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", **self._where(item), content_index=0, part=part),
                self.event("response.output_item.done", output_index=self.output.index(item), item=item)]

    def _call(self, call: dict) -> list[str]:
        events = []
        item = self.calls.get(call["index"])
        if item is None:
            events += self._close("completed")
            item = self.calls[call["index"]] = _call_item(call["id"], call["function"]["name"], "", "in_progress")
            events += self._added(item)
            self.open = item
        piece = call.get("function", {}).get("arguments", "")
        if piece:
            item["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", **self._where(item), delta=piece))
        return events

    def finish(self, status: str, usage: dict) -> list[str]:
        """The events that end the stream: the last item done, then the whole response."""
        events = self._close(status)
        response = self.request.answer(self.id, self.created, self.model, status, self.output, usage)
        return events + [self.event(f"response.{status}", response=response)]

    def failed(self, error: dict) -> str:
        """The event that ends a stream whose request failed (``error`` in OpenAI's error shape)."""
        response = self.request.answer(self.id, self.created, self.model, "failed", self.output, None)
        response["error"] = {"code": "invalid_prompt" if error["type"] == "invalid_request_error" else "server_error",
                             "message": error["message"]}
        return self.event("response.failed", response=response)

    def _added(self, item: dict) -> list[str]:
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}
