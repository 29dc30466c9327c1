"""Tool calls in prompts and outputs (`hf_paged.server.tool_calls`), without a model."""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hf_paged.chat_template import render_prompt
from hf_paged.server.tool_calls import ToolCallParser, calls_schema, tool_functions

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TEMPLATE = {"start_anchor": "<|im_start|>assistant\n", "fields": {
    "content": {"content": "text", "optional": True},
    "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                   "transform": {"type": "function", "function": "{content}"}}}}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_calls_schema_accepts_only_calls_of_the_tools():
    functions = tool_functions([WEATHER, TIME])
    assert functions["get_time"] == {"type": "object"}
    required, named = calls_schema(functions), calls_schema(functions, "get_weather")
    ok = [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]
    jsonschema.validate(ok, required)
    jsonschema.validate(ok[:1], named)
    for bad, schema in [([], required), ([{"name": "nope", "arguments": {}}], required), (ok, named),
                        ([{"name": "get_weather", "arguments": {}}], named), (ok[:1] * 2, named)]:  # exactly once
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(ValueError, match="needs a name"):
        tool_functions([{"type": "function", "function": {}}])
    for name in ("a<b", "f" * 257):  # names no stream could read a call of
        with pytest.raises(ValueError, match="tool names are at most 256 characters, without '<'"):
            tool_functions([{"type": "function", "function": {"name": name}}])


def test_a_template_without_tools_gets_them_and_earlier_calls_in_the_hermes_form(tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    text = render_prompt(tokenizer, messages, [WEATHER])
    assert text.startswith("<|im_start|>system\nYou can call these functions")
    assert json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert text.endswith("<|im_start|>tool\n18 C, sunny<|im_end|>\n<|im_start|>assistant\n")


# Mistral's chat templates (v0.3, Nemo, Small 3) refuse tool call ids that are not 9 characters; this keeps that check.
MISTRAL_IDS = ("{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls %}{%- if c.id|length != 9 %}"
               "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
               "[TOOL_CALLS]{{ c.id }}{{ c.function|tojson }}{%- endfor %}{%- elif m.role == 'tool' %}"
               "[TOOL_RESULTS]{{ m.tool_call_id }}:{{ m.content }}{%- else %}{{ m.content }}{%- endif %}"
               "{%- endfor %}{# tools #}")


def test_mistrals_templates_get_and_give_tool_call_ids_of_nine_characters(tokenizer):
    """As vLLM's mistral parser: calls read for such a template get 9-character ids, and ids written otherwise (an
    OpenAI client's "call_..." ones) reach it as their last 9 letters and digits, a call and its result alike."""
    from hf_paged.chat_template import short_call_ids

    assert short_call_ids(tokenizer, MISTRAL_IDS) and not short_call_ids(tokenizer)
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_6e3ce3ea71244f8ab05d4df5", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_6e3ce3ea71244f8ab05d4df5", "content": "18 C"}]
    text = render_prompt(tokenizer, messages, [WEATHER], {"chat_template": MISTRAL_IDS})
    assert text == 'Weather?[TOOL_CALLS]ab05d4df5{"name": "get_weather", ' \
        '"arguments": {"city": "Paris"}}[TOOL_RESULTS]ab05d4df5:18 C'
    parser = ToolCallParser("auto", tools=[WEATHER], short_ids=True)
    calls = [parser.parse(CALL)[1][0].id, stream_all(parser.stream(), CALL, 3)[1][0]["id"],
             stream_all(parser.stream(), '[{"name": "get_weather", "parameters": {"city": "Paris"}}]', 5)[1][0]["id"]]
    assert all(len(id_) == 9 and id_.isalnum() for id_ in calls) and len(set(calls)) == 3
    assert ToolCallParser("auto", tools=[WEATHER]).parse(CALL)[1][0].id.startswith("call_")


def test_a_template_given_for_the_call_decides_whether_it_takes_the_tools(tokenizer):
    """The tokenizer's template knows no tools; one passed in (``LLM.chat(chat_template=...)``) that does gets them."""
    own = "{% for t in tools %}[TOOL {{ t.function.name }}]{% endfor %}{{ messages[0]['content'] }}"
    text = render_prompt(tokenizer, [{"role": "user", "content": "hi"}], [WEATHER], {"chat_template": own})
    assert text == "[TOOL get_weather]hi"


def test_hermes_calls_are_read_out_of_free_text():
    parser = ToolCallParser("auto")
    content, calls = parser.parse(f"Let me check.\n{CALL}\n{CALL.replace('Paris', 'Rome')}")
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_weather", {"city": "Rome"})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    assert parser.parse("No tools needed.") == ("No tools needed.", [])
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    _, [unclosed] = parser.parse('<tool_call>{"name": "get_time", "arguments": {}}')  # the model stopped early
    assert unclosed.name == "get_time"


def test_json_calls_are_read_and_a_cut_one_is_content():
    parser = ToolCallParser("json")
    content, [call] = parser.parse('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert content is None and json.loads(call.arguments) == {"city": "Oslo"}
    assert parser.parse('[{"name": "get_wea') == ('[{"name": "get_wea', [])


def stream_all(stream, text: str, step: int) -> tuple[str, list[dict], bool]:
    """Feed ``text`` in pieces of ``step`` characters; the content sent, every tool-call delta, whether it called."""
    content, deltas = "", []
    for i in range(0, len(text), step):
        sent, calls = stream.feed(text[i:i + step])
        content, deltas = content + sent, deltas + calls
    rest, last, called = stream.finish()
    return content + rest, deltas + last, called


def accumulate(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas merged by index, as an OpenAI client does."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += delta.get("id", "")
        call["name"] += delta.get("function", {}).get("name", "")
        call["arguments"] += delta.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_stream_holds_back_what_may_begin_a_call_and_streams_the_arguments(step):
    text = f"Sure <tool! Checking.\n{CALL}\n{CALL.replace('Paris', 'Rome')}"
    content, deltas, called = stream_all(ToolCallParser("auto").stream(), text, step)
    assert content == "Sure <tool! Checking." and called  # as it came, but the whitespace before the call
    calls = accumulate(deltas)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    # Each call is announced once, with its id and name; then its arguments arrive piece by piece.
    assert sum("id" in d for d in deltas) == 2 and sum("arguments" in d["function"] for d in deltas) > 2
    plain = ToolCallParser("auto").stream()
    assert plain.feed("a <tool_") == ("a", []) and plain.finish() == (" <tool_", [], False)


def test_a_constrained_array_of_calls_streams_as_it_is_written():
    text = '[{"name": "get_weather", "arguments": {"city": "Oslo", "note": "a } and a \\" inside"}}, ' \
           '{"name": "get_time", "arguments": {}}]'
    content, deltas, called = stream_all(ToolCallParser("json").stream(), text, 2)
    assert content == "" and called
    calls = accumulate(deltas)
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == [call["arguments"] for call in json.loads(text)]


def test_calls_in_another_key_order_arrive_whole_at_the_end():
    text = '<tool_call>{"arguments": {"city": "Lima"}, "name": "get_weather"}</tool_call>'
    content, deltas, called = stream_all(ToolCallParser("auto").stream(), text, 4)
    assert content == "" and called and len(deltas) == 1
    assert accumulate(deltas)[0]["name"] == "get_weather"


@pytest.mark.parametrize("step", [1, 5])
def test_a_stream_and_a_whole_answer_read_the_same_calls_and_content(step):
    """Whatever the blocks hold, streamed and whole answers agree: a block that is no call stays content beside the
    calls, and arguments written as a JSON string arrive as the JSON text it holds, not quoted again."""
    texts = [
        f"{CALL} and <tool_call>not json</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>',
        f"<tool_call>[1, 2]</tool_call> then {CALL}",
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
        f'{CALL} <tool_call>{{"arguments": {{"y": 2}}, "name": "get_time"}}</tool_call>',  # followed, then read whole
        f'{CALL} <tool_call>{{"name": "get_time"}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": 12}</tool_call>',  # a number is not cut where a delta ends
        f"Sure.  \n{CALL}\n Done.",  # the whitespace before a call goes with it
        '<tool_call>{"name": "get_weather", "arguments": {"city": [1, ',  # cut short: the arguments as written
        '<tool_call>{"name": "get_weather", "arguments": {oops}}</tool_call> after',
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city',  # a JSON string, cut short
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call>',  # compact: sent as written
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich"}}</tool_call>',  # escapes too
    ]
    for text in texts:
        whole_content, whole_calls = ToolCallParser("auto").parse(text)
        content, deltas, called = stream_all(ToolCallParser("auto").stream(), text, step)
        streamed = [(c["name"], c["arguments"]) for c in accumulate(deltas)]
        assert streamed == [(c.name, c.arguments) for c in whole_calls], text  # the same text, not just the same JSON
        assert called == bool(whole_calls) and content == (whole_content or ""), text
    content, calls = ToolCallParser("auto").parse(texts[0])
    assert content == "and <tool_call>not json</tool_call>" and [c.name for c in calls] == ["get_weather"]
    _, [call] = ToolCallParser("auto").parse(texts[1])
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert ToolCallParser("auto").parse(texts[7])[0] == "Sure.\n Done."
    assert [c.arguments for c in ToolCallParser("auto").parse(texts[8])[1]] == ['{"city": [1,']
    assert ToolCallParser("auto").parse(texts[9])[0] == "after"
    assert [c.arguments for c in ToolCallParser("auto").parse(texts[12])[1]] == ['{"city": "Z\\u00fcrich"}']
    compact = '[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_time","arguments":{}}]'
    assert [(c.name, c.arguments) for c in ToolCallParser("json").parse(compact)[1]] == \
        [("get_weather", '{"city":"Paris"}'), ("get_time", "{}")]


PIECES = ["Sure.", " ", "\n", "ok", CALL, "<tool_call>", "</tool_call>", '{"name": "get_time", "arguments": ', '{"a": 1}',
          '{"a":1}', "{oops}", '"{\\"x', "}", "<tool", "[1, ", "12", '"s"', '{"arguments": {}, "name": "g"}']


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=8), st.integers(1, 9))
def test_any_text_streams_as_its_whole_answer_reads(pieces, step):
    assert_streams_as_whole(ToolCallParser("auto"), "".join(pieces), step)


def test_a_constrained_array_cut_anywhere_reads_as_its_stream():
    """tool_choice "required" cut by max_tokens: the whole answer has the calls the stream announced, arguments
    as far as they were written (as OpenAI answers a call cut by max_tokens)."""
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
    for end in range(len(text) + 1):
        content, calls = ToolCallParser("json").parse(text[:end])
        streamed, deltas, called = stream_all(ToolCallParser("json").stream(), text[:end], 3)
        assert [(c.name, c.arguments) for c in calls] == [(c["name"], c["arguments"]) for c in accumulate(deltas)]
        assert called == bool(calls) and (content or "") == ("" if called else streamed), text[:end]
    _, calls = ToolCallParser("json").parse(text[:text.index("ris")])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]


