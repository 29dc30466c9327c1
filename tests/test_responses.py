"""OpenAI's Responses API (``POST /v1/responses``) on a live server, through the official client."""

from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("fastapi")  # the server extra, which the README's test command installs (.[test])

from live_server import MODEL, live_server, tiny_generator  # noqa: E402

from hf_paged.server import create_app  # noqa: E402

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                          "additionalProperties": False}}
CHAT_WEATHER = {"type": "function", "function": {key: WEATHER[key] for key in ("name", "description", "parameters")}}


@pytest.fixture(scope="module")
def server(smollm2_path):
    with live_server(create_app(tiny_generator(smollm2_path), MODEL)) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_response_is_the_chat_answer_of_its_instructions_and_input(client):
    response = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=8,
                                       temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert response.object == "response" and response.id.startswith("resp_") and response.store is False
    assert response.output_text == chat.choices[0].message.content
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert (response.status, message.status) == (("incomplete", "incomplete") if chat.choices[0].finish_reason ==
                                                 "length" else ("completed", "completed"))
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # Messages with text parts, a developer message as the system's.
    parts = client.responses.create(model=MODEL, max_output_tokens=8, temperature=0, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])
    assert parts.output_text == response.output_text


def test_the_sampling_settings_an_answer_was_drawn_with_are_echoed(client):
    """As vLLM echoes them: those given, else the model's defaults (not null), streamed or not."""
    given = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0.3, top_p=0.9)
    assert (given.temperature, given.top_p) == (0.3, 0.9)
    default = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert isinstance(default.temperature, float) and isinstance(default.top_p, float)
    streamed = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True))
    assert (streamed[0].response.temperature, streamed[-1].response.top_p) == (default.temperature, default.top_p)


def test_a_streamed_response_sends_each_item_added_written_and_done(client):
    asked = dict(model=MODEL, input="Tell me a story", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**asked)
    events = list(client.responses.create(**asked, stream=True))
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_text_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(model=MODEL, input="Yes or no?", max_output_tokens=20, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "reply", "schema": schema}})
    assert json.loads(response.output_text)["answer"] in ("yes", "no")


def test_function_calls_are_output_items_and_come_back_as_input(client):
    asked = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                 max_output_tokens=40, temperature=0)
    response = client.responses.create(**asked)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" and call.call_id.startswith("call_") for call in calls)
    assert all(json.loads(call.arguments) in ({"city": "Paris"}, {"city": "Rome"}) for call in calls)
    events = list(client.responses.create(**asked, stream=True))
    streamed = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.name, item.arguments) for item in streamed] == [(call.name, call.arguments) for call in calls]
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert deltas == "".join(call.arguments for call in calls)
    # The calls and their outputs sent back: the same prompt as the chat conversation that holds them.
    call = calls[0]
    turn = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
    chat = client.chat.completions.create(model=MODEL, tools=[CHAT_WEATHER], max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 C, sunny"}])
    assert turn.usage.input_tokens == chat.usage.prompt_tokens
    assert turn.output_text == (chat.choices[0].message.content or "")


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "conversation": {"id": "conv_1"}}, "conversation"),
    ({"input": "Hi", "prompt": {"id": "pmpt_1", "version": "2"}}, "prompt"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "logprobs": True}, "logprobs"),
    ({"input": "Hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "Hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "Hi", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"input": [{"role": "user", "content": "Hi"}], "tool_choice": {"type": "file_search"}}, "tool_choice"),
])
def test_what_it_cannot_take_is_a_400_naming_the_field(server, body, param):
    answer = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_ray_routes_a_response_by_the_prefix_of_its_chat_prompt():
    pytest.importorskip("ray")
    from hf_paged.serve_ray.ingress import _prompt

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = {"model": "smol", "messages": messages}
    response = {"model": "smol", "instructions": "Be brief.",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}
    assert _prompt("/v1/responses", json.dumps(response).encode(), "string") == \
        _prompt("/v1/chat/completions", json.dumps(chat).encode(), "string") == (chat["messages"], "smol")
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in chat["messages"]]
    assert _prompt("/v1/chat/completions", json.dumps(chat).encode(), "openai") == (parts, "smol")  # as replicas render


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": 5, "content": "Hi"}]}, "input"),
    ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input"),
    ({"input": "Hi", "max_output_tokens": "many"}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": "json"}}, "text"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": {"not": "text"}}]}]}, "input"),
    ({"input": "Hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content", "everything"]}, "include"),
])
def test_input_that_makes_no_chat_request_is_a_400_naming_its_field(server, body, param):
    answer = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_includes_that_ask_nothing_of_this_server_are_taken(client):
    """Clients that keep no store (Codex, say) always ask for reasoning.encrypted_content."""
    asked = ["reasoning.encrypted_content", "web_search_call.action.sources"]
    answer = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, include=asked)
    assert answer.status == "incomplete" and answer.output[0].type == "message"


