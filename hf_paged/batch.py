"""`hf-paged run-batch`: a file of requests in OpenAI's batch format (vLLM's ``run-batch``), answered by the server's
own app in-process, every request in flight at once up to the server's limit, so the engine batches them; a request
the server is too busy for (a 503 with ``Retry-After``: more sequences in flight than it queues) waits and goes again.

Each input line is ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}``; the URL is
one of the server's model calls (`URLS`). Each output line, in the input's order, is ``{"id", "custom_id",
"response": {"status_code", "request_id", "body"}, "error": null}``, the body the server's answer (an error's included,
with its 4xx status, as OpenAI's batches answer); a line that is no such request (not JSON, another method or URL, a
streamed body) gets ``"response": null`` and an ``error`` that says why, and the others run on. Lines end at ``\n``
only (JSON strings may hold U+2028 and the like).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterable

from .server.asgi import HTTPRequest, HTTPResponseStart, call_app

RETRY_WAIT_S = (0.05, 1.0)  # the first and the longest wait before a busy server is asked again
URLS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/score",
                  "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})


async def run_batch(app, lines: Iterable[str], concurrency: int) -> list[dict]:
    """The output records of the batch file's ``lines`` (blank lines skipped), run through ``app`` (a `create_app`
    app, whose engine runs for the batch) at most ``concurrency`` at a time."""
    requests = [(number, line) for number, line in enumerate(lines, 1) if line.strip()]
    gate, first_line = asyncio.Semaphore(concurrency), {}
    for number, line in requests:
        first_line.setdefault(_custom_id(line), number)
    async with app.router.lifespan_context(app):
        return list(await asyncio.gather(*(_answer(app, number, line, gate, first_line) for number, line in requests)))


async def _answer(app, number: int, line: str, gate: asyncio.Semaphore, first_line: dict) -> dict:
    try:
        custom_id, url, body = _request(line)
        if first_line[custom_id] != number:
            raise ValueError(f"custom_id {custom_id!r} is line {first_line[custom_id]}'s already: each must be unique")
    except ValueError as err:
        return _record(_custom_id(line), None, {"code": "invalid_request", "message": f"line {number}: {err}"})
    request = HTTPRequest("POST", url, b"", [(b"content-type", b"application/json")], json.dumps(body).encode())
    wait = RETRY_WAIT_S[0]
    while True:
        async with gate:
            parts = [piece async for piece in call_app(app, request)]
        start: HTTPResponseStart = parts[0]
        if start.status != 503 or start.header(b"retry-after") is None:
            break
        await asyncio.sleep(wait)
        wait = min(2 * wait, RETRY_WAIT_S[1])
    text = start.body + b"".join(parts[1:])
    try:
        answer = json.loads(text)
    except ValueError:
        answer = {"error": {"message": text.decode("utf-8", "replace"), "type": "server_error", "param": None,
                            "code": start.status}}
    request_id = (start.header(b"x-request-id") or b"").decode() or None
    return _record(custom_id, {"status_code": start.status, "request_id": request_id, "body": answer}, None)


def _request(line: str) -> tuple[str, str, dict]:
    """``(custom_id, url, body)`` of an input line; ``ValueError`` says what is wrong with it."""
    try:
        item = json.loads(line)
    except ValueError as err:
        raise ValueError(f"not JSON ({err})") from None
    except RecursionError:
        raise ValueError("nested too deeply to read") from None
    if not isinstance(item, dict):
        raise ValueError("a request is a JSON object with custom_id, method, url and body")
    custom_id, method, url, body = (item.get(key) for key in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if method != "POST":
        raise ValueError(f"method must be POST, got {method!r}")
    if url not in URLS:
        raise ValueError(f"url must be one of {', '.join(sorted(URLS))}, got {url!r}")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object (the request's body)")
    if body.get("stream"):
        raise ValueError("a batch request is answered whole: remove stream")
    return custom_id, url, body


def _custom_id(line: str) -> str | None:
    """The line's custom_id, where it is one (a non-empty string); its error record says why not."""
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        return None
    custom_id = item.get("custom_id") if isinstance(item, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def output_line(record: dict) -> str:
    """A record as its output line: JSON as UTF-8 writes it, or escaped where it cannot (a ``custom_id`` holding a
    lone surrogate, read from a ``"\\ud800"`` escape, is given back as it came)."""
    text = json.dumps(record, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(record)
    return text + "\n"


def _record(custom_id, response: dict | None, error: dict | None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}