def as_json(arguments: str):
    """Arguments as the JSON they read as, or as written where they do not (cut short or malformed)."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def test_a_tokenizer_response_template_parses_calls(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "response_template", HERMES_TEMPLATE, raising=False)
    parser = ToolCallParser("auto", tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", [WEATHER])
    content, [call] = parser.parse(f"Let me look.\n{CALL}")
    assert content == "Let me look." and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    stream = parser.stream()
    assert stream.feed("Let me look.\n") == ("", [])  # read whole at the end
    assert stream.feed(CALL) == ("", [])
    content, [call], called = stream.finish()
    assert content == "Let me look." and called and call["function"]["name"] == "get_weather"


def assert_calls_or_content(parser: ToolCallParser, cases: dict[str, list], step: int) -> None:
    """Each text reads as its expected calls and no content, or (none expected) as all content, streamed or not."""
    for text, expected in cases.items():
        content, calls = parser.parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected, text
        assert content == (None if expected else text), text
        streamed, deltas, called = stream_all(parser.stream(), text, step)
        assert [(c["name"], json.loads(c["arguments"])) for c in accumulate(deltas)] == expected, text
        assert called == bool(expected) and streamed == (content or ""), text


def assert_streams_as_whole(parser: ToolCallParser, text: str, step: int) -> None:
    whole_content, whole_calls = parser.parse(text)
    content, deltas, called = stream_all(parser.stream(), text, step)
    assert [(c["name"], c["arguments"]) for c in accumulate(deltas)] == [(c.name, c.arguments) for c in whole_calls]
    assert called == bool(whole_calls) and content == (whole_content or "")


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize("step", [1, 7])
def test_calls_written_as_json_objects_are_read_as_llama_3_and_mistral_write_them(step):
    """An answer that is nothing but calls of the tools as JSON objects (Llama 3.x's format, vLLM's llama3_json):
    one, several separated by ";", after <|python_tag|>; or a JSON array of them (Mistral's, after [TOOL_CALLS]);
    anything else stays content, streamed or not."""
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    cases = {
        LLAMA_CALL: [("get_weather", {"city": "Paris"})],
        f' \n<|python_tag|>{LLAMA_CALL}; {{"name": "get_time", "arguments": {{}}}}':
            [("get_weather", {"city": "Paris"}), ("get_time", {})],
        '{"name": "not_a_tool", "parameters": {}}': [],
        '{"name": "get_weather", "parameters": {"city": "Paris"}, "extra": 1}': [],
        f"{LLAMA_CALL} and then some words": [],
        '{"name": "get_weather", "parameters": {"city": "Pa': [],  # cut short
        '{"answer": 42}': [],
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]':
            [("get_weather", {"city": "Rome"}), ("get_time", {})],  # Mistral's
        '[{"name": "get_weather", "parameters": {}}, 3]': [],
        # Mistral's with the ids its templates write, Llama 3.2's with a type.
        '[{"name": "get_time", "arguments": {}, "id": "abc123def"}]': [("get_time", {})],
        '{"type": "function", "name": "get_time", "parameters": {}}': [("get_time", {})],
        '{"type": "other", "name": "get_time", "parameters": {}}': [],
        "[]": [],
        "The weather is fine.": [],
        ';{"name": "get_time", "parameters": {}}': [],  # a stream does not begin calls with ";"
    }
    assert_calls_or_content(parser, cases, step)
    assert ToolCallParser("auto").parse(LLAMA_CALL) == (LLAMA_CALL, [])  # no tools, no calls to read


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES + [LLAMA_CALL, "<|python_tag|>", "<|", ";", '{"name": "get_time", "parameters"',
                                          ': {}}', "[TOOL_CALLS]", "[", "]", ", "]), max_size=6), st.integers(1, 9))
def test_with_tools_any_text_streams_as_its_whole_answer_reads(pieces, step):
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    assert_streams_as_whole(parser, "".join(pieces), step)


def test_an_answer_that_cannot_be_calls_streams_as_it_comes():
    """With tools, only an answer that begins as JSON calls do is held to its end."""
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    for text in ("[a link](http://x) and more", '{"answer": 42, "more": "text"}', "[1, 2, 3] are numbers"):
        stream = parser.stream()
        sent = "".join(stream.feed(text[i:i + 4])[0] for i in range(0, len(text), 4))
        assert len(sent) >= len(text) - 4 and stream.finish()[1:] == ([], False), text
    stream = parser.stream()
    assert [stream.feed(piece)[0] for piece in ("[", "{", '"na', 'me": "get_time"')] == ["", "", "", ""]


TYPED = {"type": "function", "function": {"name": "plan", "parameters": {"type": "object", "properties": {
    "title": {"type": "string"}, "days": {"type": "integer"}, "rate": {"type": ["number", "null"]},
    "done": {"type": "boolean"}, "tags": {"type": "array"}, "meta": {"type": "object"}, "note": {}}}}}


def xml_call(name: str, **values: str) -> str:
    parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"


@pytest.mark.parametrize("step", [1, 6])
def test_qwen3_coder_calls_are_read_with_values_typed_by_the_tools_schema(step):
    """Qwen3-Coder's XML inside hermes blocks (vLLM's qwen3_coder): each value is text, read as JSON (or a Python
    literal) where its property's type is not a string; streamed, a block arrives whole once it ends."""
    parser = ToolCallParser("auto", tools=[WEATHER, TYPED])
    typed = xml_call("plan", title="42", days="3", rate="0.5", done="True", tags="['a', 1]", meta='{"k": null}',
                     note="[1]")
    cases = {
        xml_call("get_weather", city="Paris"): (None, [("get_weather", {"city": "Paris"})]),
        f"Let me see.\n{typed}": ("Let me see.", [("plan", {"title": "42", "days": 3, "rate": 0.5, "done": True,
                                                             "tags": ["a", 1], "meta": {"k": None}, "note": "[1]"})]),
        xml_call("plan", days="three", done="maybe"): (None, [("plan", {"days": "three", "done": "maybe"})]),
        # Multi-line text keeps its inner newlines; a value may end where the next parameter or the function's end
        # begins; an unknown tool's values are text.
        xml_call("get_weather", city="a\n\nb") + xml_call("other", n="1"):
            (None, [("get_weather", {"city": "a\n\nb"}), ("other", {"n": "1"})]),
        "<tool_call>\n<function=plan>\n<parameter=days>\n2\n<parameter=title>\nx\n</function>\n</tool_call>":
            (None, [("plan", {"days": 2, "title": "x"})]),
        "<tool_call>\n<function=plan>\n<parameter=days>\n7": (None, [("plan", {"days": 7})]),  # cut short
        # Several functions in one block, as vLLM's qwen3_coder reads them.
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n<function=plan>\n"
        "</function>\n</tool_call>": (None, [("get_weather", {"city": "Rome"}), ("plan", {})]),
        "<tool_call>\n<function=plan>\njunk\n</function>\n</tool_call>": None,
        "<tool_call>\n<function=plan>\n</function> and more\n</tool_call>": None,
        "<tool_call>\n<function=plan\n</tool_call>": None,
    }
    for text, expected in cases.items():
        content, calls = parser.parse(text)
        if expected is None:
            assert (content, calls) == (text, []), text
        else:
            assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == expected, text
        streamed, deltas, called = stream_all(parser.stream(), text, step)
        assert [(c["name"], json.loads(c["arguments"])) for c in accumulate(deltas)] == \
            [(c.name, json.loads(c.arguments)) for c in calls], text
        assert called == bool(calls) and streamed == (content or ""), text


