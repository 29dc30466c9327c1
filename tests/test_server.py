"""The OpenAI-compatible server, run for real with uvicorn on a local port and driven by the `openai` client."""

from __future__ import annotations

import copy
import json
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from conftest import CHAT_PROMPTS

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hf_paged import ContinuousBatchGenerator, SamplingParams, __version__  # noqa: E402
from hf_paged.server import ServerLimits, create_app  # noqa: E402
from live_server import live_server, wait_until_idle  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "test-key"
MODEL = "smollm2-test"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The three primary colors are"
GREEDY_TOKENS = 12


def wait_until_up(base: str, timeout: float, process=None) -> None:
    """Poll ``/health`` until it answers 200 (and, for a server ``process``, while that has not exited)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert process is None or process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(smollm2):
    """The real server on a free port, with greedy reference outputs computed by its own generator beforehand."""
    model, tokenizer = smollm2
    # A context of 2,048 tokens: cheap to fill to its limit.
    generator = ContinuousBatchGenerator(model, tokenizer, num_blocks=512, max_model_len=2048)
    greedy = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS)
    chat_ref, prompt_ref = generator.run([CHAT, PROMPT], greedy, use_tqdm=False)
    bad_words = prompt_ref.outputs[0].text.split()[:1]  # the first word the prompt's greedy output says
    bad_words_ref = generator.run([PROMPT], greedy.replace(bad_words=bad_words), use_tqdm=False)[0].outputs[0]
    beams = SamplingParams(n=3, use_beam_search=True, max_tokens=GREEDY_TOKENS, length_penalty=0.5)
    beam_refs = [[beam.text for beam in output.outputs] for output in
                 generator.run([PROMPT, CHAT], [beams, beams.replace(n=2, length_penalty=1.0)], use_tqdm=False)]
    app = create_app(generator, MODEL, api_key=API_KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_until_up(base, timeout=30)
    yield SimpleNamespace(base=base, generator=generator, app=app, chat_ref=chat_ref.outputs[0],
                          prompt_ref=prompt_ref.outputs[0], bad_words=bad_words, bad_words_ref=bad_words_ref,
                          beam_refs=beam_refs)
    uv.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, path: str, body, key: str | None = API_KEY) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{server.base}{path}", content=content, headers=headers, timeout=60)


def metric(server, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when absent)."""
    text = httpx.get(f"{server.base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_health_models_and_open_routes(server, client):
    assert httpx.get(f"{server.base}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.base}/ping").json() == httpx.post(f"{server.base}/ping").json() == {"status": "ok"}
    assert httpx.get(f"{server.base}/version").json() == {"version": __version__}  # open, as vLLM's
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4o")


def test_browsers_may_call_from_any_origin(server):
    """CORS as vLLM's default: a preflight is answered without the key, and answers carry the allowed origin."""
    origin = "http://localhost:3000"
    preflight = httpx.options(f"{server.base}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] in ("*", origin)
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    answer = httpx.post(f"{server.base}/v1/completions", headers={"Origin": origin, "Authorization": f"Bearer {API_KEY}"},
                        json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] in ("*", origin)


def test_greedy_chat_and_completion_match_the_generator(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=GREEDY_TOKENS)
    assert chat.choices[0].message.content == server.chat_ref.text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == server.chat_ref.finish_reason
    assert chat.usage.completion_tokens == len(server.chat_ref.token_ids)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens

    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS)
    assert done.choices[0].text == server.prompt_ref.text
    assert done.usage.completion_tokens == len(server.prompt_ref.token_ids)


def test_content_parts_are_text_or_an_assistants_refusal(server):
    """As vLLM reads them: a refusal part is its text; a part of another type is a 400 naming it."""
    def prompt_of(messages) -> list[int]:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "return_token_ids": True}
        answer = post(server, "/v1/chat/completions", body)
        assert answer.status_code == 200, answer.text
        return answer.json()["prompt_token_ids"]

    question = {"role": "user", "content": "Why?"}
    refused = [question, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot say."}]}, question]
    said = [question, {"role": "assistant", "content": "I cannot say."}, question]
    assert prompt_of(refused) == prompt_of(said)
    image = {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [image]}), 400, None,
                 "content part 1 is of type 'image_url'")


def test_usage_says_how_many_prompt_tokens_the_prefix_cache_held(server, client):
    prompt = "Here is a long and particular prompt, long enough to fill two blocks of the cache at the least. " * 2
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 16 <= again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}] * 2,
                                                   max_tokens=2, stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens is not None


def test_a_cache_salt_keeps_a_prompts_cached_blocks_to_requests_of_the_same_salt(server, client):
    """vLLM's ``cache_salt``: the second request with a salt reads the first's blocks; another salt reads none."""
    prompt = "A salted prompt, long enough to fill two blocks of the cache at the least, for one user alone. " * 2

    def cached(salt) -> int:
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0
    assert cached("tenant-a") >= 16
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    assert post(server, "/v1/chat/completions", {**chat, "cache_salt": "tenant-c"}).status_code == 200
    assert_error(post(server, "/v1/chat/completions", {**chat, "cache_salt": ""}), 400, "cache_salt",
                 "cache_salt must be a non-empty string")
    response = {"model": MODEL, "input": prompt, "max_output_tokens": 1}

    def response_cached(**salt) -> int:
        return post(server, "/v1/responses", {**response, **salt}).json()["usage"]["input_tokens_details"][
            "cached_tokens"]

    assert response_cached() >= 16  # unsalted: at least the chat template's system prompt is cached
    assert response_cached(cache_salt="tenant-d") == 0 and response_cached(cache_salt="tenant-d") >= 16


def test_a_message_without_content_reads_as_empty_as_in_vllm(server, client):
    messages = [*CHAT, {"role": "assistant", "content": None}, {"role": "user", "content": "Go on."}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    empty = client.chat.completions.create(model=MODEL, messages=[*messages[:-2], {**messages[-2], "content": ""},
                                                                  messages[-1]], max_tokens=2)
    assert answer.usage.prompt_tokens == empty.usage.prompt_tokens


def test_streaming_sends_deltas_that_add_up(server, client, smollm2):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_tokens=GREEDY_TOKENS, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == server.chat_ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == server.chat_ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(server.chat_ref.token_ids)
    raw = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = [json.loads(line[len("data: "):]) for line in raw.text.splitlines() if line.startswith("data: {")]
    assert all(event["usage"] is None for event in events[:-1]) and events[-1]["usage"]["completion_tokens"] == 4
    continuous = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "n": 2,
                                                  "ignore_eos": True, "stream": True, "stream_options": {
                                                      "include_usage": True, "continuous_usage_stats": True}})
    events = [json.loads(line[len("data: "):]) for line in continuous.text.splitlines() if line.startswith("data: {")]
    counts = {}  # as vLLM's: each chunk's usage is its choice's so far (the last one, the call's)
    for event in events[:-1]:
        counts.setdefault(event["choices"][0]["index"], []).append(event["usage"]["completion_tokens"])
    assert {i: (c == sorted(set(c)), c[-1]) for i, c in counts.items()} == {0: (True, 4), 1: (True, 4)}
    assert events[-1]["usage"]["completion_tokens"] == 8 and events[-1]["choices"] == []
    assert {event["usage"]["prompt_tokens"] for event in events} == {len(smollm2[1](PROMPT).input_ids)}
    assert all(e["usage"]["total_tokens"] == e["usage"]["prompt_tokens"] + e["usage"]["completion_tokens"]
               for e in events)

    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS, stream=True)]
    assert len(pieces) > 2 and "".join(pieces) == server.prompt_ref.text


def test_return_token_ids_as_vllm(server, client, smollm2):
    """Each choice's token ids and its prompt's: in the choice (completions) or the response (chat); streamed, in
    every chunk's choice, the prompt's in its first."""
    prompt_ids = smollm2[1](PROMPT).input_ids
    greedy = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": GREEDY_TOKENS, "return_token_ids": True}
    [choice] = post(server, "/v1/completions", greedy).json()["choices"]
    assert choice["token_ids"] == server.prompt_ref.token_ids and choice["prompt_token_ids"] == prompt_ids
    echoed = post(server, "/v1/completions", {**greedy, "echo": True}).json()["choices"][0]
    assert echoed["token_ids"] == server.prompt_ref.token_ids and echoed["text"].startswith(PROMPT)
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 0,
                                                 "max_tokens": GREEDY_TOKENS, "return_token_ids": True}).json()
    assert chat["choices"][0]["token_ids"] == server.chat_ref.token_ids and chat["prompt_token_ids"]
    for body in ({**greedy, "stream": True}, {**greedy, "stream": True, "echo": True, "logprobs": 1}):
        raw = post(server, "/v1/completions", body)
        events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
        chunks = [event["choices"][0] for event in events]
        assert [t for c in chunks for t in c["token_ids"]] == server.prompt_ref.token_ids
        assert chunks[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in chunks[1:])
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    raw = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 0, "tools": tools,
                                                "max_tokens": GREEDY_TOKENS, "return_token_ids": True, "stream": True})
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: {")]
    streamed = [t for e in events for t in e["choices"][0].get("token_ids", [])]
    tooled = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "temperature": 0,
                                                   "tools": tools, "max_tokens": GREEDY_TOKENS,
                                                   "return_token_ids": True}).json()
    assert streamed == tooled["choices"][0]["token_ids"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # the opening chunk carries the prompt's ids
    assert events[0]["prompt_token_ids"] == tooled["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    plain = post(server, "/v1/completions", {**greedy, "return_token_ids": False}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_truncate_prompt_tokens_as_vllm(server, smollm2):
    """A prompt's last k tokens; one too long for the context is measured only once truncated."""
    ids = smollm2[1](PROMPT).input_ids
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 4, "return_token_ids": True}
    [cut] = post(server, "/v1/completions", {**greedy, "prompt": PROMPT, "truncate_prompt_tokens": 3}).json()["choices"]
    [alone] = post(server, "/v1/completions", {**greedy, "prompt": ids[-3:]}).json()["choices"]
    assert cut["prompt_token_ids"] == ids[-3:] and cut["token_ids"] == alone["token_ids"]
    huge = "a " * (server.generator.max_model_len * 40)  # past the characters any prompt of the context could have
    assert_error(post(server, "/v1/completions", {**greedy, "prompt": huge}), 400, "prompt")
    [kept] = post(server, "/v1/completions", {**greedy, "prompt": huge, "truncate_prompt_tokens": 16}).json()["choices"]
    assert len(kept["prompt_token_ids"]) == 16
    chat = post(server, "/v1/chat/completions", {**greedy, "messages": [{"role": "user", "content": huge}],
                                                 "truncate_prompt_tokens": 16}).json()
    assert len(chat["prompt_token_ids"]) == 16
    assert_error(post(server, "/v1/completions", {**greedy, "prompt": PROMPT, "truncate_prompt_tokens": 0}), 400,
                 "truncate_prompt_tokens")
    assert_error(post(server, "/v1/completions", {**greedy, "prompt": PROMPT, "truncate_prompt_tokens": 3,
                                                  "echo": True}), 400, "truncate_prompt_tokens", "echo")


def test_stop_strings_streamed_and_not(server, client):
    words = server.prompt_ref.text.split()
    stop = words[2]
    expected = server.prompt_ref.text[: server.prompt_ref.text.index(stop)]
    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS,
                                     stop=[stop, "never-seen-stop"])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (expected, "stop")
    assert done.choices[0].stop_reason == stop  # vLLM's field: the stop string, or token id, that ended it
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert [c.choices[0].stop_reason for c in streamed] == [None] * (len(streamed) - 1) + [stop]
    stop_id = server.prompt_ref.token_ids[3]
    by_token = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS,
                                         extra_body={"stop_token_ids": [stop_id]})
    assert (by_token.choices[0].finish_reason, by_token.choices[0].stop_reason) == ("stop", stop_id)
    chat_stop = server.chat_ref.text.split()[1]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=GREEDY_TOKENS,
                                          stop=chat_stop)
    assert (chat.choices[0].finish_reason, chat.choices[0].stop_reason) == ("stop", chat_stop)


