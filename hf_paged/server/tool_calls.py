"""Tool calling on the chat endpoint: tools in the prompt, the constraint behind ``tool_choice``, calls read back.
(`hf_paged.chat_template.render_prompt` renders every chat prompt that holds tools or calls.)

* ``tools`` go to the chat template (``apply_chat_template(..., tools=...)``). A template that does not mention
  tools gets them in its system message instead, described in the hermes convention: each call is written as
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
* ``tool_choice="required"`` or a named function constrains the output to a JSON array of calls,
  ``[{"name": ..., "arguments": {...}}, ...]``, each call matching its tool's ``parameters`` schema (a named
  function: exactly one call of it).
* ``tool_choice="auto"`` generates freely; calls are read out of the text: with the tokenizer's own
  ``parse_response`` where it defines a ``response_template``, else from hermes ``<tool_call>`` blocks (holding JSON,
  or Qwen3-Coder's ``<function=NAME><parameter=KEY>value</parameter></function>``, values typed by the tool's schema;
  vLLM's ``qwen3_coder``), or from an answer that is nothing but calls: JSON objects, Llama 3's way
  (``{"name": ..., "parameters": {...}}``, several separated by ``;``, after ``<|python_tag|>`` when special tokens
  are kept; vLLM's ``llama3_json``) or Mistral's (a JSON array of ``{"name": ..., "arguments": {...}}``, after
  ``[TOOL_CALLS]``), or a Python list of calls with literal keyword arguments, Llama 3.2's and 4's way
  (``[get_weather(city="Paris")]``; vLLM's ``pythonic``), or calls as Mistral writes them from its v11 tokenizers
  on (``[TOOL_CALLS]NAME[ARGS]{...}`` per call).
* ``tool_choice="none"`` reads no calls.
"""

from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass

from ..chat_template import CLOSE_TAG, NOT_JSON, OPEN_TAG
from ..generation.sampling_params import MAX_JSON_DEPTH, json_too_deep
from ..reasoning import partial_tag


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    @classmethod
    def of(cls, name: str, arguments) -> "ToolCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


# ------------------------------------------------------------------------------------------------ the request
def tool_functions(tools: list[dict]) -> dict[str, dict]:
    """``{name: parameters schema}`` of OpenAI ``tools``; raises ``ValueError`` for a malformed entry."""
    functions = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ValueError("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise ValueError("each tool's function needs a name")
        if len(name) > 256 or "<" in name:  # as a stream reads a call (`_NAME_THEN_ARGUMENTS`)
            raise ValueError(f"tool names are at most 256 characters, without '<' (OpenAI's are at most 64 of "
                             f"a-z, A-Z, 0-9, '_' and '-'), got {name[:64]!r}")
        if parameters is not None and not isinstance(parameters, dict):
            raise ValueError(f"the parameters of tool {name!r} must be a JSON schema object")
        if json_too_deep(parameters):
            raise ValueError(f"the parameters of tool {name!r} nest more than {MAX_JSON_DEPTH} levels")
        if name in functions:
            raise ValueError(f"tool names must be unique: {name!r} is given twice")
        functions[name] = parameters if parameters is not None else {"type": "object"}
    return functions


def calls_schema(functions: dict[str, dict], only: str | None = None) -> dict:
    """The JSON schema of a non-empty array of calls of ``functions`` (of ``only``, exactly once, when given).

    Each tool's ``parameters`` sit under ``$defs`` (``tool_0``, ...), their local ``$ref``s rewritten to point there,
    so that a reference to a tool's own root or ``$defs`` still finds them inside the array."""
    names = [only] if only is not None else list(functions)
    defs = {f"tool_{i}": _rebased(functions[name], f"#/$defs/tool_{i}") for i, name in enumerate(names)}
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/tool_{i}"}},
              "required": ["name", "arguments"]} for i, name in enumerate(names)]
    schema = {"$defs": defs, "type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
              "minItems": 1}
    return {**schema, "maxItems": 1} if only is not None else schema


_SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: their "$ref" keys are data
# Their values map names to schemas:
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"})


