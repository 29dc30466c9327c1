"""The server on an open network: one call can neither stall nor exhaust the others, nor learn its internals.

Each test here failed before the server was hardened (issue 16): huge prompts froze ``/health``, the API key and the
body size were checked only after the whole body was parsed, parameters were unbounded, nothing answered 503, a
``BaseException`` in a step left handlers hanging, a failing metrics update lost a step's outputs, errors carried
``repr(exc)``, and the native kernel was loaded from any path with any owner.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import stat
import threading
import time

import httpx
import pytest
from live_server import MODEL, assert_openai_error, live_server, tiny_generator, wait_until_idle

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from hf_paged.default_model import default_model_path  # noqa: E402
from hf_paged.server import ServerLimits, create_app  # noqa: E402
from hf_paged.server.protocol import APIError  # noqa: E402

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(smollm2_path):
    generator = tiny_generator(smollm2_path, max_num_seqs=8, max_model_len=1024)
    limits = ServerLimits(max_num_waiting=4, max_concurrent_requests=6)
    with live_server(create_app(generator, MODEL, api_key=KEY, limits=limits)) as live:
        live.generator = generator
        yield live


def post(live, path: str, body, key: str | None = KEY, timeout: float = 30) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{live.base}{path}", json=body, headers=headers, timeout=timeout)


def health_latencies(base: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            assert client.get(f"{base}/health").status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(0.01)


class HealthWatch:
    """Measures ``/health`` from another thread while the body of the ``with`` runs."""

    def __init__(self, base: str):
        self.latencies: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=health_latencies, args=(base, self.stop, self.latencies))

    def __enter__(self) -> "HealthWatch":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


# ------------------------------------------------------------------------------------- 1: prompts off the loop
def test_huge_prompts_do_not_freeze_health_or_streams(served):
    """The issue's repro (20 prompts of 4 MB) is refused from its size; one 4 MB prompt from its characters.
    (Before, both were tokenized on the event loop: /health and every stream froze for tens of seconds.)"""
    repro = json.dumps({"prompt": ["a " * 2000000] * 20, "max_tokens": 1}).encode()  # encoded before timing
    one = json.dumps({"prompt": "a " * 2000000, "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", **AUTH}
    stream_body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 300, "ignore_eos": True,
                   "temperature": 0, "stream": True}
    with HealthWatch(served.base) as watch, httpx.stream("POST", f"{served.base}/v1/completions", json=stream_body,
                                                          headers=AUTH, timeout=30) as stream:
        start = time.perf_counter()
        assert_openai_error(httpx.post(f"{served.base}/v1/completions", content=repro, headers=headers), 413)
        refused = httpx.post(f"{served.base}/v1/completions", content=one, headers=headers)
        assert "characters" in assert_openai_error(refused, 400, "prompt")["message"]
        assert time.perf_counter() - start < 5
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 10
    assert watch.latencies and max(watch.latencies) < 1.0, max(watch.latencies)  # loose: CI machines are shared
    wait_until_idle(served.generator)


def test_many_messages_and_long_earlier_tool_calls_are_refused_from_their_characters(served):
    """Each message counts a token's characters for its template, and a prompt holding tools or earlier tool calls
    is checked before it is rendered (both were tokenized whole before they were refused)."""
    empty = [{"role": "user", "content": ""}] * 2000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps({"x": "y " * 20000})}}
    with_calls = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    for messages in (empty, with_calls):
        refused = post(served, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1})
        assert "characters" in assert_openai_error(refused, 400, "messages")["message"]


def test_tokenization_runs_off_the_event_loop(smollm2_path):
    """A prompt that takes a second to tokenize (the character pre-check loosened) leaves /health answering."""
    generator = tiny_generator(smollm2_path, max_model_len=1024)
    limits = ServerLimits(max_chars_per_token=10**4, max_body_bytes=64 << 20)
    with live_server(create_app(generator, MODEL, limits=limits)) as live, HealthWatch(live.base) as watch:
        time.sleep(0.1)
        start = time.perf_counter()
        response = post(live, "/v1/completions", {"prompt": "hello world " * 400_000, "max_tokens": 1}, key=None)
        took = time.perf_counter() - start
        time.sleep(0.1)
    assert "tokens long" in assert_openai_error(response, 400, "prompt")["message"]
    assert took > 0.3  # it really did tokenize for a while ...
    assert max(watch.latencies) < took / 2  # ... while /health kept answering


def test_a_repeated_invalid_constraint_keeps_nothing_of_its_requests(smollm2_path):
    """The failed compile is cached: its one error, raised again for each request repeating it, kept every raise's
    frames (each request's body with them) in its traceback: 2 MB prompts grew the server by ~1.9 MB a request."""
    generator = tiny_generator(smollm2_path)
    body = {"model": MODEL, "prompt": "x " * 5000, "max_tokens": 2, "structured_outputs": {"regex": "([a-z]"}}
    with live_server(create_app(generator, MODEL)) as live:
        for _ in range(12):
            assert_openai_error(post(live, "/v1/completions", body, key=None), 400, "structured_outputs")
    (failed,) = [future.exception() for future in generator.grammars._cache.values()]
    frames, tb = 0, failed.__traceback__
    while tb is not None:
        frames, tb = frames + 1, tb.tb_next
    assert frames < 4, f"{frames} frames kept"


def test_each_tokenizing_thread_has_its_own_tokenizer(smollm2_path):
    from hf_paged.server.tokenization import PromptEncoder

    generator = tiny_generator(smollm2_path)
    encoder = PromptEncoder(generator.inputs, 32, workers=4)
    prompts = [f"prompt number {i} " * (i + 1) for i in range(64)]
    expected = [generator.tokenizer(p).input_ids for p in prompts]

    async def encode_all():
        return await asyncio.gather(*(encoder.encode(p, "prompt") for p in prompts))

    assert asyncio.run(encode_all()) == expected
    seen = set(encoder.start().map(lambda _: id(encoder.processor().tokenizer), range(64)))
    assert id(generator.tokenizer) not in seen and 1 <= len(seen) <= 4
    encoder.close()


# --------------------------------------------------------------------------- 2 and 10: key and size from headers
def raw_post(base: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict]:
    """Send the headers (and ``body``, maybe far less than Content-Length says) and read the answer."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    connection.putrequest("POST", path)
    for name, value in headers.items():
        connection.putheader(name, value)
    connection.endheaders(body)
    response = connection.getresponse()
    answer = response.status, json.loads(response.read())
    connection.close()
    return answer


def test_key_and_body_size_are_checked_before_the_body_is_read(served):
    gigabyte = {"Content-Type": "application/json", "Content-Length": str(10**9)}
    status, body = raw_post(served.base, "/v1/completions", gigabyte)  # no body sent: only headers
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, body = raw_post(served.base, "/v1/completions", {**gigabyte, **AUTH})
    assert status == 413 and set(body["error"]) == {"message", "type", "param", "code"}
    chunked = {"Content-Type": "application/json", "Transfer-Encoding": "chunked", **AUTH}
    big = b"x" * (5 << 20)
    status, _ = raw_post(served.base, "/v1/completions", chunked, f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n")
    assert status == 413
    assert httpx.get(f"{served.base}/health").status_code == 200
    assert httpx.get(f"{served.base}/metrics").status_code == 200
    assert_openai_error(httpx.get(f"{served.base}/v1/models"), 401)
    assert httpx.get(f"{served.base}/v1/models", headers=AUTH).status_code == 200
    assert httpx.head(f"{served.base}/health").status_code == 200
    # A repeated header: the first counts, as Starlette (and most proxies) read it.
    two_keys = [("Authorization", "Bearer wrong"), ("Authorization", AUTH["Authorization"])]
    assert_openai_error(httpx.get(f"{served.base}/v1/models", headers=two_keys), 401)
    assert httpx.get(f"{served.base}/v1/models", headers=two_keys[::-1]).status_code == 200


def test_api_key_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    from hf_paged.cli import api_key, build_parser

    parser = build_parser()

    def key(*argv: str) -> str | None:
        args = parser.parse_args(["serve", *argv])
        return api_key(args.command_parser, args)

    monkeypatch.delenv("HF_PAGED_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")  # a vLLM deployment's key is not dropped
    assert key() == "from-vllm-env"
    monkeypatch.setenv("HF_PAGED_API_KEY", "from-env")
    assert key() == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert key("--api-key-file", str(tmp_path / "key")) == "from-file"
    assert key("--api-key", "given") == "given"
    # Several keys: the option repeated, or one per line of the file (as llama.cpp reads it). A comma is part of a
    # key (splitting there would let each part in alone).
    assert key("--api-key", "a,b", "--api-key", " c ") == ("a,b", "c")
    (tmp_path / "keys").write_text("first\n\n  second  \n")
    assert key("--api-key-file", str(tmp_path / "keys")) == ("first", "second")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00key")
    for path in ("empty", "missing", "binary"):
        with pytest.raises(SystemExit) as exit_info:
            key("--api-key-file", str(tmp_path / path))
        assert exit_info.value.code == 2 and "--api-key-file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        key("--api-key", "a", "--api-key", " ")
    assert "--api-key: an empty key" in capsys.readouterr().err


def test_any_of_several_keys_opens_the_v1_routes(smollm2_path):
    with live_server(create_app(tiny_generator(smollm2_path), MODEL, api_key=("first", "second"))) as live:
        for key, status in (("first", 200), ("second", 200), ("third", 401), ("first,second", 401), ("firs", 401)):
            answer = httpx.get(f"{live.base}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == status, key


def test_allowed_origins_comma_separated_or_as_vllms_json_list(capsys):
    from hf_paged.cli import allowed_origins, build_parser

    parser = build_parser()

    def origins(given: str) -> list[str]:
        args = parser.parse_args(["serve", "--allowed-origins", given])
        return allowed_origins(args.command_parser, args)

    assert origins("https://a.example, https://b.example") == ["https://a.example", "https://b.example"]
    assert origins('["https://a.example", "https://b.example"]') == ["https://a.example", "https://b.example"]
    assert origins("") == []
    for bad in ('["https://a.example"', "[1]"):
        with pytest.raises(SystemExit):
            origins(bad)
        assert "--allowed-origins" in capsys.readouterr().err


def test_limits_are_serve_options(capsys):
    from hf_paged.cli import build_parser, server_limits

    parser = build_parser()
    args = parser.parse_args(["serve", "--max-n", "3", "--max-body-size", "1MiB", "--max-num-waiting", "7",
                              "--body-read-timeout", "5"])
    limits = server_limits(args.command_parser, args)
    assert (limits.max_n, limits.max_body_bytes, limits.max_num_waiting, limits.body_read_timeout) == (3, 1 << 20, 7, 5)
    assert limits.max_stop_sequences == 32  # the default
    args = parser.parse_args(["serve", "--max-n", "0"])
    with pytest.raises(SystemExit) as exit_info:
        server_limits(args.command_parser, args)
    assert exit_info.value.code == 2 and "--max-n" in capsys.readouterr().err
    for port in ("70000", "-1"):  # uvicorn would wrap 70000 round to 4464
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--port", port])
        assert "is not a TCP port" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- 3 and 6: bounds
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"stop": [str(i) for i in range(33)]}, "stop"),
    ("/v1/completions", {"stop": "x" * 257}, "stop"),
    ("/v1/completions", {"stop_token_ids": [5] * 65}, "stop_token_ids"),
    ("/v1/completions", {"stop_token_ids": [12345] * 1_000_000}, None),  # 413: 6 MB, over the body limit
    ("/v1/completions", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("/v1/completions", {"n": 5}, "n"),  # max_num_seqs 8: at most 4 samples per prompt
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": ["hi"] * 33}, "prompt"),
    # 4 samples x 21 logprobs x 1000 tokens x 20 prompts: 1.7M log-probabilities in one answer
    ("/v1/completions", {"prompt": ["hi"] * 20, "n": 4, "logprobs": 20, "max_tokens": 1000}, "logprobs"),
    ("/v1/completions", {"guided_regex": "(ab|cd)" * 20000}, "guided_regex"),  # 160,000 characters
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(6000)}}}}},
     "response_format"),
], ids=["stop-count", "stop-length", "stop_token_ids", "stop_token_ids-body", "logit_bias", "n", "logprobs",
        "top_logprobs", "prompts", "logprob-entries", "regex-size", "schema-size"])
def test_limits_are_400s_naming_the_field(served, path, extra, param):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2} if path == "/v1/completions" else \
        {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    response = post(served, path, {**body, **extra})
    if param is None:
        assert_openai_error(response, 413)
    else:
        assert_openai_error(response, 400, param)
    wait_until_idle(served.generator)


def test_every_bound_takes_its_own_value(served):
    """Each limit above refuses one more than it allows, and allows that much (a `>=` for `>` went unnoticed), the
    body size and the API key's scheme too."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for extra in ({"stop": [str(i) for i in range(32)]}, {"stop": "x" * 256}, {"stop_token_ids": [5] * 64},
                  {"logit_bias": {str(i): 1 for i in range(300)}}, {"n": 4}, {"logprobs": 20}, {"prompt": ["hi"] * 32}):
        response = post(served, "/v1/completions", {**body, **extra})
        assert response.status_code == 200, (extra, response.text[:200])
    raw = json.dumps(body).encode()
    limit = ServerLimits().max_body_bytes
    for size, status in ((limit, 200), (limit + 1, 413)):
        response = httpx.post(f"{served.base}/v1/completions", content=raw + b" " * (size - len(raw)),
                              headers={"Content-Type": "application/json", **AUTH}, timeout=30)
        assert response.status_code == status, size
    token = httpx.post(f"{served.base}/v1/completions", json=body, headers={"Authorization": f"Token {KEY}"}, timeout=30)
    assert token.status_code == 401  # the right key under another scheme than Bearer
    wait_until_idle(served.generator)