def test_tokenize_and_detokenize_as_vllm(server, client, smollm2):
    """vLLM's /tokenize counts what a call would run: a chat's count is its usage's prompt tokens."""
    _, tokenizer = smollm2
    answer = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert answer["tokens"] == tokenizer(PROMPT).input_ids and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == server.generator.max_model_len
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    counted = post(server, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert counted["count"] == chat.usage.prompt_tokens and counted["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": answer["tokens"]}).json() == {"prompt": PROMPT}
    assert_error(post(server, "/detokenize", {"tokens": [10 ** 9]}), 400, "tokens", "outside the model's vocabulary")
    assert_error(post(server, "/tokenize", {"prompt": ["x"]}), 400, "prompt")
    assert_error(post(server, "/tokenize", {"prompt": "x", "model": "other"}), 404, "model")
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401  # the key guards them, as /v1
    # A prompt is counted whatever its length (a client asks to learn whether it fits), as vLLM's
    long = post(server, "/tokenize", {"prompt": "word " * 3000}).json()
    assert long["count"] == len(tokenizer("word " * 3000).input_ids) > server.generator.max_model_len
    assert_error(post(server, "/tokenize", {"prompt": "word " * 14000}), 400, "prompt",
                 "more than could fit")  # more characters than the context could hold at 32 a token: not tokenized
    chat_long = post(server, "/tokenize", {"messages": [{"role": "user", "content": "word " * 3000}]}).json()
    assert chat_long["count"] > 3000
    assert post(server, "/tokenize", {"messages": None, "prompt": PROMPT}).json()["tokens"] == answer["tokens"]
    assert_error(post(server, "/tokenize", {"messages": CHAT, "chat_template": "{{ messages }}"}), 400,
                 "chat_template", "not supported")  # as the chat endpoint refuses it, not counted with another


def test_n_max_tokens_and_prompt_lists(server, client):
    done = client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=3, max_tokens=5)
    assert sorted(c.index for c in done.choices) == [0, 1]
    assert all(c.finish_reason in ("length", "stop") for c in done.choices)
    assert done.usage.completion_tokens <= 10
    first = client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=0, max_tokens=1)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts[0] == texts[1] and texts[0] and server.prompt_ref.text.startswith(texts[0])
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, n=2, seed=1, max_completion_tokens=4,
                                                 stream=True, stream_options={"include_usage": True}))
    finish = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices}
    assert set(finish) == {0, 1} and all(finish.values())
    assert chunks[-1].usage.completion_tokens <= 8

    both = client.completions.create(model=MODEL, prompt=[PROMPT, "Paris is"], temperature=0, max_tokens=GREEDY_TOKENS)
    assert [c.index for c in sorted(both.choices, key=lambda c: c.index)] == [0, 1]
    assert sorted(both.choices, key=lambda c: c.index)[0].text == server.prompt_ref.text


def test_logprobs(server, client):
    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == done.usage.completion_tokens
    for logprob, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert "".join(lp.tokens) == done.choices[0].text
    # Streamed with a stop string that holds text back: the same tokens at the same offsets.
    args = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=12, logprobs=1, stop=["#####"])
    whole = client.completions.create(**args).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True) if c.choices]
    assert [t for c in chunks if c for t in c.tokens] == whole.tokens
    assert [o for c in chunks if c for o in c.text_offset] == whole.text_offset

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=6, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    # The bytes of the tokens that split a character join into it (each token's text alone is U+FFFD).
    emoji = [{"role": "user", "content": "Reply with emoji only."}, {"role": "assistant", "content": "😀🍣"}]
    split = client.chat.completions.create(model=MODEL, messages=emoji, temperature=0, max_tokens=8, logprobs=True,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False})
    tokens = split.choices[0].logprobs.content
    joined, said = bytes(b for t in tokens for b in t.bytes), split.choices[0].message.content.encode()
    assert any(t.token == "\ufffd" for t in tokens) and said
    assert joined.startswith(said) and len(joined) - len(said) < 4  # max_tokens may cut the last character


def test_beam_search_answers_the_engines_beams(server, client):
    """vLLM's ``use_beam_search``: ``n`` beams, best first, whole in one answer or in a stream."""
    done = client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=GREEDY_TOKENS,
                                     extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [choice.text for choice in sorted(done.choices, key=lambda c: c.index)] == server.beam_refs[0]
    assert len(set(server.beam_refs[0])) == 3
    chunks = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, max_completion_tokens=GREEDY_TOKENS,
                                            stream=True, extra_body={"use_beam_search": True})
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    assert [texts[0], texts[1]] == server.beam_refs[1]
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2, "logprobs": 1,
                                                  "use_beam_search": True}), 400, "logprobs", "use_beam_search")
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2, "use_beam_search": True,
                                                  "early_stopping": "soon"}), 400)
    constrained = {"model": MODEL, "messages": CHAT, "n": 2, "use_beam_search": True,
                   "response_format": {"type": "json_object"}}
    assert_error(post(server, "/v1/chat/completions", constrained), 400, "response_format", "use_beam_search")
    wait_until_idle(server.generator)


