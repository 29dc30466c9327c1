"""Pure ASGI middleware: `Gatekeeper` refuses a call from its headers, before its body is read; `RequestIds` gives
every call vLLM's ``X-Request-Id``.

An unauthenticated or oversized POST is answered 401 / 413 without reading (or parsing) a byte of its body; a body
sent without ``Content-Length`` (chunked) is read up to the limit and no further, and one that has not arrived within
``body_read_timeout`` seconds gets a 408. Generation calls beyond ``max_concurrent_requests`` get a 503 with
``Retry-After``; a call counts from when its body has arrived until its answer is out, and a client that takes in none
of its answer for ``stream_write_timeout`` seconds is cut off. ``/health`` and ``/metrics`` need no key.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import uuid
from collections.abc import Sequence

from .limits import ServerLimits
from .protocol import APIError

# The calls that run the model, which --max-concurrent-requests bounds.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/score",
                              "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"})
KEYED_PATHS = ("/v1", "/v2", "/score", "/rerank", "/tokenize", "/detokenize")  # the routes an API key guards
RETRY_AFTER_S = 1
_CLIENT_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # visible ASCII: what goes back into a header and a body
logger = logging.getLogger(__name__)


class RequestIds:
    """vLLM's ``X-Request-Id``: a call's id is the client's header (visible ASCII, up to 128 characters) or a new one,
    in ``request.state.request_id``; every answer carries it back in the header (a generation's response id is made
    from it, so a trace id set by a proxy finds its response)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"x-request-id"), b"").decode("latin-1")
        request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ClientStalled(Exception):
    """The client took in nothing of its answer for ``stream_write_timeout`` seconds."""


def overloaded(what: str) -> APIError:
    return APIError(503, f"the server is busy ({what}); retry later", "server_error", code="server_overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def route_path(scope) -> str:
    """The path the routes see: without the ``root_path`` (``--root-path``) that the ASGI server puts before it, as
    Starlette's routing takes it off."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        return path[len(root):]
    return path


class Gatekeeper:
    """Checks the API key (on ``/v1`` routes), the body size and the number of generation calls in progress."""

    def __init__(self, app, limits: ServerLimits, api_key: str | Sequence[str] | None = None):
        self.app = app
        self.limits = limits
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self.api_keys = [key.encode() for key in keys]  # any of them (none: no key asked)
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self.refusal(scope)
        if error is not None:
            return await _answer(send, error)
        generation = route_path(scope) in GENERATION_PATHS
        if generation and (busy := self._full()):  # before the body is read, and again once it has arrived
            return await _answer(send, busy)
        body = await self.read_body(receive)
        if generation and body is not None and not isinstance(body, APIError):
            body = self._full() or body
        if isinstance(body, APIError):
            return await _answer(send, body)
        if body is None:
            return
        self.in_flight += generation
        try:
            await self.app(scope, _replay(body, receive), self._bounded(send))
        except ClientStalled:  # the connection is closed: uvicorn sees an answer that never completed
            logger.warning("%s %s: the client read nothing for %d s; its call was cut off (--stream-write-timeout)",
                           scope.get("method"), scope["path"], self.limits.stream_write_timeout)
        finally:
            self.in_flight -= generation

    def _full(self) -> APIError | None:
        if self.in_flight >= self.limits.max_concurrent_requests:
            return overloaded(f"{self.in_flight} calls in progress, --max-concurrent-requests")
        return None

    def _bounded(self, send):
        """``send`` that gives up (`ClientStalled`) when one message cannot be written for ``stream_write_timeout``
        seconds: the client stopped reading and the socket's buffers are full."""
        async def bounded(message) -> None:
            try:
                async with asyncio.timeout(self.limits.stream_write_timeout):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        return bounded

    def refusal(self, scope) -> APIError | None:
        """A 401 or 413 (or 400) from the headers alone, or None."""
        headers = {}
        for name, value in scope["headers"]:  # the first of a repeated header counts, as Starlette reads it
            headers.setdefault(name, value)
        if self.api_keys and route_path(scope).startswith(KEYED_PATHS):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            known = [hmac.compare_digest(token.strip(), key) for key in self.api_keys]  # each compared, in full
            if scheme.lower() != b"bearer" or not any(known):
                return APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                code="invalid_api_key")
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            return APIError(400, "the Content-Length header is not a number")
        if length is not None and int(length) > self.limits.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than this server accepts ({self.limits.max_body_bytes} "
                             "bytes, --max-body-size)", code="request_too_large")

    async def read_body(self, receive) -> bytes | APIError | None:
        """The whole body; a 413 once it passes the limit, a 408 if it has not arrived in time, or None if the client
        left while sending it."""
        try:
            async with asyncio.timeout(self.limits.body_read_timeout):
                return await self._body(receive)
        except TimeoutError:
            return APIError(408, f"the request body did not arrive within {self.limits.body_read_timeout} s "
                                 "(--body-read-timeout)", code="request_timeout")

    async def _body(self, receive) -> bytes | APIError | None:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                return self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive):
    """A ``receive`` that hands the app the body read already, then listens for the client leaving."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _answer(send, error: APIError) -> None:
    content = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": content})