@pytest.mark.parametrize("step", [1, 5])
def test_pythonic_calls_are_read_as_llama_3_2_and_4_write_them(step):
    """An answer that is nothing but a Python list of calls of the tools with literal keyword arguments (vLLM's
    pythonic; Llama 4 writes it between <|python_start|> and <|python_end|>); anything else stays content."""
    parser = ToolCallParser("auto", tools=[WEATHER, TIME, TYPED])
    cases = {
        '[get_weather(city="Paris")]': [("get_weather", {"city": "Paris"})],
        ' [get_weather(city="Paris"), get_time()] ': [("get_weather", {"city": "Paris"}), ("get_time", {})],
        '<|python_start|>[plan(days=3, done=True, rate=None, tags=("a", 1), meta={"k": [1.5]})]<|python_end|>':
            [("plan", {"days": 3, "done": True, "rate": None, "tags": ["a", 1], "meta": {"k": [1.5]}})],
        '[get_weather(city=city)]': [],  # not a literal
        '[get_weather(city="a", city="b")]': [],
        '[get_weather("Paris")]': [],
        '[get_weather(**{"city": "Paris"})]': [],
        '[not_a_tool(x=1)]': [],
        '[plan(tags={1, 2})]': [],  # a set is no JSON
        '[plan(rate=1e999)]': [],  # nor is infinity
        '[get_weather(city="Paris")] and more': [],
        '[get_weather(city="Paris")': [],  # cut short
        "[get_weather] is a tool": [],
        # What Python reads as such a list but a stream does not begin as one (comments, parentheses, identifiers
        # it folds) is content, as the stream sends it.
        "[(get_time())]": [], "[ # now\n get_time()]": [], "[\\\nget_time()]": [], "[ｇｅｔ_time()]": [],
        "[]": [],
    }
    assert_calls_or_content(parser, cases, step)
    assert ToolCallParser("auto").parse('[get_time()]') == ('[get_time()]', [])  # no tools, no calls to read
    stream = parser.stream()
    assert [stream.feed(piece)[0] for piece in ("[", "get_", "time", "(")] == ["", "", "", ""]  # held from "["


