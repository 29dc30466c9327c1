"""`Ingress`: the app's HTTP entry. It reads each request, hashes its prompt's blocks for the router, and passes
it to an engine replica whose `create_app` server answers; ``/metrics`` gathers every replica's metrics.

Serve's HTTP proxy hands a deployment the request's headers but not its body, so routing on the prompt needs this
hop: the ingress is light (a tokenizer, no model) and the router runs in its process.
"""


import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Collection

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle

from ..generation.inputs import Prompt, tokenize_prompt
from ..server.limits import ServerLimits
from ..server.middleware import Gatekeeper
from ..server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from ..chat_template import content_format as resolved_content_format
from ..server.responses import ResponsesRequest
from ..server.serving import EventStream
from .affinity import prefix_hashes
from ..server.asgi import HTTPRequest, HTTPResponseStart
from .metrics import merged_metrics
from .registry import router_of
from .runtime_adapters import RUNTIME_UPDATES

logger = logging.getLogger(__name__)
api = FastAPI(title="hf_paged on Ray Serve")
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
# Characters of a prompt (of each chat message) hashed for routing: some thousands of tokens.
ROUTE_CHARS = 1 << 15
# vLLM's runtime adapter updates: each changes what every replica serves.
_LOAD, _UNLOAD = RUNTIME_UPDATES


def _prompt(path: str, body: bytes, content_format: str) -> tuple[Prompt | None, str | None]:
    """The request's (first) prompt and the model it names."""
    if path in ("/v1/chat/completions", "/v1/responses"):
        chat = ChatCompletionRequest.model_validate_json(body) if path == "/v1/chat/completions" else \
            ResponsesRequest.model_validate_json(body).to_chat()
        return [m.to_template_dict(content_format) for m in chat.messages], chat.model
    if path == "/v1/completions":
        request = CompletionRequest.model_validate_json(body)
        prompts = request.prompts()
        return (prompts[0] if prompts else None), request.model
    return None, None


def _cut(prompt: Prompt) -> Prompt:
    """The prompt's first `ROUTE_CHARS` characters of text (its messages', in order: those past them dropped, the one
    they end in cut): its first blocks place it as well as all of them."""
    if isinstance(prompt, str):
        return prompt[:ROUTE_CHARS]
    if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
        return prompt
    kept, left = [], ROUTE_CHARS
    for message in prompt:
        if left <= 0:
            break
        content, left = _cut_content(message.get("content"), left)
        kept.append({**message, "content": content})
    return kept


def _cut_content(content, left: int) -> tuple[object, int]:
    """A message's content (a text, or OpenAI's parts) cut to ``left`` characters of text, and what is left."""
    if isinstance(content, str):
        return content[:left], left - len(content)
    if not isinstance(content, list):
        return content, left
    parts = []
    for part in content:
        text = part.get("text") if isinstance(part, dict) else None
        if isinstance(text, str):
            parts.append({**part, "text": text[:max(left, 0)]})
            left -= len(text)
        else:
            parts.append(part)
    return parts, left


def route_hashes(path: str, body: bytes, tokenizer, content_format: str, block_size: int,
                 adapters: Collection[str] = ()) -> list[bytes] | None:
    """The block hashes the router places a request by: its prompt's (`prefix_hashes`; of its first `ROUTE_CHARS`
    characters, so that a huge prompt, which its replica may well refuse, is not tokenized whole here), salted by
    the LoRA adapter it names among ``adapters`` (an adapter's blocks are cached apart from the base model's and other
    adapters'); None when the request has no prompt, or a malformed one (the replica answers that with its 400)."""
    try:
        prompt, model = _prompt(path, body, content_format)
        if prompt is None:
            return None
        token_ids = tokenize_prompt(tokenizer, _cut(prompt))[1]
        return prefix_hashes(token_ids, block_size, salt=b"lora:" + model.encode() if model in adapters else None)
    except Exception:
        return None


async def _rest(start: HTTPResponseStart, response):
    """The body after ``start``; a replica that dies mid-stream ends an event stream with an error event."""
    yield start.body
    try:
        async for piece in response:
            yield piece
    except Exception as err:
        logger.warning("an engine replica failed mid-response: %r", err)
        if (start.header(b"content-type") or b"").startswith(b"text/event-stream"):
            error = error_body(f"the engine replica serving this request failed: {err!r}", "server_error", code=503)
            yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