def test_odd_bodies_are_400s_naming_their_field(served):
    headers = {"Content-Type": "application/json", **AUTH}
    chat = {"model": MODEL, "messages": CHAT}
    for path, body, param, words in [
        ("/v1/completions", {"model": MODEL, "prompt": [True, False]}, "prompt", ""),  # not token ids 1, 0
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, "max_completion_tokens", "max_completion"),
        ("/v1/completions", b'{"model": "tiny", "prompt": ', None, "not valid JSON"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt", "surrogate"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}',
         "messages", "surrogate"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], '
                                 b'"tools": [{"type": "function", "function": {"name": "f"}}]}', "messages", "surrogate"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": '
                                 b'[{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]}',
         "tools", "surrogate"),
        ("/v1/responses", b'{"model": "tiny", "input": "hi", "user": "\\ud800"}', "user", "surrogate"),
        ("/v1/responses", b'{"model": "tiny", "input": "hi", "metadata": {"k": "\\udfff"}}', "metadata", "surrogate"),
        ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs",
         "messages cannot be set"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"9" * 5000: 1}}, "logit_bias",
         "must be token ids"),
    ]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = httpx.post(f"{served.base}{path}", content=content, headers=headers, timeout=30)
        assert words in assert_openai_error(response, 400, param)["message"], response.text
        assert response.json()["error"]["param"] == param


