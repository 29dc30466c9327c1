"""Chat prompts as text: the chat template over messages, with OpenAI ``tools`` and earlier tool calls in them.

A template that mentions tools gets them (``apply_chat_template(..., tools=...)``) and earlier calls with their
arguments as dicts (Transformers' convention); one that does not gets the tools described in its system message and
the calls written into the content, in the hermes convention (``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``). Used by the server's chat endpoint and by `hf_paged.LLM.chat`.
"""

from __future__ import annotations

import inspect
import json
import re

from transformers import PreTrainedTokenizerBase

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# apply_chat_template's own parameters: a request's chat_template_kwargs are the template's variables, not these.
TEMPLATE_PARAMETERS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}  # the template's own name for the conversation
NOT_JSON = (ValueError, RecursionError)  # what reading JSON text raises: malformed, or nested too deep
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's chat_template_content_format
# Mistral's templates refuse tool call ids that are not 9 letters and digits ("... with length 9!").
_NINE_CHARACTER_IDS = re.compile(r"length\s*(?:!=|==)\s*9\b|length 9\b")
# A template that loops over a message's content takes it as OpenAI's list of parts.
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+\s*(?:\[\s*['\"]content['\"]\s*\]|\.content\b)")


def content_format(asked: str, chat_template) -> str:
    """``"string"`` or ``"openai"``, as ``asked``; ``"auto"`` means ``"openai"`` for a ``chat_template`` (a template,
    or a dict of named ones) that loops over a message's content."""
    if asked != "auto":
        return asked
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return "openai" if any(_LOOPS_OVER_CONTENT.search(t or "") for t in templates) else "string"


def template_content(content, content_format: str = "string"):
    """A message's content (a string or OpenAI's list of parts) as the template takes it: its text parts joined
    into one string (``"string"``), or as a list of text parts (``"openai"``, for templates that loop over them);
    an assistant's ``refusal`` part is its text, as in vLLM. ``ValueError`` names a part of any other type."""
    if isinstance(content, list):
        texts = [_part_text(index, part) for index, part in enumerate(content)]
    elif isinstance(content, str):
        texts = [content]
    else:
        return content
    return [{"type": "text", "text": text} for text in texts] if content_format == "openai" else "\n".join(texts)


def _part_text(index: int, part) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("text", "refusal"):
        raise ValueError(f"content part {index} is {'of type ' + repr(kind) if kind else 'no typed object'}: only "
                         "text content parts are supported (and refusal)")
    return part.get(kind) or ""


def template_messages(messages: list[dict], content_format: str = "string") -> list[dict]:
    """The messages with their content as `template_content` gives it."""
    return [{**message, "content": template_content(message["content"], content_format)} if "content" in message
            else message for message in messages]


def template_takes_tools(tokenizer, template: str | None = None) -> bool:
    """Whether the chat template (``template``, else the tokenizer's) renders tools itself."""
    template = template or tokenizer.chat_template
    return not isinstance(template, str) or "tools" in template


def short_call_ids(tokenizer, template: str | None = None) -> bool:
    """Whether the chat template (``template``, else the tokenizer's) takes only Mistral's tool call ids: 9 letters
    and digits."""
    template = template or tokenizer.chat_template
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(text, str) and _NINE_CHARACTER_IDS.search(text) for text in texts)


def nine_character_id(call_id) -> str:
    """A tool call id as Mistral's templates take it: its last 9 letters and digits (vLLM keeps the last 9
    characters), zeros before fewer; the same id always gives the same one, so a call and its result still match."""
    kept = "".join(char for char in str(call_id) if char.isascii() and char.isalnum())[-9:]
    return kept.rjust(9, "0")


def _with_nine_character_ids(message: dict) -> dict:
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**call, "id": nine_character_id(call.get("id"))}
                                             if isinstance(call, dict) else call for call in message["tool_calls"]]}
    if message.get("tool_call_id") is not None:
        message = {**message, "tool_call_id": nine_character_id(message["tool_call_id"])}
    return message


def _hermes_call(call: dict) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments", {})
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except NOT_JSON:
        pass
    return f"{OPEN_TAG}\n{json.dumps({'name': function.get('name'), 'arguments': arguments})}\n{CLOSE_TAG}"


def _for_template(message: dict, native: bool) -> dict:
    """A message with OpenAI tool calls as the template expects them: arguments as a dict (Transformers'
    convention), or written into the content in the hermes form for a template that knows no tools."""
    calls = message.get("tool_calls")
    if not calls:
        return message if message.get("content") is not None else {**message, "content": ""}
    if native:
        converted = []
        for call in calls:
            function = dict(call.get("function", {}))
            try:
                function["arguments"] = json.loads(function.get("arguments") or "{}")
            except (TypeError, *NOT_JSON):
                pass
            converted.append({**call, "function": function})
        return {**message, "tool_calls": converted}
    written = "\n".join(_hermes_call(call) for call in calls)
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": _appended(message.get("content"), written, "\n")}


def _appended(content: str | list[dict] | None, text: str, separator: str) -> str | list[dict]:
    """Message content (a string, or OpenAI's list of text parts) with ``text`` after it."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": separator + text if content else text}]
    return f"{content}{separator}{text}" if content else text


def _tools_system_text(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You can call these functions (JSON schemas of their arguments in <tools></tools>):\n"
            f"<tools>\n{listed}\n</tools>\n"
            f"To call one, answer with {OPEN_TAG}{{\"name\": \"<function name>\", \"arguments\": {{...}}}}{CLOSE_TAG}, "
            "one block per call.")


def render_prompt(tokenizer, messages: list[dict], tools: list[dict] | None, options: dict | None = None,
                  content_parts: bool = False) -> str:
    """The chat prompt as text, with ``tools`` and any earlier tool calls and results in it; ``options`` go to the
    template (``add_generation_prompt=False``, ``continue_final_message=True``, its own variables). With
    ``content_parts`` the messages' content is OpenAI's list of text parts (what is written into it is a part too)."""
    native = template_takes_tools(tokenizer, (options or {}).get("chat_template"))
    if short_call_ids(tokenizer, (options or {}).get("chat_template")):
        messages = [_with_nine_character_ids(message) for message in messages]
    messages = [_for_template(message, native) for message in messages]
    if tools and not native:
        text = _tools_system_text(tools)
        if messages[0].get("role") == "system":
            messages[0] = {**messages[0], "content": _appended(messages[0].get("content"), text, "\n\n")}
        else:
            messages.insert(0, {"role": "system", "content": text})
    if content_parts:  # what was written as a string (a new system message, calls into empty content) too
        messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                    else m for m in messages]
    extra = {"tools": tools} if tools and native else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, **{"add_generation_prompt": True, **(options or {})},
                                         **extra)