def test_completion_logprobs_of_tokens_that_split_a_character(server, client):
    """The pieces of a character (each "\ufffd" as text) count once in the text offsets, and top_logprobs names the
    sampled token with its own logprob, though likelier pieces share its name."""
    prompt = "I love \U0001F600 and caf\u00e9"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    lp = echoed.choices[0].logprobs
    assert echoed.choices[0].text == prompt
    assert lp.tokens == ["I", " love", " \ufffd", "\ufffd", " and", " caf\u00e9"]
    assert lp.text_offset == [0, 1, 6, 7, 8, 12]  # the second piece at its character, " and" right after it
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=0,
                                         temperature=0, stream=True)
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets[:6] == lp.text_offset
    done = client.completions.create(model=MODEL, prompt="Hello = \u3053\u3093\u306b\u3061\u306f. Thank you =",
                                     max_tokens=4, temperature=0, logprobs=5)
    lp, text = done.choices[0].logprobs, done.choices[0].text
    assert "\ufffd" in lp.tokens
    assert all(top[token] == logprob for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert all(offset < len(text) for offset in lp.text_offset)


def test_token_bytes_are_the_vocabularys(smollm2):
    """Byte-level BPE (SmolLM2) and SentencePiece-style (Metaspace, byte fallback) vocabularies."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_paged.server.tokenization import TokenText

    _, tokenizer = smollm2
    text = TokenText(tokenizer)
    for sample in ["😀 café", "東京 naïve", "Hello world"]:
        ids = tokenizer(sample, add_special_tokens=False).input_ids
        assert b"".join(map(text.bytes, ids)) == sample.encode()
    assert text.bytes(tokenizer.eos_token_id) == tokenizer.eos_token.encode()
    vocab = {"<unk>": 0, "<s>": 1, "\u2581hello": 2, "<0xC3>": 3, "<0xA9>": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    backend.decoder = decoders.Metaspace(prepend_scheme="always")
    pieces = TokenText(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>"))
    assert [pieces.bytes(i) for i in (2, 3, 4)] == [b" hello", b"\xc3", b"\xa9"]
    assert [pieces(i) for i in (1, 2)] == ["<s>", " hello"]  # the text keeps the word's space (decode drops it)
    # Llama 2's, Mistral's and Gemma's decoder: Replace("\u2581", " "), then byte fallback, fuse, strip.
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    pieces = TokenText(PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>"))
    assert [pieces.bytes(i) for i in (2, 3, 4)] == [b" hello", b"\xc3", b"\xa9"]
    assert [pieces(i) for i in (1, 2)] == ["<s>", " hello"]
    assert [text(i) for i in tokenizer(" Hello world", add_special_tokens=False).input_ids] == [" Hello", " world"]


def test_concurrent_streams_batch_together(server, client):
    def one(question: str) -> tuple[str, str | None]:
        text, reason = "", None
        for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                temperature=0, max_tokens=16, stream=True):
            if c.choices:
                text += c.choices[0].delta.content or ""
                reason = c.choices[0].finish_reason or reason
        return text, reason

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, CHAT_PROMPTS[:16]))
    assert all(text and reason in ("stop", "length") for text, reason in results)
    steps = metric(server, "hf_paged:num_running_per_step_count")
    single = metric(server, "hf_paged:num_running_per_step_bucket", le="1.0")
    assert steps > single, "no step ever decoded more than one sequence"
    assert metric(server, "hf_paged:generation_tokens_total") > 0
    finished = sum(metric(server, "hf_paged:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished >= 16
    assert metric(server, "hf_paged:time_to_first_token_seconds_count") >= 16
    # vLLM's per-request histograms: each finished request's phases, prompt and output lengths.
    for phase in ("queue", "prefill", "decode", "inference"):
        assert metric(server, f"hf_paged:request_{phase}_time_seconds_count") >= 16
    assert metric(server, "hf_paged:request_prompt_tokens_count") >= 16
    assert metric(server, "hf_paged:request_prompt_tokens_bucket", le="1.0") == 0  # chat prompts are longer
    generated = metric(server, "hf_paged:request_generation_tokens_sum")
    assert metric(server, "hf_paged:request_generation_tokens_bucket", le="20.0") == metric(
        server, "hf_paged:request_generation_tokens_count") and generated >= 16
    wait_until_idle(server.generator, engine=server.app.state.engine)
    assert metric(server, "hf_paged:kv_cache_usage_perc") == 0
    assert metric(server, "hf_paged:num_requests_running") == 0
    assert metric(server, "hf_paged:request_params_n_count") >= 16
    assert metric(server, "hf_paged:cache_config_info", block_size=str(server.generator.config.block_size),
                  num_gpu_blocks="512", enable_prefix_caching="True") == 1


def test_a_finished_requests_phases_and_lengths_are_observed_as_vllms():
    """Per request: its phases and its prompt's length (once it ran); per sample (each of its n, as vLLM's child
    requests): its finish reason ("error" for a request the engine failed) and its tokens. The finish reasons' series
    are there from the start, as vLLM's."""
    from prometheus_client import generate_latest

    from hf_paged.generation import CompletionOutput, EngineStats, RequestMetrics, RequestOutput
    from hf_paged.server.metrics import ServerMetrics

    metrics = ServerMetrics(model_name="m", max_model_len=300)

    def scraped() -> dict:
        return {(s.name, s.labels.get("le") or s.labels.get("finished_reason")): s.value
                for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                for s in family.samples}

    assert all(scraped()[("hf_paged:request_success_total", r)] == 0 for r in ("stop", "length", "abort", "error"))
    times = RequestMetrics(arrival_time=10.0, first_scheduled_time=11.0, first_token_time=13.5, finished_time=20.0,
                           num_output_tokens=7)
    stats = EngineStats(0, 0, 0.0, 0, 16, 0, 0, 0, 0, 0, 0)
    metrics.observe_submitted("r", 2, None)
    # An id in flight already (a request the engine then refuses) leaves the first one's entry as it was.
    assert metrics.observe_submitted("q", 1, 50) and not metrics.observe_submitted("r", 9, 9)
    metrics.observe_step(stats, [RequestOutput("r", None, list(range(30)), [
        CompletionOutput(0, "", [5] * 4, None), CompletionOutput(1, "", [6] * 3, "length")], False, times)])
    done = RequestOutput("r", None, list(range(30)), [CompletionOutput(0, "", [5] * 3, "stop")], True, times)
    never_ran = RequestOutput("q", None, [1], [CompletionOutput(0, "", [], "abort")], True,
                              RequestMetrics(arrival_time=10.0, finished_time=12.0))
    failed = RequestOutput("f", None, [1, 2], [], True, RequestMetrics(arrival_time=10.0, finished_time=12.0),
                           error="the constraint failed")
    metrics.observe_step(EngineStats(0, 0, 0.0, 0, 16, 0, 0, 0, 0, prompt_tokens=30, generation_tokens=10),
                         [done, never_ran, failed])
    samples = scraped()
    # vLLM's per-request parameters (max_tokens: what the context left, when not given), the longest sample, and
    # the tokens of each step (prompts whose first token came, tokens generated).
    assert samples[("hf_paged:request_params_n_sum", None)] == 3
    assert samples[("hf_paged:request_params_n_count", None)] == 2  # not "f", which was never submitted
    assert samples[("hf_paged:request_params_max_tokens_sum", None)] == 300 - 30 + 50
    assert samples[("hf_paged:request_max_num_generation_tokens_sum", None)] == 7
    assert samples[("hf_paged:iteration_tokens_total_sum", None)] == 40
    assert samples[("hf_paged:iteration_tokens_total_count", None)] == 2
    assert not metrics._params
    for phase, seconds in (("queue", 1.0), ("prefill", 2.5), ("decode", 6.5), ("inference", 9.0)):
        assert samples[(f"hf_paged:request_{phase}_time_seconds_count", None)] == 1
        assert samples[(f"hf_paged:request_{phase}_time_seconds_sum", None)] == seconds
    assert samples[("hf_paged:e2e_request_latency_seconds_count", None)] == 3
    assert [samples[("hf_paged:request_success_total", r)] for r in ("stop", "length", "abort", "error")] == [1] * 4
    assert samples[("hf_paged:request_prompt_tokens_sum", None)] == 30  # the two that never ran: none
    assert samples[("hf_paged:request_prompt_tokens_bucket", "50.0")] == 1
    assert samples[("hf_paged:request_prompt_tokens_bucket", "20.0")] == 0
    assert samples[("hf_paged:request_generation_tokens_sum", None)] == 7 + 3
    assert samples[("hf_paged:request_generation_tokens_count", None)] == 2
    assert ("hf_paged:request_generation_tokens_bucket", "200.0") in samples
    assert ("hf_paged:request_generation_tokens_bucket", "500.0") not in samples  # up to max_model_len
    assert samples[("hf_paged:request_time_per_output_token_seconds_sum", None)] == 6.5 / 6  # over 7 - 1 gaps
    assert samples[("hf_paged:time_to_first_token_seconds_bucket", "2560.0")] == 1