def test_the_logprob_bound_counts_prompt_logprobs_as_the_answer_holds_them():
    """Completions repeat a prompt's logprobs in each of its n choices (and ``echo`` adds its own); chat answers
    them once."""
    from hf_paged.server.protocol import ChatCompletionRequest, CompletionRequest

    limits = ServerLimits(max_logprob_entries=100)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=4, prompt_logprobs=4)
    limits.check_logprob_entries(chat, 4, [0], [20])  # (4 + 1) x 20 prompt tokens, once
    completion = CompletionRequest(prompt="hi", n=4, prompt_logprobs=4)
    with pytest.raises(APIError, match="400 log-probabilities") as refused:
        limits.check_logprob_entries(completion, 4, [0], [20])
    assert refused.value.param == "prompt_logprobs"
    both = CompletionRequest(prompt="hi", echo=True, logprobs=1, prompt_logprobs=2)
    with pytest.raises(APIError, match="102 log-probabilities"):  # 2 + 3 per prompt token, then 1 new token's 2
        limits.check_logprob_entries(both, 1, [1], [20])


def test_large_responses_are_built_off_the_event_loop(served, monkeypatch):
    from hf_paged.server import serving as app_module

    threads = []
    real = app_module._response
    monkeypatch.setattr(app_module, "_response",
                        lambda *args: threads.append(threading.current_thread().name) or real(*args))
    small = post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
    large = post(served, "/v1/completions", {"model": MODEL, "prompt": ["hi"] * 4, "n": 4, "logprobs": 20,
                                             "max_tokens": 64, "ignore_eos": True})
    assert small.status_code == large.status_code == 200
    assert len(large.json()["choices"]) == 16
    assert threads[0] != threads[1]  # the large one on a worker thread (asyncio.to_thread)
    echoed = post(served, "/v1/completions", {"model": MODEL, "prompt": [5] * 990, "echo": True, "logprobs": 20,
                                              "max_tokens": 1})
    assert echoed.status_code == 200 and len(echoed.json()["choices"][0]["logprobs"]["tokens"]) == 991
    assert threads[2] != threads[0]  # its prompt's logprobs count