def _is_preflight(request: Request) -> bool:
    headers = request.headers
    return request.method == "OPTIONS" and "origin" in headers and "access-control-request-method" in headers


def _is_control(method: str, path: str) -> bool:
    """Whether a call runs nothing (a probe, a listing, a preflight): it is never held back."""
    return method in ("GET", "HEAD", "OPTIONS")


class ModelCallGate:
    """The calls in flight from this ingress that are not control calls: at most ``per_replica`` times the replicas
    there are; the others wait here (rather than in Serve's router, whose few routing tasks, one per call it waits
    to place, must stay free for control calls)."""

    def __init__(self, per_replica: int):
        self.per_replica, self.running = per_replica, 0
        self._freed = asyncio.Event()

    async def acquire(self, replicas: Callable[[], int]) -> Callable[[], None]:
        """Wait for room (``replicas()``: how many there are now); returns the call's release (idempotent)."""
        while self.running >= self.per_replica * max(1, replicas()):
            self._freed.clear()
            with contextlib.suppress(TimeoutError):  # replicas may have been added meanwhile
                await asyncio.wait_for(self._freed.wait(), 1.0)
        self.running += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released, self.running = True, self.running - 1
                self._freed.set()

        return release


def _headers(start: HTTPResponseStart) -> dict[str, str]:
    """The replica's answer's headers, but its ``X-Request-Id``: Serve's proxy adds its own to every answer."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers
            if k.lower() not in (b"content-length", b"x-request-id")}


def _replica_failed(err: Exception) -> JSONResponse:
    message = f"the engine replica serving this request failed: {err!r}"
    return JSONResponse(error_body(message, "server_error", code=503), status_code=503)


# Serve pickles the ingress class when it is decorated: what its methods use must be defined above it.
@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    """The app's HTTP entry in front of the ``engine`` deployment. With ``prefix_affinity=False`` it sends no block
    hashes, so the router always takes the less loaded of two random replicas."""

    def __init__(self, engine: DeploymentHandle, tokenizer_path: str, block_size: int, prefix_affinity: bool = True,
                 metrics_timeout_s: float = 5.0, api_key: str | tuple[str, ...] | None = None,
                 limits: ServerLimits | None = None, cors: bool = False, trust_remote_code: bool = False,
                 content_format: str = "auto", adapters: tuple[str, ...] = (), max_ongoing_requests: int = 256):
        from transformers import AutoTokenizer

        # Its checks only: the replicas' apps count the calls. With ``cors``, preflights pass without the key (the
        # replicas answer them, as `create_app` does).
        self.gate = Gatekeeper(None, limits or ServerLimits(), api_key)
        self.cors = cors
        self.engine = engine
        self.stream = engine.options(stream=True)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
        self.tokenizer_lock = threading.Lock()  # prompts are tokenized on worker threads, one at a time
        self.content_format = resolved_content_format(content_format, self.tokenizer.chat_template)  # the replicas'
        self.block_size = block_size
        self.prefix_affinity = prefix_affinity
        self.adapters = adapters  # the LoRA adapters' names (``--lora-modules``)
        self.metrics_timeout_s = metrics_timeout_s
        self.last_metrics: dict[str, str] = {}  # every replica's last /metrics text, kept when it goes
        self.model_calls = ModelCallGate(max_ongoing_requests)

    async def _router(self):
        router = router_of(self.engine.app_name)
        if router is None:  # the handle makes its router at its first call
            await self.engine.metrics.remote(control=True)
            router = router_of(self.engine.app_name)
        return router

    @api.get("/metrics")
    async def metrics(self) -> Response:
        router = await self._router()
        texts = {}
        # One at a time: calls made while serving one HTTP request share Serve's request id, and the router
        # hands a chosen replica to the first pending call with that id.
        for replica in [r.unique_id for r in router.curr_replicas]:
            try:
                answer = self.engine.metrics.remote(replica=replica)
                answered_by, texts[replica] = await asyncio.wait_for(answer, self.metrics_timeout_s)
                if answered_by != replica:
                    raise RuntimeError(f"replica {answered_by} answered instead")
            except Exception as err:
                logger.warning("replica %s did not report its metrics: %r", replica, err)
        self.last_metrics.update(texts)
        gone = {replica: text for replica, text in self.last_metrics.items() if replica not in texts}
        merged = merged_metrics(texts, router.stats, gone, len(router.curr_replicas))
        return Response(merged, media_type=CONTENT_TYPE_LATEST)

    @api.api_route("/{path:path}", methods=_METHODS)
    async def forward(self, path: str, request: Request) -> Response:
        # The key and the body's size from the headers, before the body is read, as the replicas' own apps do.
        path = "/" + path  # relative to where this app is mounted, as the key check expects
        if self.cors and _is_preflight(request):
            body = b""
        else:
            body = self.gate.refusal({**request.scope, "path": path}) or await self.gate.read_body(request.receive)
        if isinstance(body, APIError):
            return JSONResponse(body.body(), status_code=body.status, headers=body.headers)
        if body is None:
            return Response(status_code=499)  # the client left
        http = HTTPRequest(request.method, path, request.url.query.encode(), request.headers.raw, body)
        if request.method == "POST" and path in (_LOAD, _UNLOAD):
            return await self._update_adapters(http)
        prefix = await asyncio.to_thread(self._prefix, path, body)  # tokenizing a long prompt takes a while
        control = _is_control(request.method, path)
        router = await self._router()
        release = (lambda: None) if control else await self.model_calls.acquire(lambda: len(router.curr_replicas))
        try:
            response = self.stream.remote(http, prefix=prefix, control=control)
            start: HTTPResponseStart = await response.__anext__()
        except BaseException as err:
            release()
            if not isinstance(err, Exception):  # cancelled: the client left
                raise
            logger.warning("an engine replica failed before it answered: %r", err)
            return _replica_failed(err)
        if start.complete:
            release()
            return Response(start.body, status_code=start.status, headers=_headers(start))
        # The replica's app aborts the request once cancelled: when the client leaves, whenever that is.
        return EventStream(_rest(start, response), lambda: (response.cancel(), release()), status_code=start.status,
                           headers=_headers(start))

    async def _update_adapters(self, http: HTTPRequest) -> Response:
        """An adapter load or unload, sent to each replica in turn (see `metrics`) so that all serve the same names:
        the first refusal is the answer, and a new adapter that one replica refused is unloaded from those that took
        it. A replica Serve starts later loads what was loaded so (`runtime_adapters`)."""
        done, answer, update = [], None, None
        for replica in [r.unique_id for r in (await self._router()).curr_replicas]:
            try:
                answer = await self._whole_answer(http, replica)
            except Exception as err:
                logger.warning("replica %s failed an adapter update: %r", replica, err)
                answer = _replica_failed(err)
            if answer.status_code >= 300:
                if update is not None and http.path == _LOAD and not update.get("load_inplace"):
                    await self._unload(http, update["lora_name"], done)
                return answer
            done.append(replica)
            update = update or json.loads(http.body)  # a replica took it, so it is valid
        if update is None:
            return _replica_failed(RuntimeError("no engine replica is running"))
        name = update["lora_name"]
        self.adapters = tuple(a for a in self.adapters if a != name) + ((name,) if http.path == _LOAD else ())
        return answer

    async def _unload(self, http: HTTPRequest, name: str, replicas: list[str]) -> None:
        """Undo a load on ``replicas``, with the headers (the key) of the request that loaded it."""
        headers = [(k, v) for k, v in http.headers if k.lower() not in (b"content-length", b"content-type")]
        undo = HTTPRequest("POST", _UNLOAD, b"", headers + [(b"content-type", b"application/json")],
                           json.dumps({"lora_name": name}).encode())
        for replica in replicas:
            try:
                await self._whole_answer(undo, replica)
            except Exception as err:
                logger.warning("replica %s kept adapter %r that another replica refused: %r", replica, name, err)

    async def _whole_answer(self, http: HTTPRequest, replica: str) -> Response:
        response = self.stream.remote(http, replica=replica)
        start: HTTPResponseStart = await response.__anext__()
        body = start.body if start.complete else start.body + b"".join([piece async for piece in response])
        return Response(body, status_code=start.status, headers=_headers(start))

    def _prefix(self, path: str, body: bytes) -> list[bytes] | None:
        """The hashes the router places the request by (`route_hashes`), None without prefix affinity."""
        if not self.prefix_affinity:
            return None
        with self.tokenizer_lock:
            return route_hashes(path, body, self.tokenizer, self.content_format, self.block_size, self.adapters)