@pytest.mark.parametrize("step", [1, 6])
def test_calls_are_read_as_mistral_writes_them_from_its_v11_tokenizers(step):
    """[TOOL_CALLS]NAME[ARGS]{...} per call (vLLM's mistral parser, v11 tokenizers on); with special tokens skipped,
    as answers are by default, NAME{...}; anything else stays content, streamed or not."""
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    cases = {
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}': [("get_weather", {"city": "Paris"})],
        'get_weather{"city": "Paris"}': [("get_weather", {"city": "Paris"})],
        ' [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{} ':
            [("get_weather", {"city": "Rome"}), ("get_time", {})],
        'get_weather{"city": "Rome"}get_time{}': [("get_weather", {"city": "Rome"}), ("get_time", {})],
        'not_a_tool[ARGS]{}': [],
        'get_weather[ARGS]["Paris"]': [],
        'get_weather{"city": "Pa': [],  # cut short
        'get_weather{"city": "Paris"} and more': [],
        'get_weather {"city": "Paris"}': [],
        "get_weather is a tool": [],
    }
    assert_calls_or_content(parser, cases, step)
    assert ToolCallParser("auto").parse('get_time{}') == ('get_time{}', [])  # no tools, no calls to read
    stream = parser.stream()
    assert [stream.feed(piece)[0] for piece in ("get_", "time", "{")] == ["", "", ""]  # held while it may be one


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES + ["get_time{}", "get_time", "[ARGS]", "[TOOL_CALLS]", '{"city": "x"}', " ",
                                          "get_weather"]), max_size=6), st.integers(1, 9))