def assert_error(response: httpx.Response, status: int, param: str | None = None, words: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words.lower() in error["message"].lower()
    if param is not None:
        assert error["param"] == param
    return error


def test_a_token_limit_past_the_context_is_refused_as_vllm_refuses_it(server):
    context = server.generator.max_model_len
    prompt = [5] * (context - 10)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 11}
    error = assert_error(post(server, "/v1/completions", body), 400, "max_tokens", "'max_tokens' is too large: 11")
    assert f"maximum context length is {context} tokens and your request has {context - 10} input" in error["message"]
    answer = post(server, "/v1/completions", {**body, "max_tokens": 10, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 10
    chat = {"model": MODEL, "messages": CHAT, "max_completion_tokens": context}
    assert_error(post(server, "/v1/chat/completions", chat), 400, "max_completion_tokens", "is too large")


def test_a_call_of_several_prompts_counts_them_all_and_indexes_their_choices(server, smollm2):
    """Choices ``2i`` and ``2i + 1`` answer prompt ``i`` (n = 2), and usage counts every prompt's tokens."""
    _, tokenizer = smollm2
    prompts = ["The sky is", "A much longer prompt, about the sea and its waves, is"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 3, "echo": True, "seed": 1}
    answer = post(server, "/v1/completions", body).json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["text"].startswith(prompts[c["index"] // 2]) for c in choices)
    assert answer["usage"]["prompt_tokens"] == sum(len(tokenizer(p).input_ids) for p in prompts)


def test_top_logprobs_hold_the_sampled_token_when_it_is_not_among_them(server):
    """As OpenAI's: the ``logprobs`` likeliest tokens, and the one sampled after them when it is not one of them."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "logprobs": 1, "temperature": 1.5, "seed": 3,
            "ignore_eos": True}
    logprobs = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]
    pairs = list(zip(logprobs["tokens"], logprobs["top_logprobs"]))
    assert all(token in top and 1 <= len(top) <= 2 for token, top in pairs)
    assert any(len(top) == 2 for _, top in pairs)  # a draw outside the top 1 happened


def test_errors_have_openai_shape(server):
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", {**chat, "temperature": -1}), 400, "temperature", "temperature")
    too_long = [1] * server.generator.max_model_len
    assert_error(post(server, "/v1/completions", {"model": MODEL, "prompt": too_long}), 400, "prompt", "max_model_len")
    assert_error(post(server, "/v1/chat/completions", "{not json"), 400)
    assert_error(post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs",
                 "logprobs must")
    none_asked = post(server, "/v1/chat/completions", {**chat, "top_logprobs": 0})  # as vLLM: 0 without logprobs
    assert none_asked.status_code == 200 and none_asked.json()["choices"][0]["logprobs"] is None
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hi"}), 400, "messages")
    assert_error(post(server, "/v1/completions", {"model": MODEL}), 400, "prompt")
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert_error(post(server, "/v1/completions", {**completion, "seed": 2**63}), 400, words="seed")
    assert_error(post(server, "/v1/completions", {**completion, "logprobs": 10**7}), 400, words="logprobs")
    assert_error(post(server, "/v1/completions", {**completion, "n": 10**4}), 400, "n", "max_num_seqs")
    assert_error(post(server, "/v1/chat/completions", {**chat, "stop_token_ids": [10**6]}), 400, "stop_token_ids")
    assert_error(post(server, "/v1/chat/completions", chat, key=None), 401)["code"] == "invalid_api_key"
    assert_error(post(server, "/v1/chat/completions", chat, key="wrong"), 401)
    assert httpx.get(f"{server.base}/v1/models").status_code == 401
    error = assert_error(post(server, "/v1/chat/completions", {**chat, "model": "gpt-9"}), 404, "model", "gpt-9")
    assert error["code"] == "model_not_found"
    assert post(server, "/v1/chat/completions", {k: v for k, v in chat.items() if k != "model"}).status_code == 200
    wait_until_idle(server.generator)


def test_x_request_id_names_the_response_as_vllm(server):
    """A proxy's trace id comes back in the header and the response id; clients that reuse one do not collide."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "trace-123"}
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: httpx.post(f"{server.base}/v1/completions", json=body, headers=headers,
                                                  timeout=60), range(2)))
    for response in both:
        assert response.status_code == 200 and response.headers["x-request-id"] == "trace-123"
        assert response.json()["id"] == "cmpl-trace-123"
    with httpx.stream("POST", f"{server.base}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert response.headers["x-request-id"] == "trace-123" and {c["id"] for c in chunks} == {"chatcmpl-trace-123"}
    refused = httpx.post(f"{server.base}/v1/completions", json=body, headers={"X-Request-Id": "x" * 129}, timeout=10)
    assert refused.status_code == 401 and len(refused.headers["x-request-id"]) == 32  # too long: a new one
    assert httpx.get(f"{server.base}/health", timeout=10).headers["x-request-id"]


def test_client_disconnect_aborts_the_request(server):
    aborted_before = metric(server, "hf_paged:request_success_total", finished_reason="abort")
    first_tokens = metric(server, "hf_paged:time_to_first_token_seconds_count", model_name=MODEL)
    gaps = metric(server, "hf_paged:inter_token_latency_seconds_count", model_name=MODEL)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
        assert server.generator.stats().num_used_blocks > 0  # still generating when the client leaves
        # Observed as the tokens come, labelled as vLLM's (its dashboards select by model_name).
        assert metric(server, "hf_paged:time_to_first_token_seconds_count", model_name=MODEL) == first_tokens + 1
        assert metric(server, "hf_paged:inter_token_latency_seconds_count", model_name=MODEL) >= gaps + 1
    wait_until_idle(server.generator, timeout=15, engine=server.app.state.engine)
    assert metric(server, "hf_paged:request_success_total", finished_reason="abort") == aborted_before + 1


def test_prompt_logprobs_field_scores_the_prompt_as_vllm_answers(server, smollm2):
    """vLLM's ``prompt_logprobs``: per prompt token after the first, its logprob, rank and text and the k likeliest
    tokens', keyed by token id; in every choice of a completion, at the top of a chat response; not with streams."""
    model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():  # the server is idle between calls
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)[:-1]
    body = {"model": MODEL, "prompt": PROMPT, "prompt_logprobs": 2, "max_tokens": 2, "n": 2, "temperature": 0}
    answer = post(server, "/v1/completions", body).json()
    scored = answer["choices"][0]["prompt_logprobs"]
    assert answer["choices"][1]["prompt_logprobs"] == scored and answer["choices"][0]["logprobs"] is None
    assert scored[0] is None and len(scored) == len(ids)
    for position, (token, entries) in enumerate(zip(ids[1:], scored[1:])):
        row = logprobs[position]
        top = row.topk(2).indices.tolist()
        assert list(entries)[0] == str(token) and set(map(str, top)) <= set(entries) and len(entries) in (2, 3)
        own = entries[str(token)]
        assert abs(own["logprob"] - row[token].item()) < 1e-4
        assert own["rank"] == int((row > row[token]).sum()) + 1 and own["decoded_token"] == tokenizer.decode([token])
        assert [entries[str(t)]["rank"] for t in top if t != token] == [r for r, t in enumerate(top, 1) if t != token]
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "prompt_logprobs": 0,
                                                  "max_tokens": 1}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(entries) == 1 for entries in chat["prompt_logprobs"][1:])
    both = post(server, "/v1/completions", {**body, "n": 1, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert both["prompt_logprobs"] == scored  # the engine computed the larger of the two counts
    assert all(len(top) in (1, 2) for top in both["logprobs"]["top_logprobs"][1:])
    streamed = post(server, "/v1/completions", {**body, "stream": True, "prompt_logprobs": 0})
    assert streamed.status_code == 200 and "prompt_logprobs" not in streamed.text
    assert_error(post(server, "/v1/completions", {**body, "stream": True}), 400, "prompt_logprobs", "stream")
    assert_error(post(server, "/v1/completions", {**body, "prompt_logprobs": -1}), 400, "prompt_logprobs",
                 "at most 20 prompt_logprobs are allowed on this server (--max-logprobs), got -1 (the whole "
                 "vocabulary's, 49152)")
    assert_error(post(server, "/v1/completions", {**body, "prompt_logprobs": 21}), 400, "prompt_logprobs",
                 "--max-logprobs")
    assert_error(post(server, "/v1/completions", {**body, "logprobs": -1}), 400, "logprobs", "got -1 (the whole")
    assert_error(post(server, "/v1/completions", {**body, "logprobs": -2}), 400, "logprobs", "greater than")


def test_max_logprobs_minus_one_serves_the_whole_vocabularys_as_vllm(smollm2):
    """--max-logprobs -1 (vLLM's): a request's -1 asks for every token's log-probability, which are counted as
    such against --max-logprob-entries."""
    generator = ContinuousBatchGenerator(*smollm2, num_blocks=64)
    vocab = generator.inputs.vocab_size
    app = create_app(generator, MODEL, limits=ServerLimits(max_logprobs=-1, max_logprob_entries=3 * vocab))
    with live_server(app) as live:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        answer = httpx.post(f"{live.base}/v1/completions", json={**body, "logprobs": -1}, timeout=120)
        assert answer.status_code == 200, answer.text
        top = answer.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        assert len(top) >= vocab - 1000  # tokens that decode alike share one key, as in vLLM's answer
        chat = httpx.post(f"{live.base}/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}, timeout=120)
        assert chat.status_code == 200 and len(chat.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) \
            == vocab
        many = httpx.post(f"{live.base}/v1/completions", json={**body, "logprobs": -1, "max_tokens": 3}, timeout=60)
        assert many.status_code == 400 and "--max-logprob-entries" in many.text
        # A call that sets no max_tokens is not refused: the default gives way, so the answer stops at the bound.
        unset = httpx.post(f"{live.base}/v1/chat/completions", json={
            "model": MODEL, "messages": CHAT, "logprobs": True, "top_logprobs": -1, "ignore_eos": True}, timeout=120)
        assert unset.status_code == 200, unset.text
        choice = unset.json()["choices"][0]
        assert len(choice["logprobs"]["content"]) == 2 and choice["finish_reason"] == "length"  # 3 x vocab // (vocab + 1)


def test_non_streaming_client_disconnect_aborts_the_request(server):
    aborted_before = metric(server, "hf_paged:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=2)
    wait_until_idle(server.generator, timeout=15, engine=server.app.state.engine)
    assert metric(server, "hf_paged:request_success_total", finished_reason="abort") == aborted_before + 1


@pytest.mark.parametrize("extra", [
    {"functions": [{"name": "f"}]}, {"best_of": 3}, {"chat_template": "{{ messages }}"},
    {"generation_config": '{"max_new_tokens": 3}'},
], ids=lambda extra: next(iter(extra)))
def test_unsupported_fields_are_refused_by_name(server, extra):
    name = next(iter(extra))
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}
    assert_error(post(server, "/v1/chat/completions", chat), 400, name, "not supported")


@pytest.mark.parametrize("extra, ours", [
    ({"n_predict": 5}, "max_tokens"), ({"grammar": 'root ::= "yes"'}, "structured_outputs"),
    ({"repeat_penalty": 1.5}, "repetition_penalty"), ({"json_schema": {"type": "object"}}, "response_format"),
], ids=lambda value: next(iter(value)) if isinstance(value, dict) else "")
def test_other_servers_names_are_refused_with_the_name_to_use(server, extra, ours):
    name = next(iter(extra))
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **extra}
    assert_error(post(server, "/v1/chat/completions", chat), 400, name, f"use {ours}")


def test_llama_cpp_values_that_would_be_misread_are_refused(server):
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    token = str(server.generator.tokenizer(" Paris", add_special_tokens=False).input_ids[0])
    assert_error(post(server, "/v1/completions", {**completion, "logit_bias": {token: False}}), 400, "logit_bias")
    schema = {"type": "json_object", "schema": {"type": "object"}}  # llama.cpp's, which OpenAI's format lacks
    assert_error(post(server, "/v1/completions", {**completion, "response_format": schema}), 400, "response_format")


def test_unknown_fields_are_logged_as_ignored(server, caplog):
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "cache_prompt": True}
    with caplog.at_level("WARNING", logger="hf_paged.server.serving"):
        assert post(server, "/v1/completions", completion).status_code == 200
    assert "request fields ignored (not known to this server): ['cache_prompt']" in caplog.text


def test_harmless_and_unknown_fields_are_accepted(server):
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    assert_error(post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "echo": True}), 400,
                 "echo", "not supported")
    assert_error(post(server, "/v1/completions", {**completion, "stream_options": {"include_usage": True}}), 400,
                 "stream_options", "stream is true")
    harmless = {"response_format": {"type": "text"}, "tool_choice": "auto", "logit_bias": {}, "best_of": 1,
                "metadata": {"anything": "goes"}, "mirostat": 0, "typical_p": 1.0, "repeat_penalty": 1.0,
                "n_probs": 0, "grammar": ""}  # llama.cpp's fields at their "off"
    assert post(server, "/v1/completions", {**completion, **harmless}).status_code == 200
    assert_error(post(server, "/v1/completions", {**completion, "best_of": 1, "n": 2}), 400, "best_of", "at least n")


def test_logit_bias(server, client):
    token = server.generator.tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=3, logit_bias={token: 100})
    assert done.choices[0].text == " Paris" * 3
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for key in ("the", "1_0", " 7 "):
        assert_error(post(server, "/v1/completions", {**completion, "logit_bias": {key: 1}}), 400, "logit_bias")
    assert_error(post(server, "/v1/completions", {**completion, "logit_bias": {"10000000": 1}}), 400, "logit_bias")
    assert_error(post(server, "/v1/completions", {**completion, "logit_bias": {"42": 500}}), 400, "logit_bias")


