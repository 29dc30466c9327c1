"""Structured outputs and tool calls through the real server and the official `openai` client."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from hf_paged import ContinuousBatchGenerator, StructuredOutputsParams  # noqa: E402
from hf_paged.generation.structured_outputs import GrammarCompiler, GrammarMatcher  # noqa: E402
from hf_paged.server import create_app  # noqa: E402
from hf_paged.server.tool_calls import calls_schema  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "smollm2-structured"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: float = Field(ge=0, le=50)


@pytest.fixture(scope="module")
def server(smollm2):
    model, tokenizer = smollm2
    generator = ContinuousBatchGenerator(model, tokenizer, num_blocks=512)
    app = create_app(generator, MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)
    yield SimpleNamespace(base=base, generator=generator)
    uv.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", QUESTION), **kwargs)


def test_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        temperature=0, max_tokens=80)
    city = done.choices[0].message.parsed
    assert isinstance(city, City) and city.name and 0 <= city.population_millions <= 50
    assert done.choices[0].finish_reason == "stop"


def test_response_format_and_structured_outputs_on_both_endpoints(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["answer"]}
    for seed in range(3):
        done = chat(client, temperature=1, seed=seed, max_tokens=30, response_format={
            "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
        jsonschema.validate(json.loads(done.choices[0].message.content), schema)
    done = client.completions.create(model=MODEL, prompt="A JSON object with a name:", max_tokens=60, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(done.choices[0].text), dict)
    done = client.completions.create(model=MODEL, prompt="A phone number:", max_tokens=20, temperature=1, seed=1,
                                     extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", done.choices[0].text)
    done = chat(client, max_tokens=5, n=3, temperature=1, seed=2, extra_body={"guided_choice": ["sunny", "rainy"]})
    assert {c.message.content for c in done.choices} <= {"sunny", "rainy"}
    stream = chat(client, max_tokens=20, temperature=0, stream=True,
                  extra_body={"structured_outputs": {"choice": ["Paris is sunny", "Paris is rainy"]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("Paris is sunny", "Paris is rainy")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "response_format.json_schema.schema is invalid"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "structured_outputs.regex is invalid"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"lark": "a"}}, "structured_outputs", ""),
    ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "guided_grammar is invalid"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "cannot be combined"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools", "tools is invalid"),
    ({"tool_choice": "sometimes"}, "tool_choice", ""),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"tools": [{"type": "function"}]}, "tools", "each tool must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tool_choice": "none"}, "tools",
     "must be a JSON schema object"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, words):
    response = httpx.post(f"{server.base}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": QUESTION, "max_tokens": 5, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_schemas_nested_too_deep_are_400s(server):
    """940 levels: Python's own JSON writer would exceed its recursion limit on them (a 500 before). Deeper still,
    the body cannot be read at all, and the error says why."""
    deep = '{"type":"array","items":' * 940 + "{}" + "}" * 940
    question = json.dumps(QUESTION)
    for param, body in [
        ("guided_json", f'{{"messages":{question},"max_tokens":1,"guided_json":{deep}}}'),
        ("response_format", f'{{"messages":{question},"max_tokens":1,"response_format":{{"type":"json_schema",'
                            f'"json_schema":{{"name":"x","schema":{deep}}}}}}}'),
        ("tools", f'{{"messages":{question},"max_tokens":1,"tools":[{{"type":"function","function":{{"name":"f",'
                  f'"parameters":{deep}}}}}]}}'),
        (None, f'{{"messages":{question},"max_tokens":1,"guided_json":{"[" * 5000 + "]" * 5000}}}'),
    ]:
        response = httpx.post(f"{server.base}/v1/chat/completions", content=body, timeout=30,
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
        assert ("levels" if param else "nested too deeply") in response.json()["error"]["message"]


@pytest.mark.parametrize("tool_calls", ["x", ["x"], [1], {"a": 1}, [{"id": "1", "type": "function", "function": "f"}],
                                        [{"type": "function", "function": {"arguments": "{}"}}],
                                        [{"type": "other", "function": {"name": "f"}}]])
def test_malformed_earlier_tool_calls_are_400s(server, tool_calls):
    messages = [{"role": "assistant", "content": "", "tool_calls": tool_calls}, *QUESTION]
    response = httpx.post(f"{server.base}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": messages, "max_tokens": 3})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"


def test_tools_are_refused_on_completions(server):
    response = httpx.post(f"{server.base}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "tools": [WEATHER], "tool_choice": "required"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    """Content, tool calls and finish_reason of a streamed choice, accumulated as an OpenAI client does."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:  # no chunk comes empty (text the call parser holds back sent them before)
            assert choice.delta.role or choice.delta.content or choice.delta.tool_calls or choice.finish_reason
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": "", "pieces": 0})
                call["id"] += delta.id or ""
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                call["pieces"] += bool(delta.function.arguments)
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def reply_calls(reply, stream: bool):
    """Content, tool calls and finish_reason of a reply's first choice, streamed or whole."""
    if stream:
        return streamed_calls(reply)
    message = reply.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls or []]
    return message.content, calls, reply.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_round_trip(client, stream):
    """Call (forced by a named tool_choice, then by "required"), tool result, final answer."""
    messages = list(QUESTION)
    for tool_choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        reply = chat(client, messages=messages, tools=[WEATHER, CLOCK], tool_choice=tool_choice, temperature=0,
                     max_tokens=60, stream=stream)
        content, calls, finish = reply_calls(reply, stream)
        # As vLLM's: "tool_calls" for auto and required, "stop" for a named function.
        assert finish == ("stop" if isinstance(tool_choice, dict) else "tool_calls") and not content
        assert calls and all(c["id"].startswith("call_") for c in calls)
        assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"])["city"]
        assert not stream or calls[0]["pieces"] > 1  # the arguments stream as they are written
    messages += [{"role": "assistant", "content": None, "tool_calls": [
                    {"id": calls[0]["id"], "type": "function",
                     "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]}}]},
                 {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 degrees and sunny"}]
    reply = chat(client, messages=messages, tools=[WEATHER, CLOCK], tool_choice="none", temperature=0, max_tokens=40,
                 stream=stream)
    if stream:
        content, calls, finish = streamed_calls(reply)
    else:
        content, calls, finish = reply.choices[0].message.content, reply.choices[0].message.tool_calls, \
            reply.choices[0].finish_reason
    assert content and not calls and finish in ("stop", "length")


def test_a_constraint_too_slow_to_follow_is_a_400_and_stalls_no_one(server, monkeypatch):
    """Its grammar work per token grew several-fold with every token (minutes by the 12th), wedging the engine
    thread: past `GrammarMatcher.max_seconds_per_token` the call fails with what went wrong, others are served."""
    monkeypatch.setattr(GrammarMatcher, "max_seconds_per_token", 0.02)
    hostile = {"model": MODEL, "messages": QUESTION, "max_tokens": 30, "temperature": 0,
               "logit_bias": {"0": -100, "1": -100, "2": -100},
               "structured_outputs": {"regex": "((a{0,60}){0,60}){0,60}"}}
    url = f"{server.base}/v1/chat/completions"
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(httpx.post, url, json=hostile, timeout=120)
        good = pool.submit(httpx.post, url, json={"model": MODEL, "messages": QUESTION, "max_tokens": 20,
                                                   "ignore_eos": True, "temperature": 0}, timeout=120)
        bad, good = bad.result(), good.result()
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs", bad.text
    assert "grammar work for one token" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 20
    streamed = httpx.post(url, json={**hostile, "stream": True}, timeout=120)
    errors = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith('data: {"error"')]
    assert errors and errors[0]["error"]["param"] == "structured_outputs" and errors[0]["error"]["code"] is None


def test_a_function_named_like_a_tool_choice_mode_is_named(client):
    """``{"function": {"name": "required"}}`` names a function; it was read as the mode ``"required"``."""
    tool = {"type": "function", "function": {**WEATHER["function"], "name": "required"}}
    reply = chat(client, tools=[tool, CLOCK], tool_choice={"type": "function", "function": {"name": "required"}},
                 temperature=0, max_tokens=40)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "required" and reply.choices[0].finish_reason == "stop"


class Place(BaseModel):
    city: str = Field(max_length=12)


class Trip(BaseModel):
    """Pydantic writes nested models as ``$defs`` with ``$ref``s to them."""

    stops: list[Place] = Field(min_length=1, max_length=2)


class Settings(BaseModel):
    default: Place  # a property named as a keyword whose value is data


def test_refs_under_property_names_that_are_keywords_are_rebased():
    schema = calls_schema({"configure": Settings.model_json_schema()})
    assert schema["$defs"]["tool_0"]["properties"]["default"] == {"$ref": "#/$defs/tool_0/$defs/Place"}


def test_tool_parameters_may_refer_to_their_own_defs_and_root(client, smollm2):
    """A forced call lands in an array of calls: references into a tool's ``$defs`` (pydantic's nested models) and
    to its root (a recursive schema) still mean the tool's own."""
    trip = {"type": "function", "function": {"name": "plan", "parameters": Trip.model_json_schema()}}
    assert "$defs" in trip["function"]["parameters"]
    reply = chat(client, tools=[WEATHER, trip], tool_choice="required", parallel_tool_calls=False, temperature=0,
                 max_tokens=60)
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "plan", reply
    jsonschema.validate(json.loads(call.function.arguments), Trip.model_json_schema())
    tree = {"type": "object", "properties": {"v": {"type": "integer"},
                                             "child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["v", "child"], "additionalProperties": False}
    tokenizer = smollm2[1]
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputsParams(json=calls_schema({"tree": tree}))).result()

    def allowed(text: str) -> bool:
        matcher = GrammarMatcher.of(grammar)
        return all(matcher.accept(t) for t in tokenizer(text, add_special_tokens=False).input_ids) and \
            matcher.accept(tokenizer.eos_token_id)

    assert allowed('[{"name": "tree", "arguments": {"v": 1, "child": {"v": 2, "child": null}}}]')
    assert not allowed('[{"name": "tree", "arguments": {"v": 1, "child": [{"name": "tree"}]}}]')  # "#" is the tool
    compiler.shutdown()


def test_a_call_whose_json_escapes_a_lone_surrogate_is_answered(server):
    """``"\\ud800"`` reads as a character UTF-8 cannot hold: the answer escapes it instead of failing (a 500)."""
    written = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'
    body = {"model": MODEL, "messages": QUESTION, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 60,
            "temperature": 0, "structured_outputs": {"choice": [written]}}
    response = httpx.post(f"{server.base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "\ud800"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_hermes_calls_out_of_free_text(client, stream):
    """``auto`` parses what the model writes; a choice constraint makes this small model write a call."""
    written = "Let me check.\n" + HERMES_CALL
    reply = chat(client, tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=60, stream=stream,
                 extra_body={"structured_outputs": {"choice": [written]}})
    content, calls, finish = reply_calls(reply, stream)
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]
    plain = chat(client, tools=[WEATHER], temperature=0, max_tokens=8, extra_body={"guided_choice": ["No tools."]})
    assert plain.choices[0].message.content == "No tools." and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_calls_cut_short_or_written_wrong_do_not_finish_as_tool_calls(client, stream):
    """A call cut by a stop string, or whose arguments are no JSON, is answered as written but finishes "stop": a
    client that sees "tool_calls" runs the calls (they used to finish so)."""
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    for written, stop in ((HERMES_CALL, ["Paris"]), (broken, None)):
        reply = chat(client, tools=[WEATHER], temperature=0, max_tokens=60, stream=stream, stop=stop,
                     extra_body={"structured_outputs": {"choice": [written]}})
        content, calls, finish = reply_calls(reply, stream)
        assert [c["name"] for c in calls] == ["get_weather"] and finish == "stop", (written, calls)
    whole = chat(client, tools=[WEATHER], temperature=0, max_tokens=60, stream=stream,
                 extra_body={"structured_outputs": {"choice": [HERMES_CALL]}})
    assert reply_calls(whole, stream)[2] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("written", [
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    "\n<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>",
    '[get_weather(city="Paris"), get_time(zone="UTC")]',
    'get_weather{"city": "Paris"}get_time{"zone": "UTC"}'], ids=["qwen3_coder", "pythonic", "mistral_v11"])
def test_auto_reads_calls_in_qwen3_coder_xml_and_pythonic_form(client, stream, written):
    """Qwen3-Coder's XML calls in hermes blocks, Llama 3.2's and 4's Python list of calls, and Mistral's calls from
    its v11 tokenizers (their special tokens skipped)."""
    reply = chat(client, tools=[WEATHER, CLOCK], tool_choice="auto", temperature=0, max_tokens=150, stream=stream,
                 extra_body={"structured_outputs": {"choice": [written]}})
    content, calls, finish = reply_calls(reply, stream)
    assert (content or "").strip() == ("Checking." if "<tool_call>" in written else "") and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_auto_reads_calls_written_as_llama_3_writes_them(client, stream):
    """An answer of JSON objects naming the tools, separated by ";" (Llama 3.x's tool calls, vLLM's llama3_json)."""
    written = '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": ' \
              '{"zone": "UTC"}}'
    reply = chat(client, tools=[WEATHER, CLOCK], tool_choice="auto", temperature=0, max_tokens=60, stream=stream,
                 extra_body={"structured_outputs": {"choice": [written]}})
    content, calls, finish = reply_calls(reply, stream)
    assert not content and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                        ("get_time", {"zone": "UTC"})]