def test_with_tools_mistral_v11_text_streams_as_its_whole_answer_reads(pieces, step):
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    assert_streams_as_whole(parser, "".join(pieces), step)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES + ["<function=plan>", "<parameter=days>", "\n3\n", "</parameter>",
                                          "</function>", "[get_time()]", "[get_time(", "x=1", ")]", "[", ", "]),
                max_size=6), st.integers(1, 9))
def test_with_tools_xml_and_pythonic_text_streams_as_its_whole_answer_reads(pieces, step):
    parser = ToolCallParser("auto", tools=[WEATHER, TIME, TYPED])
    assert_streams_as_whole(parser, "".join(pieces), step)


def split_everywhere(parser: ToolCallParser, text: str) -> None:
    """``text`` streams as it reads whole however it is cut in two, and fed a character at a time."""
    assert_streams_as_whole(parser, text, 1)
    for cut in range(1, len(text)):
        stream = parser.stream()
        first, second = stream.feed(text[:cut]), stream.feed(text[cut:])
        rest, last, called = stream.finish()
        whole_content, whole_calls = parser.parse(text)
        assert [(c["name"], c["arguments"]) for c in accumulate(first[1] + second[1] + last)] == \
            [(c.name, c.arguments) for c in whole_calls], (text, cut)
        assert first[0] + second[0] + rest == (whole_content or ""), (text, cut)