# --------------------------------------------------------------------------------------- 5: admission control
def open_stream(live, max_tokens: int = 1000, n: int = 1, first_event: bool = True) -> httpx.Response:
    """A streaming call left open; with ``first_event``, once it has sent its first event (it runs)."""
    client = httpx.Client(timeout=30, headers=AUTH)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True, "n": n, "stream": True}
    response = client.send(client.build_request("POST", f"{live.base}/v1/completions", json=body), stream=True)
    assert response.status_code == 200, response.read()
    response.lines = response.iter_lines()  # kept: a dropped iterator closes the stream
    if first_event:
        next(response.lines)
    response.client = client
    return response


def close_all(streams) -> None:
    for stream in streams:
        stream.close()
        stream.client.close()


def test_a_full_queue_answers_503_with_retry_after(served):
    """max_num_seqs 8 + max_num_waiting 4: twelve sequences in flight, the thirteenth is refused until one ends."""
    streams = [open_stream(served, n=4) for _ in range(2)] + [open_stream(served, n=4, first_event=False)]
    try:
        refused = post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1})
        error = assert_openai_error(refused, 503)
        assert error["code"] == "server_overloaded" and refused.headers["retry-after"] == "1"
    finally:
        close_all(streams)
    wait_until_idle(served.generator)
    assert post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200