@pytest.mark.parametrize("body, words", [
    ({"input": [{"role": "user", "content": "Hi"}, {"role": 5, "content": "x"}], "instructions": "Be brief."},
     "input[1].role is one of user, assistant"),  # the input item, not the chat message
    ({"input": [{"type": "reasoning", "summary": []}, {"role": "user", "content": "Hi"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "d", "name": "f", "arguments": "{}"},
                {"role": 5, "content": "x"}]}, "input[4].role is one of"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "image"}]}]},
     "input[0].output: only text parts"),
    ({"input": [{"role": "tool", "content": "18 C"}]}, "input[0].role is one of user, assistant, system, developer"),
    ({"input": [{"role": "user"}]}, "input[0].content is required"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id is required"),
    ({"input": [{"type": "function_call_output", "output": "18 C"}]}, "input[0].call_id is required"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output is required"),
    ({"input": "Hi", "stream_options": {"include_usage": True}}, "only allowed when stream is true"),
    ({"input": "Hi", "reasoning": {"effort": "bogus"}}, "reasoning.effort is one of none, minimal"),
])
def test_an_error_names_the_input_item_as_the_client_sent_it(server, body, words):
    answer = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and words in error["message"], answer.text


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"input": "Hi", "reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ({"input": "Hi", "stream": True, "stream_options": {"include_usage": "often"}}, "stream_options"),
])
def test_the_chat_requests_checks_name_this_apis_fields(server, body, param):
    """The refusals that the chat request makes (a response runs as one) name the field as the client sent it."""
    answer = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert "reasoning_effort" not in answer.text


def test_an_answer_cut_short_marks_its_last_item_incomplete_streamed_or_not(client, server):
    """Whatever the last item is (a call here, under tool_choice=required), a cut answer marks it incomplete, and
    the usage says which input tokens were computed (written to the cache) and which were read from it."""
    asked = dict(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=6,
                 temperature=0)
    whole = client.responses.create(**asked)
    streamed = [event for event in client.responses.create(**asked, stream=True)][-1].response
    for response in (whole, streamed):
        assert response.status == "incomplete" and response.output[-1].status == "incomplete"
        assert [item.type for item in response.output] == [item.type for item in whole.output]
        details = response.usage.input_tokens_details
        assert details.cached_tokens + details.cache_write_tokens == response.usage.input_tokens


@pytest.mark.parametrize("body, param, words", [
    ({"max_output_tokens": 5000}, "max_output_tokens", "'max_output_tokens' is too large"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text",
     "text.format.schema is invalid"),
])
def test_errors_of_the_chat_request_name_this_apis_fields(server, body, param, words):
    answer = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, "input": "Hi", **body}, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param and words in error["message"], answer.text