@pytest.mark.parametrize("step", [1, 4])
def test_calls_written_one_after_another_in_one_block_are_each_read(step):
    """Some models write several calls in one hermes block: each is a call (none is dropped), streamed or not."""
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    assert_calls_or_content(parser, {
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call>': [("get_weather", {"city": "Paris"}), ("get_time", {})],
        '<tool_call>{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}'
        '</tool_call>' + CALL: [("get_time", {}), ("get_weather", {"city": "Rome"}), ("get_weather", {"city": "Paris"})],
    }, step)


@pytest.mark.parametrize("step", [1, 3])
def test_a_stray_quote_does_not_swallow_the_rest_of_the_answer(step):
    """A JSON string that meets a raw newline before it closes was no string (JSON escapes newlines): the block ends
    at the first tag in it, as it did before tags inside strings were the string's."""
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    text = ('Checking both.<tool_call>{"name": "get_weather", "arguments": {"city": "C:\\"}}</tool_call>\n\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = parser.parse(text)
    assert content == "Checking both." and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "C:\\"}}'), ("get_time", "{}")]
    assert_streams_as_whole(parser, text, step)


@pytest.mark.parametrize("step", [1, 5])
def test_the_tags_inside_arguments_are_text_of_the_call(step):
    """A call that writes the tags in its arguments (code that parses tool calls, say) is read whole: its block ends
    at a tag outside the JSON strings, or outside the XML parameter values."""
    code = 'PATTERN = "<tool_call>(.*?)</tool_call>"'
    parser = ToolCallParser("auto", tools=[WEATHER, TIME])
    assert_calls_or_content(parser, {
        '<tool_call>\n' + json.dumps({"name": "get_weather", "arguments": {"city": code}}) + '\n</tool_call>':
            [("get_weather", {"city": code})],
        xml_call("get_weather", city=code) + "\n" + CALL: [("get_weather", {"city": code}),
                                                            ("get_weather", {"city": "Paris"})],
    }, step)
    text = 'I will call it.\n' + xml_call("get_weather", city=code + "\n") + ' Done.'
    content, calls = parser.parse(text)
    assert content == "I will call it. Done." and json.loads(calls[0].arguments) == {"city": code + "\n"}
    assert_streams_as_whole(parser, text, step)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "get_weather", "arguments": 1.5}</tool_call>',  # a number the tokenizer splits: "1", ".", "5"
    '<tool_call>{"name": "get_weather", "arguments": 1.}</tool_call>',  # not JSON: as written
    '<tool_call>{"name": "get_weather", "arguments": 1.5x}</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": 12',  # cut short
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}, "name": "get_time"}</tool_call>',  # twice
    '[TOOL_CALLS]' + '\n' * 60 + '[{"name": "get_time", "arguments": {}}]',  # far after the prefix
    '{' + ' ' * 60 + '"name": "get_time", "parameters": {}}',
    '{"\\u006eame": "get_time", "parameters": {}}',  # a key no stream would take for a call's: content
    '<tool_call>{"name": "get_time</tool_call> ok <tool_call>", "arguments": {}}',  # tags in a string are its text
    '<tool_call>{"name": "get_weather", "arguments": {"city": "\\"</tool_call>\\\\"}}</tool_call> ok',  # escapes
    '<tool_call>\n<function=get_weather>\n<parameter=city>\n</tool_call><tool_call>\n</function></tool_call>',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n{"name": "get_time", "arguments": 1}'
    '\n</tool_call> ok',  # two calls in one block
    '<tool_call>{"name": "get_time", "arguments": {}, "note": "<tool_call><function=get_weather><parameter=city>\n'
    'Paris\n</parameter></function></tool_call>"}</tool_call>',  # a raw newline: that string was none
    '<tool_call>{"name": "get_time", "arguments": {}}  \n  x"<tool_call>{"name": "get_weather", "arguments": 1}'
    '</tool_call>',
])
def test_answers_streamed_in_any_two_pieces_read_as_whole(text):
    split_everywhere(ToolCallParser("auto", tools=[WEATHER, TIME]), text)