def test_concurrent_calls_beyond_the_limit_answer_503_before_the_body(served):
    streams = [open_stream(served) for _ in range(6)]
    try:
        for path in ("/v1/chat/completions", "/v1/responses", "/v1/embeddings"):  # every route that runs the model
            status, body = raw_post(served.base, path, {"Content-Length": str(10**6), **AUTH})
            assert status == 503 and body["error"]["code"] == "server_overloaded", path
    finally:
        close_all(streams)
    wait_until_idle(served.generator)


def test_clients_that_stop_reading_or_never_send_their_body_give_their_seat_back(smollm2_path):
    """One call at a time: a body that never comes does not hold the seat and gets a 408; a stream whose client reads
    nothing holds it until the write timeout, then its connection is closed."""
    generator = tiny_generator(smollm2_path, max_num_seqs=8, max_model_len=1024)
    limits = ServerLimits(max_concurrent_requests=1, stream_write_timeout=1, body_read_timeout=2)
    small = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    with live_server(create_app(generator, MODEL, limits=limits)) as live:
        host, port = live.base.removeprefix("http://").split(":")
        slow_body = socket.create_connection((host, int(port)), timeout=20)
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{")
        assert httpx.post(f"{live.base}/v1/completions", json=small, timeout=20).status_code == 200
        assert slow_body.recv(4096).startswith(b"HTTP/1.1 408")
        slow_body.close()

        body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "n": 4,
                           "logprobs": 20, "stream": True}).encode()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # its buffers fill after a few chunks
        stalled.connect((host, int(port)))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        statuses, deadline = [], time.monotonic() + 60
        while not statuses or statuses[-1] != 200:
            assert time.monotonic() < deadline, f"the stalled stream kept its seat: {statuses[-5:]}"
            statuses.append(httpx.post(f"{live.base}/v1/completions", json=small, timeout=20).status_code)
            time.sleep(0.2)
        assert 503 in statuses, "the stream had finished before its buffers filled: the test proves nothing"
        stalled.settimeout(20)
        received = 1
        while received:  # what was sent before the timeout, then the end: the server closed the connection
            received = len(stalled.recv(1 << 16))
        stalled.close()
        wait_until_idle(generator)


