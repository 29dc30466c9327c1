"""The OpenAI-compatible HTTP server: `create_app` builds a FastAPI app over a `ContinuousBatchGenerator`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``, ``POST /v1/embeddings``,
vLLM's ``POST /score`` and ``POST /rerank`` (also under ``/v1``; ``/v2/rerank``), ``GET /v1/models`` (and
``/v1/models/{id}``),
vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /health`` (``/ping``), ``GET /version`` and ``GET /metrics``
(Prometheus). Choices made
where OpenAI leaves room:

* ``temperature`` defaults to 1.0, as OpenAI's does; 0 is greedy. As in vLLM, sampling settings the model's
  generation config recommends (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) stand for
  those a request leaves out (``ServingOptions.generation_config="vllm"``: they do not; its
  ``override_generation_config`` sets them).
* ``max_tokens`` defaults to 16 on ``/v1/completions`` (OpenAI's legacy default) and, on ``/v1/chat/completions``,
  to the rest of the context (``max_model_len`` minus the prompt), as chat models generate until they stop.
  ``max_completion_tokens`` takes precedence over ``max_tokens``. A limit that the prompt leaves no room for in the
  context is a 400 naming both lengths, as vLLM's.
* ``model`` may be omitted (it then means the served model); a LoRA adapter's name (``lora_modules``, vLLM's
  ``--lora-modules``) runs the request under that adapter, and ``/v1/models`` lists each with the served model as
  its parent; any other name is a 404. Where ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, vLLM's
  ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` add and drop adapters while serving.
* ``/v1/completions`` takes a list of prompts too: prompt ``i``'s ``n`` choices get indices ``i*n .. i*n+n-1``.
  With ``echo`` each choice starts with its prompt (and, with ``logprobs``, the prompt tokens' logprobs, the
  first None), streamed in its first chunk. vLLM's ``prompt_logprobs`` (both endpoints, not streamed) answer in
  vLLM's shape: in each choice of a completion, at the top of a chat response.
* A field of OpenAI's API or of vLLM's extensions that would change the output and is not implemented (``suffix``,
  ``echo`` on the chat endpoint, ``best_of`` above ``n``, ``tools`` on ``/v1/completions``, ...; see
  ``protocol._UNSUPPORTED``) is a 400 naming it, and so are other servers' names for fields taken under another
  name here (llama.cpp's ``n_predict``, ``grammar``, ``repeat_penalty``, ...: ``protocol._OTHER_NAMES``, the error
  says which); a field that is not known at all is ignored and logged, as vLLM does.
* ``response_format``, ``structured_outputs`` (and ``guided_*``) and ``tools`` with ``tool_choice`` are served by
  constrained decoding (see ``tool_calls.py`` for the tool-call format). The grammar is compiled before the request
  is queued, so an invalid schema, regex or grammar is a 400 naming the field that carried it.
* With an API key, every ``/v1`` route, ``/score``, ``/rerank``, ``/v2/rerank``, ``/tokenize`` and ``/detokenize``
  want ``Authorization: Bearer KEY`` (vLLM leaves the last two open; they spend the server's CPU); ``/health`` and
  ``/metrics`` stay open.
  Browsers may call from any origin unless ``allowed_origins`` says otherwise (CORS preflights need no key).
  The key and the body size are checked from the headers before the body is read (`middleware.Gatekeeper`).
* What one call may ask is bounded by `ServerLimits` (prompts per call, ``n``, stop strings, ``logit_bias``,
  logprobs, prompt length before tokenizing); prompts are tokenized on worker threads (`tokenization`).
* Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter or body
  (FastAPI's 422 included), 401 for a missing or wrong key, 404 for an unknown model, 413 for a body over the
  limit, 500 when the engine failed (details go to the log, never to the client), 503 with ``Retry-After`` when
  the server is full. ``/health`` answers 503 once the engine has stopped after an unrecoverable error.
  A stream that fails after it began sends one ``data: {"error": ...}`` event, then ``data: [DONE]``. Requests still
  running when a shutdown's grace period is about to end fail with 503 (`GracefulServer`).
* While a stream uses stop strings, its last ``len(longest stop) - 1`` characters are held back until more text
  follows (as vLLM does, whether or not they could start one), so no text is ever sent that the stop would have cut.
  Choices carry vLLM's ``stop_reason``: the stop string or token id that ended them, else null.
* A client that disconnects aborts its requests, which frees their KV blocks (a non-streaming call notices within
  a second).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..lora import AdapterNotFound
from ..generation import ContinuousBatchGenerator, InvalidParameter
from ..engine_loop import EngineLoop
from .embeddings import EmbeddingRequest
from .scores import RerankRequest, ScoreRequest
from .limits import ServerLimits
from .metrics import ServerMetrics
from .middleware import Gatekeeper, RequestIds
from .models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, runtime_lora_updating
from .options import ServingOptions
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body
from .responses import ResponsesRequest
from .serving import OpenAIServing
from .tokenization import PromptEncoder

logger = logging.getLogger(__name__)


def create_app(generator: ContinuousBatchGenerator, served_model_name: str | Sequence[str],
               api_key: str | Sequence[str] | None = None, limits: ServerLimits | None = None,
               allowed_origins: Sequence[str] = ("*",), options: ServingOptions | None = None,
               lora_modules: Sequence[tuple[str, str] | tuple[str, str, str | None]] = ()) -> FastAPI:
    """An app serving ``generator`` under the model name ``served_model_name`` (or each of several, the first its main
    one, as vLLM's), within ``limits``, to clients that send
    ``api_key`` (or any of several; None: no key asked) on its ``/v1`` routes; browsers may call
    it from ``allowed_origins`` (CORS, as vLLM's: any origin by default; none when empty). ``options`` are vLLM's
    choices of how to answer (`ServingOptions`): by default, as vLLM's ``--generation-config auto``, what a request
    leaves out of the sampling settings the model's generation config recommends is taken from it. With the engine's
    ``reasoning_parser``, chat replies answer their reasoning apart from their content. ``lora_modules`` are
    ``(name, path)`` (or ``(name, path, base_model_name)``) of LoRA adapters served under those names (the engine
    built with ``enable_lora``); each is loaded now (``ValueError`` names one that does not fit).

    The engine thread starts with the app (or at the first request, if the app runs without its lifespan) and
    stops when the app shuts down. ``app.state.engine`` is the `EngineLoop`; ``app.state.metrics`` its metrics;
    ``app.state.serving`` the `OpenAIServing` that the routes answer with.
    """
    limits, options = limits or ServerLimits(), options or ServingOptions()
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    metrics = ServerMetrics(model_name=names[0], max_model_len=generator.max_model_len,
                            prefix=options.metrics_prefix)
    metrics.set_cache_config(block_size=generator.config.block_size, num_gpu_blocks=generator.stats().num_blocks,
                             cache_dtype=generator.config.kv_cache_dtype or "auto",
                             enable_prefix_caching=generator.config.enable_prefix_caching)
    engine = EngineLoop(generator, metrics, limits.max_num_waiting, limits.stream_write_timeout,
                        exit_on_group_failure=True)
    encoder = PromptEncoder(generator.inputs, limits.max_chars_per_token, limits.tokenizer_workers)
    serving = OpenAIServing(generator, engine, encoder, limits, names, options)
    for module in lora_modules:
        serving.models.add(*module)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        encoder.start()
        try:
            yield
        finally:
            engine.stop()
            encoder.close()

    app = FastAPI(title="hf_paged", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.limits, app.state.serving = engine, metrics, limits, serving
    app.add_middleware(Gatekeeper, limits=limits, api_key=api_key)
    if allowed_origins:  # outside the gatekeeper: preflights are answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    app.add_middleware(RequestIds)  # outermost: refusals carry the id too
    _install_error_handlers(app)
    app.include_router(routes)
    if runtime_lora_updating():
        app.include_router(lora_routes)
    # An app run without its lifespan starts the thread at its first request; once the app is dropped, it ends.
    weakref.finalize(app, engine.release).atexit = False
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn's server for an app of `create_app`: on shutdown, the requests still running just before
    ``timeout_graceful_shutdown`` ends fail with a 503 (an error event, then ``[DONE]``, in a stream), where uvicorn
    would cancel their handlers mid-response (a cut-off stream, a plain-text 500)."""

    async def shutdown(self, sockets=None) -> None:
        timeout = self.config.timeout_graceful_shutdown
        engine = self.config.app.state.engine
        cut = None
        if timeout is not None:  # their handlers get a moment to answer before the timeout
            cut = asyncio.get_running_loop().call_later(max(0.0, timeout - min(1.0, timeout / 2)), engine.cut_off)
        try:
            await super().shutdown(sockets)
        finally:
            if cut is not None:
                cut.cancel()


# The routes are declared once, at module level, and find the app's serving through the request: FastAPI caches
# facts about each endpoint function for the life of the process, so an endpoint closing over an app's engine would
# keep every engine a process ever served alive (its weights, its KV cache) after its app was dropped.
routes = APIRouter()
lora_routes = APIRouter()  # vLLM's runtime adapter updates (where ``$VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true)


def _serving(request: Request) -> OpenAIServing:
    return request.app.state.serving


@routes.get("/health")
@routes.head("/health")
@routes.get("/ping")  # vLLM's (SageMaker's) name for it
@routes.post("/ping")
async def health(request: Request) -> Response:
    if not request.app.state.engine.healthy:
        body = error_body("the engine has stopped after an unrecoverable error", "server_error", code=503)
        return JSONResponse(body, status_code=503)
    return JSONResponse({"status": "ok"})


@routes.get("/version")
async def version() -> dict:
    return {"version": __version__}


@routes.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def models(request: Request) -> dict:
    serving = _serving(request)
    return {"object": "list", "data": serving.models.cards(serving.generator.max_model_len)}


@routes.get("/v1/models/{model:path}")
async def model_card(model: str, request: Request) -> dict:
    serving = _serving(request)
    name = serving.models.name(model)  # a 404 for a name not served
    return next(card for card in serving.models.cards(serving.generator.max_model_len) if card["id"] == name)


@routes.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _serving(request).completions(body, request)


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _serving(request).chat_completions(body, request)


# The calls answered from the model's embeddings: OpenAI's embeddings, vLLM's scores and reranking.
@routes.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await _serving(request).embeddings(body, request)


@routes.post("/score")
@routes.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Response:
    return await _serving(request).score(body, request)


@routes.post("/rerank")
@routes.post("/v1/rerank")
@routes.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request) -> Response:
    return await _serving(request).rerank(body, request)


@routes.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request) -> Response:
    return await _serving(request).responses(body, request)


