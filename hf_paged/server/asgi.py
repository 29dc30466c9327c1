"""Run one HTTP request through an ASGI app in-process, and hand its response on in pieces that pickle.

On Ray Serve the ingress sends an `HTTPRequest` to an engine replica, which runs it through its `create_app` app with
`call_app`: the first piece is an `HTTPResponseStart` (status, headers and the body so far), then body bytes.
Whatever body the app has sent by the time a piece goes out joins that piece, so a busy stream costs one Ray message
per engine step rather than one per event. ``hf-paged run-batch`` (`hf_paged.batch`) runs its requests the same way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class HTTPRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class HTTPResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    complete: bool  # the whole body is in ``body``

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key.lower() == name), None)


async def call_app(app, request: HTTPRequest) -> AsyncIterator[HTTPResponseStart | bytes]:
    """Run ``request`` through ``app``; closing this generator early tells the app that the client left."""
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": request.body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    task = asyncio.create_task(app(_scope(request), receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        start = await messages.get()
        if start is None or start["type"] != "http.response.start":
            _log_failure(task)
            yield HTTPResponseStart(500, [(b"content-type", b"text/plain")], b"internal server error", True)
            return
        body, more = await _body_so_far(messages)
        yield HTTPResponseStart(start["status"], list(start.get("headers", [])), body, not more)
        while more:
            body, more = await _body_so_far(messages)
            if body:
                yield body
    finally:
        disconnected.set()
        task.cancel()  # a no-op once the app has answered; else its handler's clean-up aborts the requests


async def _body_so_far(messages: asyncio.Queue) -> tuple[bytes, bool]:
    """Wait for at least one body message, then take every one already queued: ``(bytes, more to come)``."""
    parts = []
    message = await messages.get()
    while True:
        if message is None:
            return b"".join(parts), False
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), False
        if messages.empty():
            return b"".join(parts), True
        message = messages.get_nowait()


def _scope(request: HTTPRequest) -> dict:
    return {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": request.method, "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
        "root_path": "", "query_string": request.query_string, "headers": request.headers,
        "client": ("ray-serve-ingress", 0), "server": ("engine-replica", 0), "state": {},
    }


def _log_failure(task: asyncio.Task) -> None:
    if task.done() and not task.cancelled() and task.exception() is not None:
        logger.error("the app failed before it answered", exc_info=task.exception())