def test_each_streamed_item_is_done_before_the_next_is_added():
    from hf_paged.server.responses import ResponseEvents, ResponsesRequest

    events = ResponseEvents(ResponsesRequest(input="Hi"), MODEL)
    sent = events.start() + events.delta({"reasoning": "plan"}) + events.delta({"content": "Sure."})
    for index, name in enumerate(("f", "g")):
        call = {"index": index, "id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": ""}}
        sent += events.delta({"tool_calls": [call]})
        sent += events.delta({"tool_calls": [{"index": index, "function": {"arguments": "{}"}}]})
    sent += events.finish("completed", {})
    bodies = [json.loads(event.split("data: ", 1)[1]) for event in sent]
    items = [(body["type"].removeprefix("response.output_item."), body["item"]["type"]) for body in bodies
             if body["type"].startswith("response.output_item.")]
    assert items == [("added", "reasoning"), ("done", "reasoning"), ("added", "message"), ("done", "message"),
                     ("added", "function_call"), ("done", "function_call"), ("added", "function_call"),
                     ("done", "function_call")]
    final = bodies[-1]["response"]["output"]
    assert [item.get("arguments") for item in final] == [None, None, "{}", "{}"]
    assert all(item["status"] == "completed" for item in final)


def test_a_chunk_that_ends_a_call_and_writes_on_ends_the_call_first():
    """A chunk of several tokens (speculation, a reader that fell behind) may end a call and hold text after it: the
    call's last arguments go out before it is done, and done holds them all."""
    from hf_paged.server.responses import ResponseEvents, ResponsesRequest

    events = ResponseEvents(ResponsesRequest(input="Hi"), MODEL)
    call = {"index": 0, "id": "call_f", "type": "function", "function": {"name": "f", "arguments": '{"a":'}}
    sent = events.start() + events.delta({"tool_calls": [call]})
    sent += events.delta({"content": " ok", "tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]})
    sent += events.finish("completed", {})
    bodies = [json.loads(event.split("data: ", 1)[1]) for event in sent][2:]
    kinds = [body["type"].removeprefix("response.") for body in bodies]
    assert kinds == ["output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
                     "function_call_arguments.done", "output_item.done", "output_item.added", "content_part.added",
                     "output_text.delta", "output_text.done", "content_part.done", "output_item.done", "completed"]
    assert bodies[3]["arguments"] == bodies[4]["item"]["arguments"] == '{"a": 1}'


def test_an_answers_text_and_calls_sent_back_are_one_assistant_turn(client):
    """``input += response.output``: the message and the calls after it are the one assistant turn that the model
    wrote (the same prompt as the chat conversation holding it), not two."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    turn = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []}, call,
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}])
    chat = client.chat.completions.create(model=MODEL, tools=[CHAT_WEATHER], max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}])
    assert turn.usage.input_tokens == chat.usage.prompt_tokens
    # Text on both sides of the call, as a stream gives it back: three items, still the one turn.
    before, after = ({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
                     for text in ("Let me", " look."))
    again = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": "Weather in Paris?"}, before, call, after,
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens


def test_reasoning_sent_back_reaches_a_template_that_renders_it(smollm2):
    """A reasoning item goes to the assistant turn after it as ``reasoning_content`` (Qwen3's template renders it
    for the turns of a tool loop): the same prompt as the chat conversation that carries it; reasoning before a
    user message belongs to no turn."""
    import copy

    from starlette.testclient import TestClient

    from hf_paged import ContinuousBatchGenerator

    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {% if m.reasoning_content %}<think>"
                               "{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}\n{% endfor %}assistant:")
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL)
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "They want a greeting."}]}
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]}
    with TestClient(app) as test_client:
        def prompt_tokens(path, body):
            answer = test_client.post(path, json={"model": MODEL, "max_tokens": 1, **body})
            assert answer.status_code == 200, answer.text
            usage = answer.json()["usage"]
            return usage.get("input_tokens", usage.get("prompt_tokens"))

        user = {"role": "user", "content": "Hi"}
        chat = prompt_tokens("/v1/chat/completions", {"messages": [
            user, {"role": "assistant", "content": "Hello!", "reasoning_content": "They want a greeting."}, user]})
        plain = prompt_tokens("/v1/chat/completions", {"messages": [user, {"role": "assistant", "content": "Hello!"},
                                                                     user]})
        assert chat > plain
        assert prompt_tokens("/v1/responses", {"input": [user, thought, said, user]}) == chat
        assert prompt_tokens("/v1/responses", {"input": [user, said, thought, user]}) == plain


def test_parallel_tool_calls_false_answers_the_first_call_only(client):
    """Under ``tool_choice`` auto nothing holds the model to one call: as vLLM, only the first is answered (a regex
    stands in for a model that writes two), in chat and Responses, streamed or not."""
    import re

    two = "".join(f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>\n'
                  for city in ("Paris", "Rome"))
    extra = {"structured_outputs": {"regex": re.escape(two.strip())}}
    asked = dict(model=MODEL, tools=[CHAT_WEATHER], max_tokens=100, temperature=0, extra_body=extra,
                 messages=[{"role": "user", "content": "Weather in Paris and Rome?"}])
    for parallel, cities in ((True, ["Paris", "Rome"]), (False, ["Paris"])):
        whole = client.chat.completions.create(**asked, parallel_tool_calls=parallel).choices[0].message
        assert [json.loads(c.function.arguments)["city"] for c in whole.tool_calls] == cities
        chunks = list(client.chat.completions.create(**asked, parallel_tool_calls=parallel, stream=True))
        indices = {c.index for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []}
        assert indices == set(range(len(cities)))
        response = client.responses.create(model=MODEL, input="Weather in Paris and Rome?", tools=[WEATHER],
                                           max_output_tokens=100, temperature=0, extra_body=extra,
                                           parallel_tool_calls=parallel)
        calls = [item for item in response.output if item.type == "function_call"]
        assert [json.loads(c.arguments)["city"] for c in calls] == cities


def test_a_name_the_client_chose_is_kept_in_an_error():
    from hf_paged.server.protocol import APIError
    from hf_paged.server.responses import renamed

    err = renamed(APIError(400, "tool_choice names 'messages', which is not among the tools; messages[0] is bad",
                           param="tool_choice"))
    assert err.message == "tool_choice names 'messages', which is not among the tools; input[0] is bad"
    err = renamed(APIError(400, "'max_completion_tokens' is too large", param="max_completion_tokens"))
    assert err.message == "'max_output_tokens' is too large" and err.param == "max_output_tokens"
    err = renamed(APIError(400, "the model's context is 2048 tokens: lower max_completion_tokens or 'messages'",
                           param="max_completion_tokens"))
    assert err.message == "the model's context is 2048 tokens: lower max_output_tokens or 'messages'"
    err = renamed(APIError(400, "the tokenizer's messages aren't valid", param="messages"))
    assert err.message == "the tokenizer's input aren't valid"
    err = renamed(APIError(400, "response_format: #/$defs/response_format is not found", param="response_format"))
    assert err.message == "text.format: #/$defs/response_format is not found"


def test_a_previous_response_is_not_found_as_vllm_answers_an_unknown_id(server):
    answer = httpx.post(f"{server.base}/v1/responses", json={"model": MODEL, "input": "Hi",
                                                             "previous_response_id": "resp_1"}, timeout=30)
    error = answer.json()["error"]
    assert answer.status_code == 404 and error["param"] == "previous_response_id" and "'resp_1'" in error["message"]


def test_responses_are_not_stored_and_asking_for_one_says_so(client):
    import openai

    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=True)
    assert response.store is False
    for ask in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match="this server keeps no responses"):
            ask(response.id)


def test_a_stream_whose_request_fails_ends_with_an_error_and_response_failed(server, client, monkeypatch):
    """A constraint too slow to follow fails its request mid-stream (see test_structured_server)."""
    from hf_paged.generation.structured_outputs import GrammarMatcher

    monkeypatch.setattr(GrammarMatcher, "max_seconds_per_token", 0.02)
    events = list(client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=30, temperature=0, stream=True,
        extra_body={"logit_bias": {"0": -100, "1": -100, "2": -100},
                    "structured_outputs": {"regex": "((a{0,60}){0,60}){0,60}"}}))
    assert [event.type for event in events[-2:]] == ["error", "response.failed"]
    assert events[-2].param == "structured_outputs" and "grammar work for one token" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "invalid_prompt" and failed.error.message