@pytest.mark.parametrize("text", ['[{"name": "get_weather", "arguments": 2e3}]',
                                  '[{"name": "get_time", "arguments": -0.5}'])
def test_a_constrained_number_streams_whole(text):
    split_everywhere(ToolCallParser("json", tools=[WEATHER, TIME]), text)


class _CountedReads(str):
    reads = 0

    def __getitem__(self, index):
        _CountedReads.reads += 1
        return str.__getitem__(self, index)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.text(" \n\tab", max_size=6), st.integers(0, 8)), max_size=30))
def test_a_streams_trailing_whitespace_is_found_reading_each_character_once(pieces):
    """Whitespace that a call may follow is held back while a stream is read; where it starts is found again with
    each new piece. Each character is read once: an answer of whitespace streamed in N pieces cost N^2 reads, seconds
    of the event loop every request shares."""
    from hf_paged.server.tool_calls import _TrailingSpace

    spaces, text = _TrailingSpace(), ""
    for piece, held in pieces:
        text += piece
        end = max(0, len(text) - held)
        assert spaces.start(text, end) == len(text[:end].rstrip())
    spaces, _CountedReads.reads, text = _TrailingSpace(), 0, "Hi"
    for _ in range(300):
        text += "\n" + " " * 80
        assert spaces.start(_CountedReads(text), len(text)) == 2
    assert _CountedReads.reads <= len(text) + 300