def test_bad_words_and_allowed_token_ids_as_vllm(server, client):
    banned = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS,
                                       extra_body={"bad_words": server.bad_words}).choices[0].text
    assert banned == server.bad_words_ref.text != server.prompt_ref.text
    token = server.generator.tokenizer(" Rome", add_special_tokens=False).input_ids[0]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=1.0, max_tokens=3,
                                          extra_body={"allowed_token_ids": [token]})
    assert chat.choices[0].message.content == " Rome" * 3
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for value in ([], [10**7], ["1"], [True]):
        assert_error(post(server, "/v1/completions", {**completion, "allowed_token_ids": value}), 400,
                     "allowed_token_ids")
    assert_error(post(server, "/v1/completions", {**completion, "allowed_token_ids": [5] * 65537}), 400,
                 "allowed_token_ids", "at most 65536")
    for value in ([""], "Paris", ["x"] * 65, ["x" * 257], ["\ud800"]):
        assert_error(post(server, "/v1/completions", {**completion, "bad_words": value}), 400, "bad_words")
    assert post(server, "/v1/completions", {**completion, "bad_words": ["x"] * 64}).status_code == 200


def test_a_refused_prompt_list_leaves_nothing_queued(server):
    body = {"model": MODEL, "prompt": [PROMPT, "x " * (server.generator.max_model_len + 10)], "max_tokens": 2}
    assert_error(post(server, "/v1/completions", body), 400, "prompt", "max_model_len")
    wait_until_idle(server.generator, timeout=5)


def test_a_failing_step_fails_its_requests_but_not_the_server(server, client, monkeypatch):
    runner = server.generator.runner
    real_execute = runner.execute

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "execute", real_execute)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "execute", fail_once)
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
    assert "injected failure" not in assert_error(response, 500, words="engine failed")["message"]  # in the log only
    wait_until_idle(server.generator)
    assert metric(server, "hf_paged:engine_step_failures_total") == 1
    done = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=GREEDY_TOKENS)
    assert done.choices[0].text == server.prompt_ref.text


def test_a_request_failed_mid_decode_is_counted_once_as_an_error(server, monkeypatch):
    runner, metrics = server.generator.runner, server.app.state.metrics
    real_execute, calls = runner.execute, []

    def fail_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", fail_third)
    errors = metric(server, "hf_paged:request_success_total", finished_reason="error")
    aborts = metric(server, "hf_paged:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert "engine failed" in response.read().decode()
    wait_until_idle(server.generator, engine=server.app.state.engine)
    assert metric(server, "hf_paged:request_success_total", finished_reason="error") == errors + 1
    assert metric(server, "hf_paged:request_success_total", finished_reason="abort") == aborts  # its abort is that
    assert not metrics._samples and not metrics._last_token_time and not metrics._failed  # nothing kept


def test_cli_rejects_a_bad_model_and_size_cleanly(capsys):
    from argparse import ArgumentTypeError

    from hf_paged.cli import build_parser, main, parse_memory
    from hf_paged.generation.config import parse_token_count

    assert parse_memory("2GiB") == 2 << 30 and parse_memory("512MB") == 512 * 10**6 and parse_memory("4096") == 4096
    assert [parse_token_count(text) for text in ("4096", "4k", "4K", "25.6k", "1M")] == [4096, 4000, 4096, 25600,
                                                                                         1 << 20]
    for text in ("4.5K", "4kb", "-1", "k"):
        with pytest.raises(ArgumentTypeError, match="not a token count"):
            parse_token_count(text)
    args = build_parser().parse_args(["serve", "--max-model-len", "2k", "--max-num-batched-tokens", "1K"])
    assert (args.max_model_len, args.max_num_batched_tokens) == (2000, 1024)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model"])
    assert exit_info.value.code == 2
    assert "unknown model '/no/such/model'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--kv-cache-memory", "lots"])
    assert exit_info.value.code == 2 and "is not a size" in capsys.readouterr().err
    for argv, flag in ((["generate", "hi", "--max-tokens", "0"], "--max-tokens"), (["chat", "--top-p", "2"], "--top-p"),
                       (["generate", "hi", "--temperature", "-1"], "--temperature")):  # named as typed
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and f"error: {flag}: " in capsys.readouterr().err


def test_python_dash_m_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "hf_paged", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "serve" in done.stdout


def test_cli_serve_without_the_server_extra_names_it(monkeypatch, capsys):
    from hf_paged.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"])
    assert exit_info.value.code == 2 and "pip install 'hf-paged[server]'" in capsys.readouterr().err


def test_a_hub_id_names_its_copy_in_the_local_cache(smollm2_path, tmp_path, monkeypatch):
    """As vLLM and transformers serve take them, but never downloaded: only a copy already cached is used."""
    import huggingface_hub.constants

    from hf_paged.default_model import resolve_model

    repo = tmp_path / "models--acme--tiny-chat"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (snapshot / name).symlink_to(Path(smollm2_path) / name)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model("acme/tiny-chat") == str(snapshot)
    with pytest.raises(ValueError, match="a hub id already in the local Hugging Face cache"):
        resolve_model("acme/not-cached")
    # vLLM's --revision (a tag, or a commit) and --download-dir (another cache).
    tagged = repo / "snapshots" / ("1" * 40)
    shutil.copytree(snapshot, tagged, symlinks=True)
    (repo / "refs" / "v1").write_text("1" * 40)
    assert resolve_model("acme/tiny-chat", revision="v1") == str(tagged)
    assert resolve_model("acme/tiny-chat", revision="1" * 40) == str(tagged)
    other = tmp_path / "other"
    shutil.copytree(repo, other / repo.name, symlinks=True)
    assert resolve_model("acme/tiny-chat", cache_dir=other) == str(other / repo.name / "snapshots" / ("0" * 40))
    for options, words in (({"revision": "v2"}, "'acme/tiny-chat' \\(at revision v2 in the cache it is usually in\\)"),
                           ({"cache_dir": tmp_path / "none"}, "at revision main in the cache")):
        with pytest.raises(ValueError, match=words):
            resolve_model("acme/tiny-chat", **options)
    assert resolve_model(smollm2_path, revision="v1", cache_dir=other) == smollm2_path  # local: ignored, as vLLM


def test_serve_names_a_port_in_use_before_loading_the_model(smollm2_path, monkeypatch, capsys):
    import socket

    from hf_paged.cli import main

    def loads(*args, **kwargs):
        raise AssertionError("the model was loaded, or converted from a GGUF file, before the port was taken")

    monkeypatch.setattr("hf_paged.loading.load_model", loads)
    monkeypatch.setattr("hf_paged.default_model.resolve_model", loads)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", smollm2_path, "--port", str(port)])
    assert exit_info.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    # Two servers started at once: the second is refused too (a bound socket that did not listen yet let it bind).
    from hf_paged.cli import _listening_socket, build_parser

    parser = build_parser()
    with _listening_socket(parser, "127.0.0.1", 0) as first:
        with pytest.raises(SystemExit):
            _listening_socket(parser, "127.0.0.1", first.getsockname()[1])
    assert "cannot listen on" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # as every option that needs no model: named before it loads
        main(["serve", smollm2_path, "--port", "0", "--allowed-origins", '["https://a.example"'])
    assert "--allowed-origins: not a JSON list" in capsys.readouterr().err