def test_a_request_with_many_samples_leaves_room_for_later_ones(served):
    """n = max_n (half the seats) generating for long does not hold back a later one-sample request."""
    (big,) = streams = [open_stream(served, max_tokens=800, n=4)]
    try:
        start = time.perf_counter()
        small = post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4})
        assert small.status_code == 200 and small.json()["choices"][0]["finish_reason"] == "length"
        assert served.generator.stats().num_running >= 4, "the big request finished first: the test proves nothing"
        assert time.perf_counter() - start < 10
    finally:
        close_all(streams)
    wait_until_idle(served.generator)
    del big


# ------------------------------------------------------------------------------------ 7: when the engine fails
def test_step_errors_reach_clients_without_internals_and_metrics_errors_lose_nothing(served, monkeypatch):
    runner = served.generator.runner
    real_execute = runner.execute

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner, "execute", real_execute)
        raise RuntimeError("secret /internal/path detail")

    monkeypatch.setattr(runner, "execute", fail_once)
    error = assert_openai_error(post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}), 500)
    assert "secret" not in error["message"] and "RuntimeError" not in error["message"]
    wait_until_idle(served.generator)

    detokenizer = served.generator.scheduler.detokenizer  # a failure of one request alone, not of the step
    real_step = detokenizer.step

    def fail_one(*args, **kwargs):
        monkeypatch.setattr(detokenizer, "step", real_step)
        raise RuntimeError("secret detokenizer detail")

    monkeypatch.setattr(detokenizer, "step", fail_one)
    error = assert_openai_error(post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}), 500)
    assert "secret" not in error["message"] and "generation failed" in error["message"]
    wait_until_idle(served.generator)

    metrics = served.app.state.metrics
    monkeypatch.setattr(metrics, "observe_step", lambda *args: 1 / 0)
    done = post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 5, "ignore_eos": True},
                timeout=10)
    assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 5
    assert served.app.state.engine.healthy


class EngineKiller(BaseException):
    """Not an Exception: what a step might raise that the engine cannot recover from."""


def test_an_unrecoverable_engine_error_fails_everything_and_exits_non_zero(smollm2_path):
    from hf_paged.cli import serve_until_stopped

    generator = tiny_generator(smollm2_path)
    app = create_app(generator, MODEL)
    with live_server(app, serve=serve_until_stopped) as live:
        stream = open_stream(live)
        real_step = generator.step

        def die():
            raise EngineKiller()

        generator.step = die
        try:
            events = [line for line in stream.lines if line.startswith("data: ")]
        finally:
            close_all([stream])
        assert "error" in json.loads(events[-2][len("data: "):]) and events[-1] == "data: [DONE]"
        live.thread.join(30)
        assert not live.thread.is_alive() and live.thread.result == 1  # `hf-paged serve` exits with 1
    generator.step = real_step
    engine = app.state.engine
    assert not engine.healthy and isinstance(engine.fatal, EngineKiller)


