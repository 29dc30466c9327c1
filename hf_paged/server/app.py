"""The OpenAI-compatible HTTP server: `create_app` builds a FastAPI app over a `ContinuousBatchGenerator`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus). Choices made where OpenAI leaves room:

* ``temperature`` defaults to 1.0, as OpenAI's does; 0 is greedy.
* ``max_tokens`` defaults to 16 on ``/v1/completions`` (OpenAI's legacy default) and, on ``/v1/chat/completions``,
  to the rest of the context (``max_model_len`` minus the prompt), as chat models generate until they stop.
  ``max_completion_tokens`` takes precedence over ``max_tokens``. A limit beyond the context is not an error:
  generation stops at the context's end with ``finish_reason="length"``.
* ``model`` may be omitted (it then means the served model); any other name than the served one is a 404.
* ``/v1/completions`` takes a list of prompts too: prompt ``i``'s ``n`` choices get indices ``i*n .. i*n+n-1``.
* A field of OpenAI's API or of vLLM's extensions that would change the output and is not implemented (``echo``,
  ``suffix``, ``best_of`` above ``n``, beam search, ``tools`` on ``/v1/completions``, ...; see
  ``protocol._UNSUPPORTED``) is a 400 naming it; a field that is not known at all is ignored, as vLLM does.
* ``response_format``, ``structured_outputs`` (and ``guided_*``) and ``tools`` with ``tool_choice`` are served by
  constrained decoding (see ``tool_calls.py`` for the tool-call format). The grammar is compiled before the request
  is queued, so an invalid schema, regex or grammar is a 400 naming the field that carried it.
* With an API key, every ``/v1`` route wants ``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open.
  The key and the body size are checked from the headers before the body is read (`middleware.Gatekeeper`).
* What one call may ask is bounded by `ServerLimits` (prompts per call, ``n``, stop strings, ``logit_bias``,
  logprobs, prompt length before tokenizing); prompts are tokenized on worker threads (`tokenization`).
* Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad parameter or body
  (FastAPI's 422 included), 401 for a missing or wrong key, 404 for an unknown model, 413 for a body over the
  limit, 500 when the engine failed (details go to the log, never to the client), 503 with ``Retry-After`` when
  the server is full. ``/health`` answers 503 once the engine has stopped after an unrecoverable error.
  A stream that fails after it began sends one ``data: {"error": ...}`` event, then ``data: [DONE]``.
* While a stream uses stop strings, the last ``len(longest stop) - 1`` characters are held back until they cannot
  be the start of a stop string, so no text is ever sent that the stop would have cut.
* A client that disconnects aborts its requests, which frees their KV blocks (a non-streaming call notices within
  a second).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from jinja2 import TemplateError
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..generation import ContinuousBatchGenerator, RequestOutput, SamplingParams
from ..generation.outputs import CompletionOutput
from .engine import EngineDead, EngineError, EngineLoop, EngineOverloaded, RequestStream
from .limits import ServerLimits
from .metrics import ServerMetrics
from .middleware import Gatekeeper, overloaded
from .protocol import (
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    GenerationRequest,
    ToolChatFormat,
    error_body,
    usage,
)
from .tokenization import PromptEncoder
from .tool_calls import render_prompt

logger = logging.getLogger(__name__)

REQUEST_FAILED = "generation failed for this request (see the server log)"  # the cause goes to the log only
LARGE_RESPONSE_ENTRIES = 20_000  # tokens x logprobs above which a response's JSON is built off the event loop


def _bad_request(err: Exception, param: str | None) -> APIError:
    """A 400 for a ValueError, naming the SamplingParams field it came from when there is one."""
    message = str(err)
    if getattr(err, "param", None) is not None:  # a protocol.RequestFieldError
        return APIError(400, message, param=err.param)
    field = re.match(r"SamplingParams\.(\w+) ", message)
    if field:
        param, message = field.group(1), message[len("SamplingParams."):]
    return APIError(400, message, param=param)


def create_app(generator: ContinuousBatchGenerator, served_model_name: str, api_key: str | None = None,
               limits: ServerLimits | None = None) -> FastAPI:
    """An app serving ``generator`` under the model name ``served_model_name``, within ``limits``.

    The engine thread starts with the app (or at the first request, if the app runs without its lifespan) and
    stops when the app shuts down. ``app.state.engine`` is the `EngineLoop`; ``app.state.metrics`` its metrics.
    """
    limits = limits or ServerLimits()
    metrics = ServerMetrics()
    engine = EngineLoop(generator, metrics, limits.max_num_waiting, limits.stream_write_timeout)
    encoder = PromptEncoder(generator.inputs, limits.max_chars_per_token, limits.tokenizer_workers)
    decode = encoder.decoder()
    max_num_seqs = generator.scheduler.config.max_num_seqs
    started = int(time.time())

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
    app.state.engine, app.state.metrics, app.state.limits = engine, metrics, limits
    app.add_middleware(Gatekeeper, limits=limits, api_key=api_key)
    _install_error_handlers(app)

    def check_request(body: GenerationRequest) -> None:
        if body.model is not None and body.model != served_model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")
        field = body.unsupported_field()
        if field is not None:
            raise APIError(400, f"{field} is not supported by this server", param=field)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        limits.check_body(body, max_num_seqs)

    async def submit(body: GenerationRequest, prompts: list, params: SamplingParams, request_ids: list[str],
                     prompt_param: str) -> RequestStream:
        """Tokenize the prompts off the event loop, check what the call would cost, and queue it."""
        token_ids = await asyncio.gather(*(encoder.encode(prompt, prompt_param) for prompt in prompts))
        context = generator.max_model_len
        new_tokens = [min(params.max_tokens or context, context - len(ids)) for ids in token_ids]
        limits.check_logprob_entries(body, params.n, new_tokens)
        try:
            return engine.submit(list(token_ids), params, request_ids)
        except ValueError as err:
            raise _bad_request(err, prompt_param) from err
        except EngineOverloaded as err:
            raise overloaded(str(err)) from err
        except EngineDead as err:
            raise APIError(503, str(err), "server_error", code="engine_dead") from err

    async def compile_constraint(body: GenerationRequest) -> None:
        """Compile the request's structured-output grammar (off the loop) so that an invalid one is a 400."""
        constraint = body.constraint()
        if constraint is not None:
            limits.check_constraint(constraint.param, constraint.spec.key[1])
            try:
                await asyncio.wrap_future(generator.grammars.compile(constraint.spec))
            except ValueError as err:
                raise _bad_request(constraint.error(err), constraint.param) from err

    async def serve(body: GenerationRequest, prompts: list, fmt: CompletionFormat, params: SamplingParams,
                    prefix: str, prompt_param: str, request: Request) -> Response:
        """Run one call's requests; answer with a JSON body, or an event stream when ``body.stream``."""
        call_id = f"{prefix}-{uuid.uuid4().hex}"
        request_ids = [f"{call_id}-{i}" for i in range(len(prompts))]
        stream = await submit(body, prompts, params, request_ids, prompt_param)
        header = {"id": call_id, "created": int(time.time()), "model": served_model_name}
        if body.stream:
            events = _sse(stream, fmt, header, params.n, body.include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        finals: dict[str, RequestOutput] = {}
        try:
            async for output in stream.outputs(request.is_disconnected):
                if output.request_id in finals:
                    finals[output.request_id].add(output)
                else:
                    finals[output.request_id] = output
        except EngineError as err:
            raise APIError(500, str(err), "server_error", code=500) from err
        finally:
            stream.close()
        if not all(output.finished for output in finals.values()) or len(finals) < len(request_ids):
            return Response(status_code=499)  # the client has gone: nobody reads this
        if any(output.error is not None for output in finals.values()):
            raise APIError(500, REQUEST_FAILED, "server_error", code=500)
        outputs = [finals[request_id] for request_id in request_ids]
        entries = sum(len(c.token_ids) * (1 + (fmt.top_k or 0)) for o in outputs for c in o.outputs)
        if entries < LARGE_RESPONSE_ENTRIES:
            return _response(header, fmt, outputs, params.n)
        return await asyncio.to_thread(_response, header, fmt, outputs, params.n)

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            body = error_body("the engine has stopped after an unrecoverable error", "server_error", code=503)
            return JSONResponse(body, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": served_model_name, "object": "model", "created": started, "owned_by": "hf_paged",
                "max_model_len": generator.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_request(body)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        limits.check_prompt_count(len(prompts))
        try:
            params = body.to_sampling_params()
        except ValueError as err:
            raise _bad_request(err, None) from err
        await compile_constraint(body)
        fmt = CompletionFormat(decode, body.logprobs)
        return await serve(body, prompts, fmt, params, "cmpl", "prompt", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_request(body)
        try:
            params = body.to_sampling_params()
            messages = [message.to_template_dict() for message in body.messages]
        except ValueError as err:
            raise _bad_request(err, "messages") from err
        await compile_constraint(body)
        prompt, fmt = await chat_prompt(body, messages, (body.top_logprobs or 0) if body.logprobs else None)
        return await serve(body, [prompt], fmt, params, "chatcmpl", "messages", request)

    async def chat_prompt(body: ChatCompletionRequest, messages: list[dict],
                          top_k: int | None) -> tuple[list, ChatFormat]:
        """The prompt to submit and the answer's format; tools and earlier tool calls go through `render_prompt`,
        on a tokenizing thread with its own tokenizer, as every prompt is."""
        if not body.needs_tool_prompt():
            return messages, ChatFormat(decode, top_k)
        encoder.check(messages, "messages", extra_chars=len(str(body.tools or "")))

        def render() -> tuple[str, list[int]]:
            tokenizer = encoder.processor().tokenizer
            text = render_prompt(tokenizer, messages, body.tools)
            return text, tokenizer(text, add_special_tokens=False).input_ids

        try:
            text, token_ids = await asyncio.get_running_loop().run_in_executor(encoder.start(), render)
        except (ValueError, TypeError, TemplateError) as err:
            raise _bad_request(err, "messages") from err
        parser = body.tool_parser(generator.tokenizer, text)
        fmt = ToolChatFormat(decode, top_k, parser) if parser is not None else ChatFormat(decode, top_k)
        return token_ids, fmt

    return app


def _response(header: dict, fmt: CompletionFormat, outputs: list[RequestOutput], n: int) -> Response:
    """The JSON response of a finished call (``outputs`` in prompt order)."""
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, output in enumerate(outputs):
        prompt_tokens += len(output.prompt_token_ids)
        for choice in output.outputs:
            completion_tokens += len(choice.token_ids)
            choices.append(fmt.choice(i * n + choice.index, choice))
    body = {**header, "object": fmt.object, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
    try:
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate, from a "\ud800" escape in tool-call JSON the model wrote
        content = json.dumps(body, separators=(",", ":")).encode()
    return Response(content, media_type="application/json")


async def _sse(stream: RequestStream, fmt: CompletionFormat, header: dict, n: int,
               include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of a streamed call: text deltas per choice, then usage if asked, then ``[DONE]``.

    The engine's deltas never hold a partial stop string; tokens that brought no text yet (an incomplete character)
    wait, with their logprobs, for the chunk that carries their text."""
    chunk = {**header, "object": fmt.chunk_object, **({"usage": None} if include_usage else {})}  # as OpenAI's

    def event(choices: list[dict], **extra) -> str:
        return f"data: {json.dumps({**chunk, 'choices': choices, **extra}, separators=(',', ':'))}\n\n"

    first_index = {request_id: i * n for i, request_id in enumerate(stream.request_ids)}
    waiting: dict[int, CompletionOutput] = {}  # per choice: tokens not sent yet, for want of text
    text_offset: dict[int, int] = {}  # where the next token's text starts (reported with logprobs only)
    prompt_tokens: dict[str, int] = {}
    completion_tokens = 0
    try:
        for index in range(len(first_index) * n):
            opening = fmt.opening_choice(index)
            if opening is not None:
                yield event([opening])
        async for output in stream:
            if output.error is not None:
                raise EngineError(REQUEST_FAILED)
            prompt_tokens[output.request_id] = len(output.prompt_token_ids)
            for choice in output.outputs:
                index = first_index[output.request_id] + choice.index
                completion_tokens += len(choice.token_ids)
                if index in waiting:
                    waiting[index].add(choice)
                    choice = waiting.pop(index)
                if not choice.text and choice.finish_reason is None:
                    waiting[index] = choice
                    continue
                offset = text_offset.get(index, 0)
                yield event([fmt.chunk_choice(index, choice.text, choice.token_ids, choice.logprobs, offset,
                                              choice.finish_reason)])
                if choice.logprobs is not None:
                    text_offset[index] = offset + sum(len(fmt.decode(t)) for t in choice.token_ids)
        if include_usage:
            yield event([], usage=usage(sum(prompt_tokens.values()), completion_tokens))
        yield "data: [DONE]\n\n"
    except EngineError as err:
        yield f"data: {json.dumps(error_body(str(err), 'server_error', code=500))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


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
        return JSONResponse(error_body(str(exc.detail), type_), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error (see the server log)", "server_error", code=500),
                            status_code=500)