def _rebased(schema, root: str):
    """``schema`` with every local ``$ref`` ("#...") made relative to ``root`` instead of the document's root."""
    if isinstance(schema, list):
        return [_rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rebased = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = root + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # its keys are names (a property "default", say)
            rebased[key] = {name: _rebased(sub, root) for name, sub in value.items()}
        else:
            rebased[key] = value if key in _SCHEMA_DATA else _rebased(value, root)
    return rebased


# ------------------------------------------------------------------------------------------------- the output
class ToolCallParser:
    """Reads calls out of one request's outputs; ``mode`` is ``"auto"`` (free text) or ``"json"`` (constrained),
    ``named`` when ``tool_choice`` named the function; ``short_ids``: the calls get ids of 9 letters and digits, which
    Mistral's chat templates take back (`chat_template.short_call_ids`)."""

    def __init__(self, mode: str, tokenizer=None, prompt: str = "", tools: list[dict] | None = None,
                 named: bool = False, short_ids: bool = False):
        self.mode, self.tokenizer, self.prompt, self.tools, self.named = mode, tokenizer, prompt, tools, named
        self.short_ids = short_ids
        self.response_template = getattr(tokenizer, "response_template", None) if mode == "auto" else None
        self.functions = tool_functions(tools) if tools and mode == "auto" else {}
        self.call_starts = _CALL_STARTS + _pythonic_starts(self.functions) + _named_starts(self.functions)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """``(content, calls)``; text that holds no readable call is all content."""
        content, calls = self._read(text)
        for call in calls:
            self.identify(call)
        return content, calls

    def identify(self, call: ToolCall) -> None:
        if self.short_ids:
            call.id = "".join(random.choices(string.ascii_letters + string.digits, k=9))

    def _read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.mode == "json":
            return self._parse_json(text)
        if self.response_template is not None:
            return self._parse_with_template(text)
        calls = [call for _, block, _ in _hermes_blocks(text) for call in _hermes_block_calls(block, self.functions)]
        if calls:
            return _content_beside(text, self.functions) or None, calls
        calls = (_json_object_calls(text, self.functions) or _pythonic_calls(text, self.functions)
                 or _named_calls(text, self.functions))
        return (None, calls) if calls else (text, [])

    def _parse_json(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The calls a stream announces, arguments as written (those of a call cut by max_tokens as far as they
        are), so that a streamed answer and a whole one send the same text."""
        stream = self.stream()
        deltas = stream.feed(text)[1]
        _, last, called = stream.finish()
        return (None, _calls_of(deltas + last)) if called else (text, [])

    def _parse_with_template(self, text: str) -> tuple[str | None, list[ToolCall]]:
        try:
            message = self.tokenizer.parse_response(text, prefix=self.prompt, tools=self.tools)
            functions = [call.get("function", call) for call in message.get("tool_calls") or []]
            calls = [ToolCall.of(function["name"], function.get("arguments", {})) for function in functions]
        except Exception:  # noqa: BLE001 - a response the model's own parser cannot read is plain content
            return text, []
        return message.get("content") or None, calls

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self)


class ToolCallStream:
    """One streamed choice, as OpenAI streams it: content passes through until a call may begin; then each call is
    announced (``index``, ``id``, ``name``, and ``arguments`` as far as they are written) as soon as its name is out,
    and the rest of its arguments follow as they are written.

    Calls are followed as they come when written ``{"name": ..., "arguments": ...}`` (the constrained JSON array, or
    hermes blocks in that key order); a hermes block written otherwise is read whole once it ends, and with a
    tokenizer's response template, or in an answer that begins as JSON calls do (Llama 3's, Mistral's), the calls
    are read whole when the choice finishes. What a stream sends adds up to
    the whole answer (`ToolCallParser.parse`) of the same text.
    """

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content
        self.holding = parser.mode == "json" or parser.response_template is not None  # no more content as it comes
        self.follow = parser.response_template is None  # follow calls as they are written
        self.calls: list[ToolCall] = []  # announced so far
        self.scan = 0  # where the next call may start
        self.block_start = 0  # where the text of the hermes block being followed starts
        self.in_block = False  # a followed call's arguments are in a block that may hold another call after them
        self.args_start: int | None = None  # where the arguments of the last announced call start, while unfinished
        self.args_sent = 0
        self.ends = _BlockEnds()  # where the block being read ends, searched once per character
        self.spaces = _TrailingSpace()  # where the text's trailing whitespace starts, read once per character
        self.tag_from = 0  # no opening tag starts before this (once content is sent)
        self.value = _ValueScan()  # whether the arguments being written may be whole yet, read once per character

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The content and the ``delta.tool_calls`` entries that can be sent now."""
        self.text += delta
        content = ""
        if not self.holding and self.sent == 0 and self.parser.functions:
            start = _calls_start(self.text, self.parser.call_starts)
            if start is None:
                return "", []  # not decided yet
            if start:
                self.holding, self.follow = True, False  # Llama's or Mistral's calls, maybe: read whole at the end
        if not self.holding:
            # Nothing that may begin the tag is ever sent, so a tag cannot start before ``sent``; nor is whitespace
            # that a call may follow (a whole answer's content ends before it).
            start = self.text.find(OPEN_TAG, max(self.sent, self.tag_from))
            self.holding = start >= 0
            self.tag_from = len(self.text) - len(OPEN_TAG) + 1
            end = start if self.holding else len(self.text) - partial_tag(self.text, OPEN_TAG)
            end = max(self.sent, self.spaces.start(self.text, end))
            content, self.sent = self.text[self.sent:end], end
            self.scan = max(self.scan, self.sent)
        return content, self._call_deltas() if self.holding and self.follow else []

    def _call_deltas(self, final: bool = False) -> list[dict]:
        """The calls and arguments written since the last time; with ``final``, the text is all there is."""
        entries: dict[int, dict] = {}
        while True:
            if self.args_start is None:
                if not self._next_call(entries, final):
                    return list(entries.values())
                if self.args_start is None:
                    continue
            value, end, written = self._arguments(final)
            # JSON text in a string is sent decoded, once it ends.
            quoted = not written and self.text.startswith('"', self.args_start)
            upto = end
            if end is None:  # what may yet begin the block's end, or whitespace before it, waits
                held = max(partial_tag(self.text, CLOSE_TAG), partial_tag(self.text, OPEN_TAG))
                upto = self.spaces.start(self.text, len(self.text) - held)
                if self.ends.tag_in_string is not None:  # a tag that ends the block if its string is no string
                    upto = min(upto, self.ends.tag_in_string[1])
            if upto > self.args_sent and (end is not None or not quoted):
                entry = entries.setdefault(len(self.calls) - 1, {"index": len(self.calls) - 1,
                                                                 "function": {"arguments": ""}})
                entry["function"]["arguments"] += value if quoted else self.text[self.args_sent:upto]
                self.args_sent = upto
            if end is None:
                return list(entries.values())
            self.args_start, self.scan = None, end

    def _next_call(self, entries: dict[int, dict], final: bool) -> bool:
        """Go past the next call's start: announce a call to follow (``args_start`` set), or read a hermes block whole
        once it has ended. False when nothing can be decided yet."""
        if self.parser.mode == "json":
            match = _JSON_HEADER.search(self.text, self.scan)
        else:
            if self.in_block:
                followed = self._next_in_block(entries, final)
                if followed is not None:
                    return followed
            start = self.text.find(OPEN_TAG, self.scan)
            if start < 0:
                return False
            self.block_start = start + len(OPEN_TAG)
            self.ends.find(self.text, self.block_start)  # reads past the whitespace the block's text begins with
            if self.ends.kind is None and not final:
                return False
            match = _JSON_HEADER.match(self.text, self.ends.body) if self.ends.kind == "json" else None
        name = _json_string(match.group(1)) if match else None
        if name is None and self.parser.mode == "json":
            self.scan = match.end() if match else self.scan  # not a name JSON can hold: no call starts here
            return match is not None
        if name is None:
            return self._read_block(start, entries, final)
        self._follow(name, match.end(), entries)
        return True

    def _follow(self, name: str, args_start: int, entries: dict[int, dict]) -> None:
        self._announce(ToolCall.of(name, ""), entries)
        self.args_start = self.args_sent = args_start
        self.value = _ValueScan(args_start)
        self.in_block = self.parser.mode == "auto"

    def _next_in_block(self, entries: dict[int, dict], final: bool) -> bool | None:
        """After a followed call's arguments, once its block has ended: another call written after it in the same
        block (`_NEXT_CALL`) is followed too (True); None when there is none, False until the block ends."""
        close = self.ends.find(self.text, self.block_start)
        if close < 0 and not final:
            return False
        self.in_block = False
        close = close if close >= 0 else len(self.text)
        match = _NEXT_CALL.match(self.text, self.scan, close)
        name = _json_string(match.group(1)) if match else None
        if name is None:
            self.scan = close  # the rest of the block is no call, whatever tags its strings hold
            return None
        self._follow(name, match.end(), entries)
        return True

    def _read_block(self, start: int, entries: dict[int, dict], final: bool) -> bool:
        """Read the hermes block at ``start`` whole, once it has ended (it is a call or content)."""
        close = self.ends.find(self.text, start + len(OPEN_TAG))
        if close < 0 and not final:
            return False  # it may yet turn out to be a call to follow
        block, self.scan = _block_at(self.text, start, close)
        for call in _hermes_block_calls(block, self.parser.functions):
            self._announce(call, entries)
        return True

    def _announce(self, call: ToolCall, entries: dict[int, dict]) -> None:
        self.parser.identify(call)
        self.calls.append(call)
        entries[len(self.calls) - 1] = call.to_dict(len(self.calls) - 1)

    def _arguments(self, final: bool) -> tuple[object, int | None, bool]:
        """The last announced call's arguments: ``(value, end, written)``. ``end`` is None while they are still being
        written; arguments that do not read as JSON by the end of their block (or of the text, when ``final``) are
        the text written there (``written``), as a whole answer reads them."""
        close = self.ends.find(self.text, self.block_start) if self.parser.mode == "auto" else -1
        if close < 0 and not final and not self.value.may_end(self.text):
            return None, None, False  # an object, array or string still open: it cannot read as JSON yet
        text = self.text[:close] if close >= 0 else self.text
        try:
            value, end = _DECODER.raw_decode(text, self.args_start)
        except NOT_JSON:
            value, end = None, None
        if end is not None and not _scalar_ends(text, self.args_start, end, close >= 0 or final):
            value, end = None, None  # a number or literal may go on ("1" then ".5"), or is not one ("1.5x")
        if end is None and (close >= 0 or final):
            return None, max(self.args_sent, self.spaces.start(self.text, len(text))), True
        return value, end, False

    def finish(self) -> tuple[str, list[dict], bool]:
        """Once the choice has finished: the content not sent yet, the last ``delta.tool_calls`` entries, and
        whether it called tools at all."""
        if self.follow:
            deltas = self._call_deltas(final=True)
            if self.calls:
                return self._rest(), deltas, True
            return self.text[self.sent:], [], False
        content, calls = self.parser.parse(self.text)
        if not calls:
            return self.text[self.sent:], [], False
        return (content or "") if not self.sent else self._rest(), [c.to_dict(i) for i, c in enumerate(calls)], True

    def _rest(self) -> str:
        """The content written since a call began: hermes text around the blocks (none in a JSON array of calls)."""
        if self.parser.mode == "json":
            return ""
        return _content_beside(self.text[self.sent:], self.parser.functions, after=self.sent > 0)


_DECODER = json.JSONDecoder()
_AFTER_VALUE = frozenset(" \t\r\n,}]<")  # what may follow a whole number or literal
# Ends where the arguments' value starts (so not until it has begun: whitespace may still be coming); a value that
# starts with "<" (where a tag may be) is none. A stream matches it again as the text grows, so its runs are bounded
# (a name of at most 256 characters, at most 64 spaces between two parts; a call written otherwise is read whole).
_NAME_THEN_ARGUMENTS = (r'\{\s{0,64}"name"\s{0,64}:\s{0,64}"((?:[^"\\<]|\\.){0,256})"\s{0,64},\s{0,64}"arguments"'
                        r'\s{0,64}:\s{0,64}(?=[^\s<])')
_JSON_HEADER = re.compile(_NAME_THEN_ARGUMENTS)
# Another call after one in the same hermes block (some models write two objects in one block).
_NEXT_CALL = re.compile(r"\s*\}\s*(?:[,;]\s*)?" + _NAME_THEN_ARGUMENTS)  # one way to match: linear time


# What Llama 3, Llama 4 and Mistral write before calls (special tokens: in the text only if they are kept).
CALL_PREFIXES = ("<|python_tag|>", "<|python_start|>", "[TOOL_CALLS]")
_PYTHONIC_END = "<|python_end|>"
# How JSON calls begin (whitespace aside): an object, or an array of them, whose first key is one of a call's.
# (Pythonic calls begin "[name(", for each tool's name.)
_CALL_STARTS = tuple(f'{bracket}{{"{key}"' for bracket in ("", "[") for key in ("name", "type", "id", "arguments",
                                                                                  "parameters"))
_CALL_KEYS = {"name", "arguments", "parameters", "id", "type"}
_CALL_SEPARATOR = re.compile(r"\s*;?\s*")


def _calls_start(text: str, starts: tuple[str, ...]) -> bool | None:
    """Whether an answer begins as one of ``starts`` (whitespace aside, after a prefix) does (None: it may yet)."""
    start = text.lstrip()
    for prefix in CALL_PREFIXES:
        if start.startswith(prefix):
            start = start[len(prefix):]
        elif start and prefix.startswith(start):
            return None
    compact = "".join(start.split())[:max(map(len, starts))]  # undecided only while this is short: cheap
    if compact.startswith(starts):
        return True
    return None if any(call.startswith(compact) for call in starts) else False


def _without_prefix(text: str) -> str:
    text = text.strip()
    for prefix in CALL_PREFIXES:
        text = text.removeprefix(prefix)
    return text


def _json_object_calls(text: str, functions: dict[str, dict]) -> list[ToolCall]:
    """The calls of an answer that is nothing but JSON objects ``{"name": <one of functions>, "parameters" (or
    "arguments"): {...}}``, separated by ``;`` (Llama 3's) or in JSON arrays (Mistral's), or none. As a stream
    decides it (`_calls_start`), the first key is written as it reads (no escapes)."""
    if not _calls_start(text, _CALL_STARTS):
        return []
    text = _without_prefix(text)
    calls, at = [], len(text) - len(text.lstrip())
    while at < len(text) and functions:
        try:
            value, at = _DECODER.raw_decode(text, at)
        except NOT_JSON:
            return []
        for call in value if isinstance(value, list) and value else [value]:
            if not (isinstance(call, dict) and set(call) <= _CALL_KEYS and call.get("type", "function") == "function"
                    and isinstance(call.get("name"), str) and call["name"] in functions
                    and isinstance(arguments := call.get("parameters", call.get("arguments")), dict)):
                return []
            calls.append(ToolCall.of(call["name"], arguments))
        at = _CALL_SEPARATOR.match(text, at).end()
    return calls


def _pythonic_starts(functions: dict[str, dict]) -> tuple[str, ...]:
    return tuple(f"[{name}(" for name in functions)


def _pythonic_calls(text: str, functions: dict[str, dict]) -> list[ToolCall]:
    """The calls of an answer that is nothing but a Python list of calls of ``functions`` with literal keyword
    arguments (``[get_weather(city="Paris"), get_time()]``, Llama 3.2's and 4's way), or none."""
    text = _without_prefix(text).removesuffix(_PYTHONIC_END).strip()
    # As a stream decides it (`_calls_start`): what else Python reads as such a list (comments, parentheses,
    # identifiers it normalizes) is content.
    if not (functions and _calls_start(text, _pythonic_starts(functions)) and text.endswith("]")):
        return []
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    calls = tree.elts if isinstance(tree, ast.List) else []
    if not calls or not all(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args
                            and call.func.id in functions for call in calls):
        return []
    read = []
    for call in calls:
        names = [keyword.arg for keyword in call.keywords]
        if None in names or len(set(names)) < len(names):  # **kwargs, or a name given twice
            return []
        try:
            arguments = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
            read.append(ToolCall.of(call.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal, or not JSON's
            return []
    return read


# Mistral's calls from its v11 tokenizers on: [TOOL_CALLS]NAME[ARGS]{...}, the tags special tokens (gone from the
# text unless special tokens are kept).
_ARGS_TAG = "[ARGS]"
_NAMED_CALL = re.compile(r"\s*(?:\[TOOL_CALLS\]\s*)?([A-Za-z0-9_.:-]{1,256})(?:\[ARGS\])?(?=\{)")


def _named_starts(functions: dict[str, dict]) -> tuple[str, ...]:
    return tuple(f"{name}{tag}" for name in functions for tag in ("{", _ARGS_TAG))


def _named_calls(text: str, functions: dict[str, dict]) -> list[ToolCall]:
    """The calls of an answer that is nothing but calls of ``functions`` as Mistral writes them from its v11
    tokenizers on, ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}`` once per call (with its special tokens
    skipped, ``get_weather{"city": "Paris"}``), or none."""
    if not (functions and _calls_start(text, _named_starts(functions))):
        return []
    calls, at, end = [], 0, len(text.rstrip())
    while at < end:
        match = _NAMED_CALL.match(text, at)
        if match is None or match.group(1) not in functions:
            return []
        try:
            arguments, at = _DECODER.raw_decode(text, match.end())
        except NOT_JSON:
            return []
        if not isinstance(arguments, dict):
            return []
        calls.append(ToolCall.of(match.group(1), arguments))
    return calls


def _calls_of(deltas: list[dict]) -> list[ToolCall]:
    """The calls that a stream's ``delta.tool_calls`` entries add up to (as a client merges them, by index)."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        function = delta.get("function", {})
        call = calls.setdefault(delta["index"], ToolCall(function.get("name", ""), "", delta.get("id", "")))
        call.arguments += function.get("arguments", "")
    return [calls[index] for index in sorted(calls)]


def _hermes_block_calls(block: str, functions: dict[str, dict]) -> list[ToolCall]:
    """The calls a hermes block's text holds (none: it is content): the text read whole as ``{"name": ...,
    "arguments": ...}``, or read as a stream follows it (see `ToolCallStream`), a name and then arguments that read as
    JSON; or Qwen3-Coder's XML functions (`_xml_calls`)."""
    block = block.strip()
    header = _JSON_HEADER.match(block)
    name = _json_string(header.group(1)) if header else None
    if name is None:
        try:
            call = json.loads(block)
        except NOT_JSON:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            return [ToolCall.of(call["name"], call.get("arguments", {}))]
        return _xml_calls(block, functions)
    calls = []
    while name is not None:
        try:
            value, end = _DECODER.raw_decode(block, header.end())
        except NOT_JSON:
            end = None
        if end is None or not _scalar_ends(block, header.end(), end, True):
            # Cut short or malformed: as written, as OpenAI passes it on.
            return [*calls, ToolCall.of(name, block[header.end():])]
        # As written (a stream sends them as they come), but a JSON string: the JSON text it holds.
        calls.append(ToolCall.of(name, value if isinstance(value, str) else block[header.end():end]))
        header = _NEXT_CALL.match(block, end)
        name = _json_string(header.group(1)) if header else None
    return calls


_XML_FUNCTION = re.compile(r"\s*<function=([^<>\s]+)>")
_XML_PARAMETER = re.compile(r"\s*<parameter=([^<>]+)>")
_XML_VALUE_END = re.compile(r"</parameter>|<parameter=|</function>")  # the first of them ends a value
_XML_FUNCTION_END = re.compile(r"\s*</function>")


def _xml_calls(block: str, functions: dict[str, dict]) -> list[ToolCall]:
    """The calls in Qwen3-Coder's form, each ``<function=NAME>`` then ``<parameter=KEY>\\nvalue\\n</parameter>`` for
    each argument, then ``</function>`` (a value also ends where the next parameter or the function's end begins;
    one cut short is taken as written), whitespace alone between them; or none. Values are text, typed by the tool's
    schema (`_typed_value`)."""
    calls, at = [], 0
    ends = _XML_VALUE_END.finditer(block)  # read once, in order: the time stays linear in the block's length
    while function := _XML_FUNCTION.match(block, at):
        name, at = function.group(1), function.end()
        properties = (functions.get(name) or {}).get("properties")
        arguments = {}
        while parameter := _XML_PARAMETER.match(block, at):
            end = next((e for e in ends if e.start() >= parameter.end()), None)
            at = end.start() if end else len(block)
            value = block[parameter.end():at].removeprefix("\n").removesuffix("\n")
            key = parameter.group(1).strip()
            arguments[key] = _typed_value(value, properties.get(key) if isinstance(properties, dict) else None)
            at += len("</parameter>") if block.startswith("</parameter>", at) else 0
        calls.append(ToolCall.of(name, arguments))
        closed = _XML_FUNCTION_END.match(block, at)
        if closed is None:
            break
        at = closed.end()
    return calls if calls and not block[at:].strip() else []


def _typed_value(text: str, schema) -> object:
    """An XML argument's text as its schema's type asks: JSON (or a Python literal) for numbers, booleans, objects and
    arrays where it reads as one; text where the schema allows a string, says no type, or it does not read."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = {kind for kind in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(kind, str)}
    if not kinds or "string" in kinds:
        return text
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text.strip())
            json.dumps(value, allow_nan=False)
            return value
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            continue
    lowered = text.strip().lower()
    return lowered == "true" if "boolean" in kinds and lowered in ("true", "false") else text


def _content_beside(text: str, functions: dict[str, dict], after: bool = False) -> str:
    """The content of an answer with calls, as a stream sends it: ``text`` without its hermes blocks that are calls,
    each with the whitespace before it (other blocks stay), and without whitespace at its end, nor at its start when
    nothing comes before the first block (or, ``after``, when this text follows content already sent)."""
    pieces, at = [], 0
    for start, block, end in _hermes_blocks(text):
        if _hermes_block_calls(block, functions):
            pieces.append(text[at:start].rstrip())
            at = end
    content = "".join(pieces + [text[at:]]).rstrip()
    return content if after or text[:text.find(OPEN_TAG)].strip() else content.lstrip()


def _hermes_blocks(text: str):
    """Each hermes block of a whole answer: ``(start, its text, end)``."""
    start = text.find(OPEN_TAG)
    while start >= 0:
        block, end = _block_at(text, start, _BlockEnds().find(text, start + len(OPEN_TAG)))
        yield start, block, end
        start = text.find(OPEN_TAG, end)


def _block_at(text: str, start: int, close: int) -> tuple[str, int]:
    """The text of the block opened at ``start`` whose end `_BlockEnds` found at ``close`` (-1: the text's end), and
    where the block ends, its closing tag included."""
    close = len(text) if close < 0 else close
    return text[start + len(OPEN_TAG):close], close + len(CLOSE_TAG) if text.startswith(CLOSE_TAG, close) else close


_TAGS = re.escape(OPEN_TAG) + "|" + re.escape(CLOSE_TAG)
_PARAMETER = "<parameter="
# What changes the reading of a block's text: in JSON, quotes and escapes; in Qwen3-Coder's XML, where values start
# and end (as `_xml_calls` reads them); and the tags.
# In a JSON string, a control character (a raw newline) is no JSON: the string was none (a stray quote).
_MARKS = {("json", False): re.compile(r'["\\]|' + _TAGS), ("json", True): re.compile(r'["\\\x00-\x1f]|' + _TAGS),
          ("text", False): re.compile(_TAGS),
          ("xml", False): re.compile(re.escape(_PARAMETER) + "|" + _TAGS), ("xml", True): _XML_VALUE_END}
_SPACE = re.compile(r"\s*")
_LONGEST_MARK = max(len(OPEN_TAG), len(CLOSE_TAG), len("</parameter>"))


class _BlockEnds:
    """Where a hermes block ends, of a growing text read from the block's start (each character read once): at its
    closing tag or where the next block opens, but not inside a JSON string nor a Qwen3-Coder parameter's value,
    which may hold the tags (a file of code that parses them, say); -1 while it has not ended. A JSON string that
    meets a control character (a raw newline) before it closes was no string (a stray quote): the block ends at the
    first tag inside it (``tag_in_string``: that tag, and where the whitespace before it starts)."""

    def __init__(self):
        self.start = -1
        self.tag_in_string: tuple[int, int] | None = None

    def find(self, text: str, start: int) -> int:
        if start != self.start:
            self.start, self.at, self.kind, self.inside, self.escaped = start, start, None, False, False
            self.tag_in_string = None
        if self.kind is None:
            self.at = self.body = _SPACE.match(text, self.at).end()  # where the block's text begins
            self.kind = _block_kind(text, self.at)
        while self.kind is not None:
            if self.escaped:  # the character after a backslash in a string
                if self.at == len(text):
                    break
                self.at, self.escaped = self.at + 1, False
            mark = _MARKS[self.kind, self.inside].search(text, self.at)
            if mark is None:  # a tag may have begun in the last characters
                self.at = max(self.at, len(text) - _LONGEST_MARK + 1)
                break
            if mark.group() in (OPEN_TAG, CLOSE_TAG) and not self.inside:
                self.at = mark.start()
                return mark.start()
            if self.kind == "json" and self.inside and mark.group() < " " and self.tag_in_string is not None:
                self.at, self.inside = self.tag_in_string[0], False  # found again from there by the next search
                self.tag_in_string = None
                return self.at
            self.at = mark.end()
            self._read(text, mark)
        return -1

    def _read(self, text: str, mark: re.Match) -> None:
        found = mark.group()
        if found == "\\":
            self.escaped = self.inside
        elif found == '"' or (self.kind == "json" and found < " "):  # a control character ends what was no string
            self.inside = found == '"' and not self.inside
            self.tag_in_string = None
        elif found in (OPEN_TAG, CLOSE_TAG):  # inside a string
            if self.kind == "json" and self.tag_in_string is None:
                spaces = mark.start()
                while spaces > self.start and text[spaces - 1].isspace():
                    spaces -= 1
                self.tag_in_string = mark.start(), spaces
        elif found in (_PARAMETER, "</parameter>", "</function>"):
            self.inside = found == _PARAMETER


def _block_kind(text: str, at: int) -> str | None:
    """How a block's text reads, from its first character after whitespace (at ``at``): JSON, XML functions, or text
    (None: not decided yet)."""
    if at == len(text) or "<function=".startswith(text[at:]):
        return None
    if text[at] in '{["':
        return "json"
    return "xml" if text.startswith("<function=", at) else "text"


class _ValueScan:
    """Follows a JSON value written from ``start`` (brackets, strings, escapes), each character once: an object, an
    array or a string may read as JSON only once closed, a number or literal at any point."""

    def __init__(self, start: int = 0):
        self.at, self.depth, self.quoted, self.escaped, self.closed = start, 0, False, False, False

    def may_end(self, text: str) -> bool:
        while not self.closed and self.at < len(text):
            char, self.at = text[self.at], self.at + 1
            if self.escaped:
                self.escaped = False
            elif self.quoted:
                self.escaped, self.quoted = char == "\\", char != '"'
                self.closed = not self.quoted and not self.depth
            elif char == '"':
                self.quoted = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]" or not char.isspace():  # a closing bracket, or a number or literal's first character
                self.depth -= char in "}]"
                self.closed = self.depth <= 0
        return self.closed


class _TrailingSpace:
    """Where ``text[:end].rstrip()`` ends, of a growing text: a run of whitespace already read is not read again."""

    def __init__(self):
        self.end, self.run = 0, 0  # text[:end] ends in whitespace from ``run``

    def start(self, text: str, end: int) -> int:
        if self.run <= end <= self.end:
            return self.run
        floor = self.end if end > self.end else 0
        at = end
        while at > floor and text[at - 1].isspace():
            at -= 1
        if at == floor and floor:
            at = self.run  # all whitespace back to what was read before: the run goes on
        if end > self.end:
            self.end, self.run = end, at
        return at


def _scalar_ends(text: str, start: int, end: int, whole: bool) -> bool:
    """Whether a value read from ``start`` to ``end`` is all of it: anything but a number or literal is; one of those
    is where what follows cannot go on with it (the end of the text only if the text is ``whole``)."""
    if text[start] in '{["':
        return True
    return whole if end == len(text) else text[end] in _AFTER_VALUE


def _json_string(body: str) -> str | None:
    """The JSON string literal ``"body"`` decoded, or None if it is not one."""
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return None