def test_health_and_new_calls_answer_503_once_the_engine_is_dead(smollm2_path):
    generator = tiny_generator(smollm2_path)
    app = create_app(generator, MODEL)
    with live_server(app) as live:
        generator.step = lambda: (_ for _ in ()).throw(EngineKiller())
        response = post(live, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert "unrecoverable" in assert_openai_error(response, 500)["message"]
        assert_openai_error(httpx.get(f"{live.base}/health"), 503)
        response = post(live, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert assert_openai_error(response, 503)["code"] == "engine_dead"


def test_steps_that_keep_failing_are_unrecoverable(smollm2_path):
    """One failed step fails its requests and serving goes on; three in a row (a broken device, say) end it."""
    from hf_paged.engine_loop import FATAL_CONSECUTIVE_FAILURES

    generator = tiny_generator(smollm2_path)
    generator.runner.execute = lambda *args, **kwargs: 1 / 0
    with live_server(create_app(generator, MODEL)) as live:
        for attempt in range(FATAL_CONSECUTIVE_FAILURES):
            assert httpx.get(f"{live.base}/health").status_code == 200, attempt
            response = post(live, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=10)
            assert_openai_error(response, 500)
        live.app.state.engine._thread.join(10)
        assert_openai_error(httpx.get(f"{live.base}/health"), 503)


# ------------------------------------------------------------------------------------------ 9: native kernel
@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    from hf_paged.kernels import native

    if native.compiler() is None:
        pytest.skip("no C++ compiler on this machine: the native kernel is never built, so never loaded")
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "cache"))
    return native


def test_the_kernel_cache_is_private_and_checked(kernel_cache, tmp_path):
    """A library that someone else could have put there is never loaded (a file stands in for a built one)."""
    native = kernel_cache
    library = native.library_path(native.compiler())
    directory = tmp_path / "cache" / f"kernels-{os.getuid()}"  # one per user: users may share a cache of models
    assert library.parent == directory and stat.S_IMODE(directory.stat().st_mode) == 0o700
    library.write_bytes(b"not a library")
    library.chmod(0o666)  # anyone may now replace the code the server runs
    with pytest.raises(RuntimeError, match="writable by nobody else"):
        native.build()
    library.chmod(0o700)
    directory.chmod(0o777)
    with pytest.raises(RuntimeError, match="writable by nobody else"):
        native.build()
    directory.chmod(0o700)
    with pytest.raises(OSError):  # checked, then loaded: the stand-in is not a shared object
        native.build()
    if os.getuid() == 0:  # only root can hand a file to another user
        os.chown(library, 65534, 65534)
        with pytest.raises(RuntimeError, match="belong to this user"):
            native.build()


def test_the_kernel_cache_is_refused_under_a_directory_others_could_rename_it_in(kernel_cache, monkeypatch, tmp_path):
    native = kernel_cache
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may rename kernels-<uid> here and put their own in its place
    monkeypatch.setenv("HF_PAGED_CACHE", str(shared / "cache"))
    with pytest.raises(RuntimeError, match="another user could replace what it holds"):
        native.kernel_dir()
    shared.chmod(0o1777)  # sticky, as /tmp: only the owner of an entry may rename it
    assert native.kernel_dir() == shared / "cache" / f"kernels-{os.getuid()}"
    (shared / "elsewhere").mkdir(mode=0o700)
    os.rmdir(shared / "cache" / f"kernels-{os.getuid()}")
    os.symlink(shared / "elsewhere", shared / "cache" / f"kernels-{os.getuid()}")
    with pytest.raises(RuntimeError, match="symbolic link"):
        native.kernel_dir()