def test_cli_takes_vllms_serve_flags_whose_ask_is_always_so_here(smollm2_path, capsys):
    from hf_paged.cli import build_parser, main

    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--enable-prefix-caching",
             "--disable-log-requests", "--pipeline-parallel-size", "1", "-dp", "1", "--tokenizer-mode", "auto",
             "--load-format", "safetensors", "--max-seq-len-to-capture", "8192", "--distributed-executor-backend", "mp",
             "--runner", "pooling", "--task", "embed", "--convert", "embed"]
    args = build_parser().parse_args(["serve", *flags])
    assert args.enable_prefix_caching
    for parser_name in ("llama3_json", "mistral", "pythonic", "llama4_pythonic", "qwen3_coder", "qwen3_xml"):
        assert build_parser().parse_args(["serve", "--tool-call-parser", parser_name]).tool_call_parser == parser_name
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--tool-call-parser", "granite"])
    assert exit_info.value.code == 2 and "invalid choice: 'granite'" in capsys.readouterr().err
    for flags, words in ((["--tokenizer-mode", "mistral"], "invalid choice: 'mistral'"),
                         (["--load-format", "gguf"], "invalid choice: 'gguf'"),
                         (["--distributed-executor-backend", "ray"], "replicas on Ray are served by"),
                         (["--distributed-executor-backend", "external_launcher"], "run this under torchrun"),
                         (["--override-generation-config", '{"temprature": 0.5}'], "sets 'temprature': it takes"),
                         (["--override-generation-config", '{"temperature": -1}'],
                          "--override-generation-config: temperature must be >= 0"),
                         (["--override-generation-config", "[1]"], "a JSON object"),
                         (["--response-role", ""], "--response-role: response_role must not be empty"),
                         (["--generation-config", "/no/such/folder"],
                          "--generation-config: generation_config is 'auto', 'vllm' or a folder"),
                         (["--max-log-len", "-1"], "--max-log-len: max_log_len must be at least 0"),
                         (["--pooler-config", '{"pooling_type": "MAX"}'], "--pooler-config: pooling_type is one of"),
                         (["--pooler-config", '{"normalise": true}'], "keys are pooling_type and normalize"),
                         (["--pooler-config", "7"], "--pooler-config: not a JSON object"),
                         (["-pp", "2"], "pipeline parallelism is not served"),
                         (["--data-parallel-size", "2"], "serve-ray --num-replicas"),
                         (["--quantization", "awq"], "is not quantized; a checkpoint's own quantization")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", smollm2_path, "--port", "0", *flags])
        assert exit_info.value.code == 2 and words in capsys.readouterr().err, flags
    for command in ("serve", "serve-ray"):
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--enable-prefix-caching", "--no-prefix-caching"])
        assert exit_info.value.code == 2 and "contradict each other" in capsys.readouterr().err


def test_cli_turns_any_load_failure_into_a_message(smollm2_path, tmp_path, capsys):
    """A model the engine refuses (here a hybrid one) or broken weights: a message and exit code 2, no traceback."""
    import shutil

    from transformers import AutoModelForCausalLM, Lfm2Config

    from hf_paged.cli import main

    config = Lfm2Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2, num_hidden_layers=2, layer_types=["conv", "full_attention"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "hybrid")
    broken = tmp_path / "broken"
    shutil.copytree(smollm2_path, broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)
    for name, words in (("hybrid", "cannot serve"), ("broken", "cannot load")):
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f"{smollm2_path}/{file}", tmp_path / name / file)
        with pytest.raises(SystemExit) as exit_info:
            main(["generate", str(tmp_path / name), "hi", "--max-tokens", "2"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and f"{words} {tmp_path / name}" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_info:  # a bare MemoryError (an empty message) before
        main(["generate", smollm2_path, "hi", "--num-blocks", str(10**12)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "num_blocks asks for a 6.87e+08 GiB KV cache, more than this machine" in err


def test_vllms_usual_serve_options_are_taken(capsys):
    """A vLLM command line runs as it is: its dtype names, gpu_memory_utilization (on GPU), and its flags for what is
    always so here."""
    from hf_paged.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "m", "--dtype", "half", "--gpu-memory-utilization", "0.85", "--enable-chunked-prefill",
         "--disable-log-stats", "--disable-frontend-multiprocessing", "--swap-space", "4", "--tokenizer", "t"])
    assert args.dtype == "half" and args.tokenizer == "t"
    from hf_paged.generation import EngineConfig

    assert EngineConfig.from_cli_args(args).gpu_memory_utilization == 0.85
    from hf_paged.loading import _dtype

    assert (_dtype("half"), _dtype("float")) == (torch.float16, torch.float32)


def test_cli_generate_with_engine_options(capsys):
    import torch

    from hf_paged.cli import build_parser, main

    threads = torch.get_num_threads()
    try:
        main(["generate", "What is the capital of France?", "--max-tokens", "10", "--temperature", "0",
              "--kv-cache-dtype", "bfloat16", "--no-prepack-weights", "--num-blocks", "64", "-t", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert "Paris" in capsys.readouterr().out
    # llama.cpp's -t is the threads (argparse took it for -tp); no option is abbreviated.
    assert build_parser().parse_args(["generate", "hi", "-t", "2"]).tensor_parallel_size is None
    for abbreviated in (["serve", "--max-num-s", "3"], ["serve-ray", "--num-rep", "2"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(abbreviated)
    assert "unrecognized arguments: --max-num-s\n" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--kv-cache-dtype", "int8"])
    assert exit_info.value.code == 2 and "--kv-cache-dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a model directory alone: its path is no prompt
        main(["generate", str(Path(__file__).parent)])
    assert exit_info.value.code == 2 and "a prompt is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # named before the target loads, not as the target's failure
        main(["generate", "hi", "--speculative-config", '{"model": "/no/such/draft"}'])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "speculative_config.model: cannot load /no/such/draft" in err


def test_cli_chat_template_as_vllms(tmp_path, capsys):
    from hf_paged.cli import main

    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0]['content'] }} is")
    greedy = ["--max-tokens", "6", "--temperature", "0", "--num-blocks", "64"]
    main(["generate", "The capital of France", "--chat-template", str(template), *greedy])
    templated = capsys.readouterr().out
    main(["generate", "The capital of France is", "--no-chat", *greedy])
    assert templated == capsys.readouterr().out and "Paris" in templated
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--chat-template", "no-such-file.jinja"])
    assert exit_info.value.code == 2 and "neither a file nor a Jinja template" in capsys.readouterr().err


def test_cli_generate_interrupted_ends_without_a_traceback(smollm2_path):
    command = [sys.executable, "-m", "hf_paged.cli", "generate", smollm2_path, "Tell a long story.", "--max-tokens",
               "2000", "--temperature", "0", "--no-chat"]
    # Started from a shell's background job, this process ignores SIGINT and so would the child: Python then keeps
    # it ignored instead of raising KeyboardInterrupt.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.stdout.read(5)  # it is generating
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and b"Traceback" not in stderr, stderr.decode()[-2000:]


def test_cli_generate_into_a_reader_that_leaves_early_ends_quietly(smollm2_path):
    """`hf-paged generate ... | head -c 5`: no BrokenPipeError traceback, exit code 0."""
    command = [sys.executable, "-m", "hf_paged.cli", "generate", smollm2_path, "Tell a long story.", "--max-tokens",
               "200", "--temperature", "0"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout.read(5)
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0 and b"Traceback" not in stderr, stderr[-2000:]


def test_cli_serves_https_under_a_root_path_as_vllm(smollm2_path, tmp_path, capsys):
    """vLLM's --ssl-keyfile / --ssl-certfile, --root-path and --disable-uvicorn-access-log; the API key is asked for
    under the root path too (the ASGI server puts the root path before the path the key check read)."""
    from hf_paged.cli import main

    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    trusted = ssl.create_default_context(cafile=str(cert))
    with pytest.raises(SystemExit):
        main(["serve", smollm2_path, "--ssl-keyfile", str(key)])
    assert "--ssl-keyfile and --ssl-certfile go together" in capsys.readouterr().err
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "hf_paged.cli", "serve", smollm2_path, "--port", str(port), "--num-blocks", "64",
               "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/api",
               "--disable-uvicorn-access-log", "--api-key", "k3y"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                health = httpx.get(f"{base}/health", verify=trusted, timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert health.status_code == 200
        refused = httpx.post(f"{base}/v1/completions", verify=trusted, timeout=60, json={"prompt": PROMPT})
        assert refused.status_code == 401, refused.text
        answer = httpx.post(f"{base}/v1/completions", verify=trusted, timeout=60,
                            headers={"Authorization": "Bearer k3y"}, json={"prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"]
        assert "/api/openapi.json" in httpx.get(f"{base}/docs", verify=trusted, timeout=10).text
    finally:
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0 and b'"POST /v1/completions' not in stderr and b"https://" in stderr


def test_cli_server_stops_promptly_with_a_stream_in_flight(smollm2_path):
    """Ctrl+C ends what is in flight after --shutdown-timeout instead of waiting for it to finish: a stream with an
    error event and [DONE], a plain call with a 503 in OpenAI's shape (uvicorn's cut-off gave a broken stream and a
    plain-text 500)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    command = [sys.executable, "-m", "hf_paged.cli", "serve", smollm2_path, "--port", str(port), "--num-blocks", "256",
               "--shutdown-timeout", "1", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(base, timeout=120, process=process)
        body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, f"{base}/v1/completions", json=body, timeout=60)
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
                lines, events = response.iter_lines(), []
                for line in lines:
                    events += [line] if line.startswith("data: ") else []
                    if len(events) == 3:
                        break
                deadline = time.monotonic() + 60  # the plain call too is in flight when Ctrl+C comes
                while metric(SimpleNamespace(base=base), "hf_paged:num_requests_running") < 2:
                    assert time.monotonic() < deadline and not plain.done(), "the plain call never started"
                    time.sleep(0.05)
                process.send_signal(signal.SIGINT)
                stopped = time.monotonic()
                events += [line for line in lines if line.startswith("data: ")]
            assert plain.result().status_code == 503
            assert plain.result().json()["error"]["message"] == "the server is shutting down"
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 503
        assert process.wait(timeout=30) == 0 and time.monotonic() - stopped < 15
        assert b"Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        process.stderr.close()


def test_no_cors_headers_when_no_origin_is_allowed(smollm2):
    from starlette.testclient import TestClient

    model, tokenizer = smollm2
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL, allowed_origins=())
    with TestClient(app) as test_client:
        preflight = test_client.options("/v1/models", headers={"Origin": "http://evil.example",
                                                               "Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in preflight.headers
        answer = test_client.get("/v1/models", headers={"Origin": "http://evil.example"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_chat_template_options_as_vllm(server):
    """add_generation_prompt, continue_final_message (an answer prefilled) and their misuse, as vLLM takes them."""
    tokenizer = server.generator.tokenizer
    question = [{"role": "user", "content": "Where is Paris?"}]
    prefilled = question + [{"role": "assistant", "content": "Paris is the capital of"}]
    chat = {"model": MODEL, "temperature": 0, "max_tokens": 8}

    def prompt_ids(messages, **options):
        return tokenizer(tokenizer.apply_chat_template(messages, tokenize=False, **options),
                         add_special_tokens=False).input_ids

    bare = post(server, "/v1/chat/completions", {**chat, "messages": question, "add_generation_prompt": False})
    assert bare.json()["usage"]["prompt_tokens"] == len(prompt_ids(question, add_generation_prompt=False))
    assert len(prompt_ids(question, add_generation_prompt=False)) < len(prompt_ids(question, add_generation_prompt=True))
    continued = post(server, "/v1/chat/completions", {**chat, "messages": prefilled, "continue_final_message": True,
                                                      "add_generation_prompt": False})
    ids = prompt_ids(prefilled, continue_final_message=True)
    assert ids[-1] != prompt_ids(prefilled)[-1]  # the last message is left open
    expected = post(server, "/v1/completions", {**chat, "prompt": ids}).json()["choices"][0]["text"]
    assert continued.json()["choices"][0]["message"]["content"] == expected
    assert continued.json()["usage"]["prompt_tokens"] == len(ids)
    both = post(server, "/v1/chat/completions", {**chat, "messages": prefilled, "continue_final_message": True})
    assert_error(both, 400, "continue_final_message", "add_generation_prompt")
    reserved = post(server, "/v1/chat/completions", {**chat, "messages": question,
                                                     "chat_template_kwargs": {"tokenize": True}})
    assert_error(reserved, 400, "chat_template_kwargs", "tokenize")


def test_chat_template_kwargs_are_the_templates_variables(smollm2):
    import copy

    from starlette.testclient import TestClient

    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = ("{% if persona %}{{ persona }}\n{% endif %}{% if reasoning_effort %}Reasoning: "
                               "{{ reasoning_effort }}\n{% endif %}{% for m in messages %}{{ m['role'] }}: "
                               "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL)
    messages = [{"role": "user", "content": "Hi"}]
    with TestClient(app) as test_client:
        for fields, text in [({}, "user: Hi\nassistant:"),
                             ({"chat_template_kwargs": {"persona": "You are a pirate."}},
                              "You are a pirate.\nuser: Hi\nassistant:"),
                             ({"reasoning_effort": "low"}, "Reasoning: low\nuser: Hi\nassistant:"),  # vLLM's way
                             ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                              "Reasoning: high\nuser: Hi\nassistant:")]:
            answer = test_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **fields})
            assert answer.status_code == 200, answer.text
            expected = len(tokenizer(text, add_special_tokens=False).input_ids)
            assert answer.json()["usage"]["prompt_tokens"] == expected
        response = test_client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 1,
                                                           "reasoning": {"effort": "medium"}})
        expected = len(tokenizer("Reasoning: medium\nuser: Hi\nassistant:", add_special_tokens=False).input_ids)
        assert response.json()["usage"]["input_tokens"] == expected
        refused = test_client.post("/v1/chat/completions", json={"messages": messages, "reasoning_effort": "max"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
        assert "reasoning_effort is one of none, minimal, low, medium, high, xhigh" in refused.text


def test_the_models_generation_config_fills_what_a_request_leaves_out(smollm2, tmp_path):
    """As vLLM's --generation-config auto: a model that recommends top_k=1 and 5 new tokens answers greedily and
    briefly unless the request says otherwise; "vllm" keeps OpenAI's defaults; a folder: its generation config's;
    --override-generation-config sets its own over either."""
    from starlette.testclient import TestClient
    from transformers import GenerationConfig

    from hf_paged.server.options import ServingOptions

    model, tokenizer = smollm2
    own = model.generation_config
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=1, max_new_tokens=5)
    GenerationConfig(do_sample=True, top_k=1, max_new_tokens=4).save_pretrained(tmp_path)
    options = {"auto": ServingOptions(), "vllm": ServingOptions("vllm"),
               "auto+": ServingOptions(override_generation_config={"max_new_tokens": 7}),
               "vllm+": ServingOptions("vllm", {"max_new_tokens": 3, "top_k": 1}),
               "folder": ServingOptions(str(tmp_path))}
    try:
        apps = {mode: create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=64), MODEL, options=option)
                for mode, option in options.items()}
    finally:
        model.generation_config = own
    body = {"prompt": "Once upon a time", "ignore_eos": True, "seed": 0}
    with TestClient(apps["auto+"]) as auto, TestClient(apps["vllm+"]) as plain:
        assert auto.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 7
        # As vLLM's: max_new_tokens bounds every request, not only those that leave max_tokens out.
        assert auto.post("/v1/completions", json={**body, "max_tokens": 12}).json()["usage"]["completion_tokens"] == 7
        chat = auto.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True, "max_tokens": 30}).json()
        assert chat["usage"]["completion_tokens"] == 7
        texts = {auto.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]["text"]
                 for seed in range(3)}
        assert len(texts) == 1  # top_k=1 still comes from the model's config
        answers = [plain.post("/v1/completions", json={**body, "seed": seed}).json() for seed in range(3)]
        assert {a["usage"]["completion_tokens"] for a in answers} == {3} and len({a["choices"][0]["text"]
                                                                                 for a in answers}) == 1
    with TestClient(apps["auto"]) as auto, TestClient(apps["vllm"]) as plain:
        texts = {auto.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]["text"]
                 for seed in range(3)}
        greedy = auto.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
        assert texts == {greedy}
        assert auto.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 5
        longer = auto.post("/v1/completions", json={**body, "max_tokens": 8, "temperature": 1.0, "top_k": 0})
        assert longer.json()["usage"]["completion_tokens"] == 5  # the model's max_new_tokens bounds it
        chat = auto.post("/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True})
        assert chat.json()["usage"]["completion_tokens"] == 5
        assert plain.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16
        sampled = {plain.post("/v1/completions", json={**body, "seed": seed}).json()["choices"][0]["text"]
                   for seed in range(3)}
        assert len(sampled) > 1
    with TestClient(apps["folder"]) as folder:
        answers = [folder.post("/v1/completions", json={**body, "seed": seed}).json() for seed in range(3)]
        assert {a["usage"]["completion_tokens"] for a in answers} == {4} and len({a["choices"][0]["text"]
                                                                                 for a in answers}) == 1


def test_echo_with_logprobs_scores_the_prompt(server, smollm2):
    """What evaluation harnesses send for log-likelihoods: echo, logprobs=1, one new token."""
    model, tokenizer = smollm2
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():  # the server is idle between calls
        expected = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)[torch.arange(len(ids) - 1), ids[1:]]
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    answer = post(server, "/v1/completions", body).json()
    choice, usage = answer["choices"][0], answer["usage"]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == usage["prompt_tokens"] + 1 == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert torch.allclose(torch.tensor(logprobs["token_logprobs"][1:len(ids)]), expected, atol=1e-4)
    assert logprobs["text_offset"][0] == 0 and "".join(logprobs["tokens"][:len(ids)]) == PROMPT
    assert all(1 <= len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    streamed = post(server, "/v1/completions", {**body, "stream": True, "n": 2, "max_tokens": 3})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    for index in (0, 1):
        pieces = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == index]
        assert pieces[0]["text"].startswith(PROMPT) and pieces[0]["logprobs"]["token_logprobs"][0] is None
        tokens = [t for piece in pieces for t in piece["logprobs"]["tokens"]]
        assert len(tokens) == len(ids) + 3 and "".join(p["text"] for p in pieces).startswith(PROMPT)
    alone = post(server, "/v1/completions", {**body, "max_tokens": 0}).json()  # the prompt alone: scoring only
    assert alone["choices"][0]["text"] == PROMPT and alone["usage"]["completion_tokens"] == 0
    streamed = post(server, "/v1/completions", {**body, "max_tokens": 0, "stream": True,
                                                "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 0 and events[-1]["usage"]["prompt_tokens"] == len(ids)
    assert len(alone["choices"][0]["logprobs"]["tokens"]) == len(ids)
    assert alone["choices"][0]["logprobs"]["token_logprobs"][1:] == logprobs["token_logprobs"][1:len(ids)]
    assert_error(post(server, "/v1/completions", {**body, "prompt": [1, -5]}), 400, "prompt", "vocabulary")
    for prompt in (PROMPT, ids):  # a token-id prompt echoes its text
        plain = post(server, "/v1/completions", {**body, "logprobs": None, "prompt": prompt}).json()["choices"][0]
        assert plain["text"].startswith(PROMPT) and plain["logprobs"] is None


def test_vllms_quantization_flag_checks_the_checkpoints_method(tmp_path, capsys):
    import argparse

    from transformers import LlamaConfig

    from hf_paged.cli import _check_quantization

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    config.quantization_config = {"quant_method": "gptq", "bits": 4}
    config.save_pretrained(tmp_path)
    parser = argparse.ArgumentParser()
    for asked in ("gptq", "gptq_marlin", None):
        _check_quantization(parser, str(tmp_path), asked)
    with pytest.raises(SystemExit):
        _check_quantization(parser, str(tmp_path), "awq")
    assert f"--quantization awq: {tmp_path} is quantized with gptq" in capsys.readouterr().err
    config.quantization_config = {"quant_method": "GPTQ", "bits": 4}  # as some exporters spell it
    config.save_pretrained(tmp_path)
    _check_quantization(parser, str(tmp_path), "gptq")
    (tmp_path / "config.json").write_text("{not json")  # Transformers names that when it loads; no traceback here
    with pytest.raises(SystemExit):
        _check_quantization(parser, str(tmp_path), "gptq")
    assert "is not quantized" in capsys.readouterr().err


def test_vllms_answer_options_role_token_ids_request_logs_and_content_parts(smollm2, caplog):
    """--response-role (a reply continuing the last message keeps its role), --return-tokens-as-token-ids (each
    request may say otherwise), --enable-log-requests with --max-log-len, --metrics-prefix vllm, and a template that
    loops over content parts getting OpenAI's list of them (--chat-template-content-format auto)."""
    import logging

    from starlette.testclient import TestClient

    from hf_paged.server.options import ServingOptions

    model, tokenizer = smollm2
    options = ServingOptions(response_role="model", return_tokens_as_token_ids=True, log_requests=True, max_log_len=6,
                             metrics_prefix="vllm")
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=64), MODEL, options=options)
    greedy = {"max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    with TestClient(app) as client, caplog.at_level(logging.INFO, logger="hf_paged.server.serving"):
        chat = client.post("/v1/chat/completions", json={"messages": CHAT, **greedy}).json()["choices"][0]
        assert chat["message"]["role"] == "model"
        ids = [int(entry["token"].removeprefix("token_id:")) for entry in chat["logprobs"]["content"]]
        assert tokenizer.decode(ids) == chat["message"]["content"]
        entries = chat["logprobs"]["content"]
        assert all(top["token"].startswith("token_id:") for entry in entries for top in entry["top_logprobs"])
        assert bytes(chat["logprobs"]["content"][0]["bytes"]) == tokenizer.decode(ids[:1]).encode()  # the text's
        as_text = client.post("/v1/chat/completions", json={"messages": CHAT, **greedy,
                                                             "return_tokens_as_token_ids": False}).json()
        assert "".join(e["token"] for e in as_text["choices"][0]["logprobs"]["content"]) == chat["message"]["content"]
        continued = client.post("/v1/chat/completions", json={
            "messages": CHAT + [{"role": "assistant", "content": "The"}], "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 2, "stream": True})
        assert '"role":"assistant"' in continued.text.replace(" ", "")
        answered = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                        "logprobs": 1}).json()
        completion = answered["choices"][0]
        tokens = completion["logprobs"]["tokens"]
        assert tokenizer.decode([int(t.removeprefix("token_id:")) for t in tokens]) == completion["text"]
        assert completion["logprobs"]["text_offset"][1] == len(tokenizer.decode([int(tokens[0][9:])]))
        scraped = client.get("/metrics").text
        assert f'vllm:request_success_total{{finished_reason="length",model_name="{MODEL}"}} 4.0' in scraped
        assert "vllm:kv_cache_usage_perc" in scraped and "hf_paged:" not in scraped
    logged = [r.getMessage() for r in caplog.records if "queued" in r.getMessage()]
    assert len(logged) == 4 and f"prompt {PROMPT[:6]!r}" in logged[-1] and "temperature=0" in logged[-1]
    assert f"prompt_token_ids {tokenizer(PROMPT).input_ids[:6]}" in logged[-1]
    assert f"(answer {answered['id']})" in logged[-1]  # the log line found from the answer (or its X-Request-Id)

    parts = ("{% for m in messages %}{{ m['role'] }}:{% for part in m['content'] %}[{{ part['text'] }}]{% endfor %}\n"
             "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = parts
    for content_format, text in (("auto", "user:[Hi][there]assistant:"), ("string", None)):
        app = create_app(ContinuousBatchGenerator(model, templated, num_blocks=16), MODEL,
                         options=ServingOptions(chat_template_content_format=content_format))
        with TestClient(app) as client:
            message = {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}
            tokens = client.post("/tokenize", json={"messages": [message]}).json()["tokens"]
            if text is not None:
                assert tokens == templated(text, add_special_tokens=False).input_ids
            else:  # the template loops over the characters of one string (Jinja trims the newline after a tag)
                assert templated.decode(tokens) == "user:[][][][][][][][]assistant:"
                continue
            # Tools described in the system message and earlier calls written into content are parts too.
            call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            messages = [{"role": "system", "content": "Be terse."}, message,
                        {"role": "assistant", "content": None, "tool_calls": [call]}]
            tools = [{"type": "function", "function": {"name": "get_time"}}]
            tokens = client.post("/tokenize", json={"messages": messages, "tools": tools}).json()["tokens"]
            text = templated.decode(tokens)
            assert text.startswith("system:[Be terse.][\n\nYou can call these functions") and "'type'" not in text
            assert 'assistant:[<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>]assistant:' in text


def test_request_priority_as_vllms(smollm2):
    """vLLM's ``priority``: taken under ``--scheduling-policy priority`` (lower first), otherwise a 400 naming it."""
    from starlette.testclient import TestClient

    from hf_paged.cli import build_parser

    model, tokenizer = smollm2
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert args.scheduling_policy == "priority"
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0, "priority": -3}
    prioritized = ContinuousBatchGenerator(model, tokenizer, num_blocks=16, scheduling_policy="priority")
    with TestClient(create_app(prioritized, MODEL)) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "priority": 4}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        wrong = client.post("/v1/completions", json={**body, "priority": "high"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "priority"
    with TestClient(create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), MODEL)) as client:
        refused = client.post("/v1/completions", json=body).json()["error"]
        assert refused["param"] == "priority" and "needs the priority scheduling policy" in refused["message"]
        assert client.post("/v1/completions", json={**body, "priority": 0}).status_code == 200


def test_add_special_tokens_as_vllm(smollm2):
    """A completion's prompt gets the tokenizer's BOS, a chat's rendered template does not (it wrote its own), unless
    ``add_special_tokens`` says otherwise; /tokenize likewise."""
    from starlette.testclient import TestClient

    model, tokenizer = smollm2
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.add_bos_token = True
    bos = tokenizer.bos_token_id
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=32), MODEL)
    text = {"model": MODEL, "prompt": "Hi there", "max_tokens": 1, "return_token_ids": True}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 1, "return_token_ids": True}
    with TestClient(app) as test_client:
        prompt_ids = lambda url, body: test_client.post(url, json=body).json()  # noqa: E731
        plain = tokenizer("Hi there", add_special_tokens=False).input_ids
        assert prompt_ids("/v1/completions", text)["choices"][0]["prompt_token_ids"] == [bos, *plain]
        assert prompt_ids("/v1/completions", {**text, "add_special_tokens": False})["choices"][0][
            "prompt_token_ids"] == plain
        assert prompt_ids("/tokenize", {"prompt": "Hi there"})["tokens"] == [bos, *plain]
        assert prompt_ids("/tokenize", {"prompt": "Hi there", "add_special_tokens": False})["tokens"] == plain
        rendered = prompt_ids("/v1/chat/completions", chat)["prompt_token_ids"]
        assert rendered[0] == bos != rendered[1]  # the template's own <|im_start|> only
        assert prompt_ids("/v1/chat/completions", {**chat, "add_special_tokens": True})["prompt_token_ids"] == \
            [bos, *rendered]
        assert prompt_ids("/tokenize", {"messages": CHAT})["tokens"] == rendered
        refused = test_client.post("/v1/completions", json={**text, "guided_whitespace_pattern": " "})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "guided_whitespace_pattern"


def test_a_model_served_under_several_names_as_vllms(smollm2):
    from starlette.testclient import TestClient

    model, tokenizer = smollm2
    app = create_app(ContinuousBatchGenerator(model, tokenizer, num_blocks=16), ["main", "alias"])
    with TestClient(app) as test_client:
        assert [card["id"] for card in test_client.get("/v1/models").json()["data"]] == ["main", "alias"]
        for name, answered in (("alias", "alias"), ("main", "main"), (None, "main")):
            body = {"prompt": "Hi", "max_tokens": 1, **({"model": name} if name else {})}
            assert test_client.post("/v1/completions", json=body).json()["model"] == answered
        unknown = test_client.post("/v1/completions", json={"prompt": "Hi", "model": "other"})
        assert unknown.status_code == 404 and "serves 'main', 'alias'" in unknown.json()["error"]["message"]
        assert 'model_name="main"' in test_client.get("/metrics").text


def test_command_line_flags_as_vllms(capsys, monkeypatch):
    """--version; an inline --chat-template's escapes decoded; --disable-log-requests winning over
    --enable-log-requests; --cpu-bind checked in one process too."""
    from hf_paged.cli import _chat_template, build_parser, main, serving_options
    from hf_paged.distributed import CPU_BIND_ENV

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == __version__
    parser = build_parser()
    assert _chat_template(parser, "{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    assert _chat_template(parser, "{{ 'é' }}\\n") == "{{ 'é' }}\\n"  # not ASCII: taken as given
    args = parser.parse_args(["serve", "--served-model-name", "a", "b"])  # vLLM's several names, not a MODEL "b"
    assert (args.model, args.served_model_name) == (None, ["a", "b"])
    for flags, logged in (([], False), (["--enable-log-requests"], True),
                          (["--enable-log-requests", "--disable-log-requests"], False)):
        args = parser.parse_args(["serve", *flags])
        assert serving_options(args.command_parser, args).log_requests is logged
    monkeypatch.setenv(CPU_BIND_ENV, "")  # restored after: the flag sets it for the ranks
    with pytest.raises(SystemExit) as done:
        main(["generate", "no-such-model", "Hi", "--cpu-bind", "zzz"])
    assert done.value.code == 2 and "--cpu-bind: HF_PAGED_CPU_BIND: 'zzz' is not a list of cores" in \
        capsys.readouterr().err


def test_cli_options_from_a_config_file_as_vllms(tmp_path, capsys):
    """vLLM's --config: a YAML mapping of long option names (dashes or underscores) to values; what the command line
    gives wins; an unknown option or a file that is no mapping is an error naming it."""
    from hf_paged.cli import build_parser, main, with_config_file

    config = tmp_path / "config.yaml"
    config.write_text("model: /from/config\nmax_model_len: 2k\nserved-model-name: [a, b]\nno-prefix-caching: true\n"
                      "enforce-eager: false\nspeculative-config: {method: ngram, num_speculative_tokens: 3}\n"
                      "seed: 7\n")
    parser = build_parser()
    args = parser.parse_args(with_config_file(parser, ["serve", "--config", str(config)]))
    assert (args.model, args.max_model_len, args.served_model_name, args.enable_prefix_caching) == \
        ("/from/config", 2000, ["a", "b"], False)
    assert args.speculative_config.num_speculative_tokens == 3 and not args.enforce_eager and args.seed == 7
    argv = ["serve", "mine", "--seed", "1", f"--config={config}", "--served-model-name", "c"]
    args = parser.parse_args(with_config_file(parser, argv))
    assert (args.model, args.seed, args.served_model_name, args.max_model_len) == ("mine", 1, ["c"], 2000)
    config.write_text("model: /from/config\nmax_tokens: 5\nchat: false\nthreads: 2\n")
    args = parser.parse_args(with_config_file(parser, ["generate", "Hi", "-t4", "--config", str(config)]))
    assert (args.model, args.prompt, args.max_tokens, args.chat, args.threads) == ("/from/config", "Hi", 5, False, 4)
    config.write_text("api-key: [k1, k2]\nmodel: /m\nserved-model-name: []\n")  # an option given once per value
    args = parser.parse_args(with_config_file(parser, ["serve", "--config", str(config)]))
    assert (args.model, args.api_key, args.served_model_name) == ("/m", ["k1", "k2"], None)
    for text, words in (("port: 8000\n", "'port' is no option of hf-paged generate"),
                        ("- a\n", "must hold a mapping"), ("a: [\n", "--config"),
                        ("trust-remote-code: 0\n", "trust-remote-code is true or false, got 0")):
        config.write_text(text)
        with pytest.raises(SystemExit) as done:
            main(["generate", "Hi", "--config", str(config)])
        assert done.value.code == 2 and words in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["generate", "Hi", "--config", str(config), "--config=other.yaml"])
    assert done.value.code == 2 and "--config: given more than once" in capsys.readouterr().err


def test_cli_serve_on_port_0_says_the_port_it_got(smollm2_path, tmp_path):
    import re

    config = tmp_path / "serve.yaml"  # vLLM's --config, the whole way through
    config.write_text(f"model: {json.dumps(smollm2_path)}\nport: 0\nnum-blocks: 16\n")
    command = [sys.executable, "-m", "hf_paged.cli", "serve", "--config", str(config)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, said = time.monotonic() + 120, None
        while said is None and time.monotonic() < deadline:
            line = process.stderr.readline()
            assert line or process.poll() is None, "the server ended"
            said = re.search(r"serving .* on http://127\.0\.0\.1:(\d+)/v1", line)
        port = int(said.group(1))
        assert port != 0 and httpx.get(f"http://127.0.0.1:{port}/health", timeout=30).status_code == 200
    finally:
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
