"""`Gatekeeper`: pure ASGI middleware that refuses a call from its headers, before its body is read.

An unauthenticated or oversized POST is answered 401 / 413 without reading (or parsing) a byte of its body; a body
sent without ``Content-Length`` (chunked) is read up to the limit and no further. Generation calls beyond
``max_concurrent_requests`` get a 503 with ``Retry-After``. ``/health`` and ``/metrics`` need no key.
"""

from __future__ import annotations

import hmac
import json

from .limits import ServerLimits
from .protocol import APIError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
RETRY_AFTER_S = 1


def overloaded(what: str) -> APIError:
    return APIError(503, f"the server is busy ({what}); retry later", "server_error", code="server_overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class Gatekeeper:
    """Checks the API key (on ``/v1`` routes), the body size and the number of generation calls in progress."""

    def __init__(self, app, limits: ServerLimits, api_key: str | None = None):
        self.app = app
        self.limits = limits
        self.api_key = api_key.encode() if api_key is not None else None
        self.in_flight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        error = self._refusal(scope)
        if error is not None:
            return await _answer(send, error)
        generation = scope["path"] in GENERATION_PATHS
        if generation and self.in_flight >= self.limits.max_concurrent_requests:
            return await _answer(send, overloaded(f"{self.in_flight} calls in progress, --max-concurrent-requests"))
        self.in_flight += generation
        try:
            body = await self._read_body(receive)
            if isinstance(body, APIError):
                return await _answer(send, body)
            if body is not None:
                await self.app(scope, _replay(body, receive), send)
        finally:
            self.in_flight -= generation

    def _refusal(self, scope) -> APIError | None:
        headers = dict(scope["headers"])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
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

    async def _read_body(self, receive) -> bytes | APIError | None:
        """The whole body, a 413 once it passes the limit, or None if the client left while sending it."""
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