def test_the_kernel_cache_root_must_be_absolute(kernel_cache, monkeypatch, tmp_path):
    native = kernel_cache
    monkeypatch.setenv("HF_PAGED_CACHE", "relative/cache")
    with pytest.raises(ValueError, match="must be an absolute path"):
        native.kernel_dir()
    with pytest.raises(ValueError, match="must be an absolute path"):
        default_model_path()
    monkeypatch.setenv("HF_PAGED_CACHE", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert native.kernel_dir() == tmp_path / ".cache" / "hf_paged" / f"kernels-{os.getuid()}"


def test_an_unwritable_cache_is_named_before_the_default_model_is_converted(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")  # a directory under a file cannot be made, not even by root
    monkeypatch.setenv("HF_PAGED_CACHE", str(tmp_path / "a-file" / "cache"))
    with pytest.raises(PermissionError, match="cannot be written .* set HF_PAGED_CACHE"):
        default_model_path()


def test_loading_the_kernel_leaves_subnormal_floats_alone():
    """Linking with -ffast-math made the library's loading turn on flush-to-zero for the whole process."""
    import subprocess
    import sys

    from hf_paged.kernels import native

    if native.library() is None:
        pytest.skip("no native kernel on this machine (no C++ compiler), so nothing that could flush subnormals")
    check = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); assert 2.2250738585072014e-308 / 3 > 0, 'flushed to 0'"
    library = native.library_path(native.compiler())
    result = subprocess.run([sys.executable, "-c", check, str(library)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------- chaos
def test_chaos_reduced(smollm2_path, tmp_path):
    """`serve_load.py --chaos` against a real `hf-paged serve` process: 24 clients, a third disconnecting, slow
    readers, ten bad inputs. The full run (64 clients) is in the README; /health's p99 is bounded loosely here
    because CI machines are shared (the full run's bound is 100 ms)."""
    import subprocess
    import sys
    from pathlib import Path

    from live_server import tiny_model

    model, tokenizer = tiny_model(smollm2_path)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_load.py"
    out = tmp_path / "chaos.json"
    command = [sys.executable, str(script), "--start-server", "--model", str(tmp_path / "tiny"), "--num-blocks", "256",
               "--chaos", "--clients", "24", "--max-tokens", "24", "--health-p99-ms", "250", "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == [] and report["errors"] == [] and report["mismatches"] == []
    assert report["served"] >= 12 and report["disconnects"] >= 4 and report["bad_inputs"] == 10
    assert report["compared"] == report["served"] and report["kv_cache_usage_after"] == 0
    assert report["engine_alive"]


def test_a_dropped_app_frees_its_engine(smollm2_path, monkeypatch):
    """An app that has served and shut down holds nothing once dropped: its engine (weights, KV cache) is freed.
    (FastAPI caches facts about every endpoint function for the life of the process; endpoints that closed over the
    app's engine kept every engine a process had served alive, 9 GB over this suite.)"""
    import gc
    import weakref

    from fastapi.testclient import TestClient

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")  # the optional routes too
    generator = tiny_generator(smollm2_path, num_blocks=16)
    freed = weakref.ref(generator)
    with TestClient(create_app(generator, MODEL)) as client:
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert client.get("/v1/models").status_code == 200
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "none"}).status_code in (400, 404)
    del client, generator
    gc.collect()
    assert freed() is None


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 900}),
])
def test_a_stream_whose_client_left_before_its_first_event_is_aborted(smollm2_path, path, body):
    """A client gone before the response's headers went out (the first send fails): the events' generator never
    started, so its own cleanup never ran, and the request ran on unread to its last token."""
    generator = tiny_generator(smollm2_path, num_blocks=128, max_model_len=1024)
    app = create_app(generator, MODEL)
    payload = json.dumps({"model": MODEL, "stream": True, "max_tokens": 900, "ignore_eos": True, **body}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "root_path": ""}

    async def client_gone() -> None:
        messages = [{"type": "http.request", "body": payload, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)

        async def send(message):
            if message["type"] == "http.response.start":
                raise OSError("connection reset by peer")

        async with app.router.lifespan_context(app):
            with pytest.raises(Exception):  # noqa: B017 - Starlette's ClientDisconnect, or the OSError itself
                await app(scope, receive, send)
            await asyncio.to_thread(wait_until_idle, generator)

    asyncio.run(client_gone())
    assert generator.stats().generation_tokens < 900