@routes.get("/v1/responses/{response_id}")
@routes.delete("/v1/responses/{response_id}")
@routes.post("/v1/responses/{response_id}/cancel")
async def stored_response(response_id: str) -> Response:
    raise APIError(404, f"no response {response_id[:100]!r} is stored: this server keeps no responses (they are "
                        "answered, streamed or not, and forgotten)", param="response_id", code="not_found")


@routes.post("/tokenize")
async def tokenize(body: dict[str, Any], request: Request) -> dict:
    model = ChatCompletionRequest if body.get("messages") is not None else TokenizeRequest
    try:
        parsed = model.model_validate(body)
    except ValidationError as err:
        raise RequestValidationError(err.errors()) from err
    return await _serving(request).tokenize(parsed)


@routes.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    return await _serving(request).detokenize(body)


@lora_routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    try:  # reading the adapter's files is kept off the event loop
        await asyncio.to_thread(_serving(request).models.add, body.lora_name, body.lora_path, None, body.load_inplace)
    except InvalidParameter as err:
        status = 404 if isinstance(err.__cause__, AdapterNotFound) else 400
        raise APIError(status, str(err), param=err.param) from err
    return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} added successfully.")


@lora_routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    _serving(request).models.remove(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter {body.lora_name!r} removed successfully.")


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems, param = [], None
        invalid_json = [error for error in exc.errors() if error.get("type") == "json_invalid"]
        if invalid_json:
            message = f"the request body is not valid JSON: {invalid_json[0].get('msg', '')}"
            return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)
        for error in exc.errors():
            location = [str(part) for part in error.get("loc", ()) if part != "body"]
            param = param or (location[0] if location else None)
            problems.append(f"{'.'.join(location) or 'body'}: {error.get('msg', 'invalid')}")
        message = "invalid request body: " + "; ".join(problems)
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = str(exc.detail)
        if isinstance(exc.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body"
            message = "the request body is JSON nested too deeply to read (nearly a thousand levels)"
        return JSONResponse(error_body(message, type_), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error (see the server log)", "server_error", code=500),
                            status_code=500)
