"""`OpenAIServing`: what ``/v1/completions`` and ``/v1/chat/completions`` do with a call, from its parsed body to
its answer (a JSON body, or server-sent events when it streams). `app.create_app` routes calls to it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError

from ..chat_template import render_prompt, template_content
from ..engine_loop import EngineDead, EngineError, EngineLoop, EngineOverloaded, EngineStopping, RequestStream
from ..generation import ContinuousBatchGenerator, RequestOutput, SamplingParams
from ..generation.outputs import CompletionOutput
from ..lora import LoRARequest
from ..reasoning import ReasoningParser
from ..pooling import PoolingConfig, check_dimensions, cosine_scores, embed, padded_batches, score_pairs
from .embeddings import EmbeddingRequest, embedding_response
from .limits import ServerLimits
from .middleware import overloaded
from .models import ServedModels
from .options import ServingOptions
from .protocol import (
    APIError,
    ChatCompletionRequest,
    ChatFormat,
    CompletionFormat,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    ToolChatFormat,
    error_body,
    usage,
)
from .responses import ResponseEvents, ResponsesRequest, output_items, renamed, response_usage
from .scores import RerankRequest, ScoreRequest, rerank_response, score_response
from .tokenization import PromptEncoder, check_text

logger = logging.getLogger(__name__)
REQUEST_FAILED = "generation failed for this request (see the server log)"  # the cause goes to the log only
LARGE_RESPONSE_ENTRIES = 20_000  # tokens x logprobs above which a response's JSON is built off the event loop


class OpenAIServing:
    """Checks a call, compiles its constraint, tokenizes its prompts, queues it on the engine and answers it."""

    def __init__(self, generator: ContinuousBatchGenerator, engine: EngineLoop, encoder: PromptEncoder,
                 limits: ServerLimits, served_model_names: list[str], options: ServingOptions):
        self.generator, self.engine, self.encoder, self.limits = generator, engine, encoder, limits
        self.options = options
        self.reasoning = generator.config.reasoning_parser is not None  # chat replies' reasoning answered apart
        self.models = ServedModels(served_model_names, generator)
        # What a request leaves out of its sampling settings.
        self.sampling_defaults = options.sampling_defaults(getattr(generator.model, "generation_config", None))
        if self.sampling_defaults:
            logger.info("sampling settings a request leaves out: %s", self.sampling_defaults)
        self.content_format = options.content_format(generator.tokenizer.chat_template)
        try:  # how embeddings are pooled, or why they cannot be (generation is served all the same)
            self.pooling: PoolingConfig | ValueError = options.pooling_of(generator.model)
        except ValueError as err:
            self.pooling = err.with_traceback(None)  # its frames would hold this object in a cycle
        self.decode = encoder.decoder()

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_request(body)
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "the prompt is empty", param="prompt")
        self.limits.check_prompt_count(len(prompts))
        try:
            params = body.to_sampling_params(self.sampling_defaults)
        except ValueError as err:
            raise _bad_request(err, None) from err
        await self.compile_constraint(body)
        echo = [p if isinstance(p, str) else await self.encoder.text(p, "prompt") for p in prompts] \
            if body.echo else None
        fmt = CompletionFormat(self.decode, body.logprobs, echo, prompt_only=bool(body.echo) and body.max_tokens == 0)
        return await self.serve(body, prompts, fmt, params, "cmpl", "prompt", request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        prompt, fmt, params = await self.chat_call(body, "messages")
        return await self.serve(body, [prompt], fmt, params, "chatcmpl", "messages", request)

    async def chat_call(self, body: ChatCompletionRequest, param: str) -> tuple[list, ChatFormat, SamplingParams]:
        """A chat request checked, its constraint compiled and its prompt rendered: the prompt, the answer's format
        and the sampling parameters (a bad field is a 400, naming ``param`` when it names none itself)."""
        self.check_request(body)
        try:
            params = body.to_sampling_params(self.sampling_defaults)
            messages = [message.to_template_dict(self.content_format) for message in body.messages]
        except ValueError as err:
            raise _bad_request(err, param) from err
        await self.compile_constraint(body)
        prompt, fmt = await self.chat_prompt(body, messages, (body.top_logprobs or 0) if body.logprobs else None)
        fmt.role = self.options.response_role if body.add_generation_prompt else body.messages[-1].role
        return prompt, fmt, params

    async def responses(self, body: ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API: the request runs as the chat request it makes, answered as output items."""
        check_text(body.user or "", "user")  # both are given back in the answer
        check_text(body.metadata or {}, "metadata")
        try:
            chat = body.to_chat()
        except ValueError as err:
            raise _bad_request(err, "input") from err
        events = ResponseEvents(body, self.models.name(body.model))
        try:
            prompt, fmt, params = await self.chat_call(chat, "input")
            body.temperature, body.top_p = params.temperature, params.top_p  # echoed as used, as vLLM echoes them
            stream = await self.submit(chat, [prompt], params, [events.id], "input")
            if body.stream:
                return EventStream(_response_events(stream, fmt, events, self.count_tokens), stream.close,
                                   media_type="text/event-stream")
            outputs = await _finished_outputs(stream, [events.id], request)
        except APIError as err:
            raise renamed(err) from None
        if outputs is None:
            return Response(status_code=499)  # the client has gone: nobody reads this
        output, completion = outputs[0], outputs[0].outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        message = fmt.choice(0, completion)["message"]
        reasoning_tokens = min(len(completion.token_ids), await self.count_tokens(fmt.reasoned.get(0)))
        used = response_usage(len(output.prompt_token_ids), len(completion.token_ids), output.num_cached_tokens,
                              reasoning_tokens)
        items = output_items(message, status)
        return JSONResponse(body.answer(events.id, events.created, events.model, status, items, used))

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """OpenAI's ``/v1/embeddings``: each input's pooled last hidden state (`hf_paged.pooling`), computed on the
        engine thread, one padded batch of at most `pooling.BATCH_TOKENS` tokens between two generation steps."""
        self.check_pooling(body.model)
        try:
            check_dimensions(self.generator.model, body.dimensions)
        except ValueError as err:
            raise APIError(400, str(err), param="dimensions") from None
        if body.messages is not None:
            token_ids = [await self.conversation_input(body.chat())]
        else:
            token_ids = await self.embedding_inputs(body.inputs(), "input", body.truncate_prompt_tokens,
                                                    body.add_special_tokens)
        vectors = await self.embedded(token_ids, body.dimensions, request, body.normalize)
        if vectors is None:
            return Response(status_code=499)
        tokens, name = sum(map(len, token_ids)), self.models.name(body.model)
        # Thousands of vectors take seconds to write as JSON: off the event loop every stream shares.
        return await asyncio.to_thread(lambda: JSONResponse(embedding_response(vectors, body, name, tokens)))

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        """vLLM's ``/score`` (`scores`): the cosine similarity of each pair's embeddings."""
        self.check_pooling(body.model)
        scores, tokens = await self.scored(body.text_1, body.text_2, ("text_1", "text_2"), body.truncate_prompt_tokens,
                                           request)
        if scores is None:
            return Response(status_code=499)
        return JSONResponse(score_response(scores, self.models.name(body.model), tokens))

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        """vLLM's ``/rerank`` (`scores`): the documents by their embeddings' cosine similarity to the query's."""
        self.check_pooling(body.model)
        scores, tokens = await self.scored(body.query, body.documents, ("query", "documents"),
                                           body.truncate_prompt_tokens, request)
        if scores is None:
            return Response(status_code=499)
        return JSONResponse(rerank_response(scores, body.documents, body.top_n, self.models.name(body.model), tokens))

    def check_pooling(self, model: str | None) -> None:
        """A 400 where this server embeds nothing for a request naming ``model``."""
        if self.check_model(model) is not None:
            raise APIError(400, "embeddings are of the served model: LoRA adapters do not apply to them",
                           param="model")
        if self.generator.is_tensor_parallel:
            raise APIError(400, "embeddings are not served under tensor parallelism", param="model")
        if isinstance(self.pooling, ValueError):
            raise APIError(400, f"embeddings of this model are not served: {self.pooling} (--pooler-config chooses "
                                "a pooling)", param="model")

    async def scored(self, first: str | list[str], second: str | list[str], names: tuple[str, str], keep: int | None,
                     request: Request) -> tuple[list[float] | None, int]:
        """The scores of the pairs of ``first`` and ``second`` (a text or a list of them; `pooling.score_pairs`, the
        fields' ``names`` naming them in errors) and how many tokens were embedded; None for the scores if the client
        left. The two sides together are bounded by ``--max-embedding-inputs``."""
        sides = [[texts] if isinstance(texts, str) else texts for texts in (first, second)]
        try:
            pairs = score_pairs(len(sides[0]), len(sides[1]), names)
        except ValueError as err:
            raise APIError(400, str(err), param=names[1] if sides[0] else names[0]) from None
        self.limits.check_embedding_inputs(len(sides[0]) + len(sides[1]), names[1])
        ids = await self.embedding_inputs(first, names[0], keep) + await self.embedding_inputs(second, names[1], keep)
        vectors = await self.embedded(ids, None, request)
        if vectors is None:
            return None, 0
        return cosine_scores(vectors[:len(sides[0])], vectors[len(sides[0]):], pairs), sum(map(len, ids))

    async def embedded(self, token_ids: list[list[int]], dimensions: int | None, request: Request,
                       normalize: bool | None = None) -> list[list[float]] | None:
        """The embeddings of ``token_ids`` (None if the client left between two batches), normalized as the model's
        pooling says unless ``normalize`` says otherwise."""
        pooling = self.pooling if normalize is None else dataclasses.replace(self.pooling, normalize=normalize)
        vectors: list[list[float]] = [[]] * len(token_ids)
        for number, batch in enumerate(padded_batches([len(ids) for ids in token_ids])):
            if number and await request.is_disconnected():
                return None
            prompts = [token_ids[i] for i in batch]
            done = await self._on_engine(lambda prompts=prompts: embed(self.generator.model, prompts, pooling,
                                                                       dimensions))
            for index, vector in zip(batch, done):
                vectors[index] = vector
        broken = await asyncio.to_thread(lambda: next((i for i, vector in enumerate(vectors)
                                                       if not all(map(math.isfinite, vector))), None))
        if broken is not None:
            raise APIError(500, f"the embedding of input {broken} is not finite: the model's hidden states "
                                f"overflowed in {self.generator.model.dtype}", "server_error", code=500)
        if self.engine.metrics is not None:
            self.engine.metrics.observe_pooled([len(ids) for ids in token_ids])
        return vectors

    async def embedding_inputs(self, inputs: str | list, param: str, keep: int | None,
                               add_special_tokens: bool = True) -> list[list[int]]:
        """The token ids of the text or the list of texts (or of token ids) ``inputs`` of the field ``param``, checked
        (a 400 naming the field, and which of its inputs)."""
        listed = [inputs] if isinstance(inputs, str) else inputs
        if not listed:
            raise APIError(400, "the input is empty" if param == "input" else f"{param} is empty", param=param)
        self.limits.check_embedding_inputs(len(listed), param)
        wheres = [param if listed is not inputs else f"input {i}" if param == "input" else f"{param}[{i}]"
                  for i in range(len(listed))]
        return list(await asyncio.gather(*(self._embedding_input(text, param, where, keep, add_special_tokens)
                                           for text, where in zip(listed, wheres))))

    async def conversation_input(self, chat: ChatCompletionRequest) -> list[int]:
        """The token ids of a conversation to embed, rendered as a chat completion's prompt is."""
        return await self._embedding_input(await self.rendered_chat(chat), "messages", "messages",
                                           chat.truncate_prompt_tokens, chat.add_special_tokens)

    async def rendered_chat(self, chat: ChatCompletionRequest) -> list:
        """The prompt a chat request's messages make (with its tools and template options), as `chat_prompt`
        renders it: token ids, or the messages where the engine renders them itself. A field the chat endpoint
        refuses (``chat_template``) is refused here too."""
        unsupported = chat.unsupported_field()
        if unsupported is not None:
            raise APIError(400, unsupported[1], param=unsupported[0])
        try:
            messages = [message.to_template_dict(self.content_format) for message in chat.messages]
        except ValueError as err:
            raise _bad_request(err, "messages") from err
        return (await self.chat_prompt(chat, messages, None))[0]

    async def _embedding_input(self, text: str | list[int], param: str, where: str, keep: int | None,
                               add_special_tokens: bool) -> list[int]:
        try:
            ids = await self.encoder.encode(text, param, keep, add_special_tokens, pooling=True)
            self.generator.inputs.check_token_ids(ids)
        except APIError as err:
            raise APIError(err.status, f"{where}: {err.message}", param=err.param or param) from None
        except ValueError as err:
            raise APIError(400, f"{where}: {err}", param=param) from None
        if not ids:
            raise APIError(400, f"{where} is empty", param=param)
        return ids

    async def _on_engine(self, fn):
        """``fn()`` run on the engine thread (`EngineLoop.call`); a failure is a 503 (the engine stopping) or a 500."""
        try:
            return await asyncio.wrap_future(self.engine.call(fn))
        except EngineError as err:
            raise APIError(503, str(err), "server_error", code=503) from err
        except Exception as err:
            logger.exception("a call on the engine thread failed")
            raise APIError(500, REQUEST_FAILED, "server_error", code=500) from err

    async def count_tokens(self, text: str | None) -> int:
        """How many tokens ``text`` is alone (no special tokens added), counted on a tokenizing thread: a response's
        reasoning tokens, as the reasoning text tokenizes (not always as the model wrote it)."""
        if not text:
            return 0

        def count() -> int:
            return len(self.encoder.processor().tokenizer(text, add_special_tokens=False).input_ids)

        return await asyncio.get_running_loop().run_in_executor(self.encoder.start(), count)

    async def tokenize(self, body: TokenizeRequest | ChatCompletionRequest) -> dict:
        """vLLM's ``/tokenize``: the token ids the server would run for a completion's prompt or a chat's messages
        (with its template options and tools), their count (of a prompt longer than the context too, up to the
        characters it could hold), the context, and with ``return_token_strs`` each token as the tokenizer spells
        it."""
        self.check_model(body.model)
        if isinstance(body, ChatCompletionRequest):
            prompt, param = await self.rendered_chat(body), "messages"
        else:
            prompt, param = body.prompt, "prompt"
        token_ids = await self.encoder.encode(prompt, param, None, body.add_special_tokens, measured=False)
        spelled = None
        if getattr(body, "return_token_strs", False) is True:
            spelled = await asyncio.get_running_loop().run_in_executor(
                self.encoder.start(), lambda: self.encoder.processor().tokenizer.convert_ids_to_tokens(token_ids))
        return {"count": len(token_ids), "max_model_len": self.generator.max_model_len, "tokens": token_ids,
                "token_strs": spelled}

    async def detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's ``/detokenize``: the text of token ids (a 400 for ids outside the vocabulary)."""
        self.check_model(body.model)
        return {"prompt": await self.encoder.text(body.tokens, "tokens")}

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the served model); a 404 for a name not served."""
        return self.models.lora(model)

    def check_request(self, body: GenerationRequest) -> None:
        self.check_model(body.model)
        unsupported = body.unsupported_field()
        if unsupported is not None:
            raise APIError(400, unsupported[1], param=unsupported[0])
        ignored = body.ignored_fields()
        if ignored:
            logger.warning("request fields ignored (not known to this server): %r", ignored[:20])
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        whole = body.count_whole_vocabulary(self.generator.inputs.vocab_size)
        self.limits.check_body(body, self.generator.config.max_num_seqs, self.generator.inputs.vocab_size, whole)

    async def compile_constraint(self, body: GenerationRequest) -> None:
        """Compile the request's structured-output grammar (off the loop) so that an invalid one is a 400."""
        constraint = body.constraint()
        if constraint is not None:
            self.limits.check_constraint(constraint.param, constraint.spec.key[1])
            try:
                await asyncio.wrap_future(self.generator.compile_constraint(constraint.spec))
            except ValueError as err:
                # The compile is cached, and its one error raised again for every request repeating the constraint
                # would keep each raise's frames (request bodies included) in its traceback: a copy goes on.
                err.__traceback__ = None
                raise _bad_request(constraint.error(ValueError(str(err))), constraint.param) from None

    async def chat_prompt(self, body: ChatCompletionRequest, messages: list[dict],
                          top_k: int | None) -> tuple[list, ChatFormat]:
        """The prompt to submit and the answer's format; tools, earlier tool calls and template options go through
        `render_prompt`, on a tokenizing thread with its own tokenizer, as every prompt is."""
        try:
            if not body.needs_own_rendering() and not self.reasoning:  # the reasoning parser reads the prompt
                return messages, ChatFormat(self.decode, top_k)
            options = body.template_options()
        except ValueError as err:
            raise _bad_request(err, "messages") from err
        extra = len(str(body.tools or "")) + len(str(options))
        if body.truncate_prompt_tokens is None:  # a prompt to truncate is measured once tokenized
            self.encoder.check(messages, "messages", extra_chars=extra)
        check_text(body.tools or [], "tools")
        check_text(options, "chat_template_kwargs")

        def render() -> tuple[str, list[int]]:
            tokenizer = self.encoder.processor().tokenizer
            text = render_prompt(tokenizer, messages, body.tools, options, self.content_format == "openai")
            return text, tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids

        try:
            text, token_ids = await asyncio.get_running_loop().run_in_executor(self.encoder.start(), render)
        except (ValueError, TypeError, TemplateError) as err:
            raise _bad_request(err, "messages") from err
        parser = body.tool_parser(self.generator.tokenizer, text)
        # A constraint (response_format, tool_choice required or named) starts after the reasoning (the engine's
        # `ReasoningEnd` reads the same prompt), so the content is what it constrains.
        continued = template_content(messages[-1].get("content") or "") if body.continue_final_message and messages \
            else None
        reasoning = ReasoningParser(text, self.generator.config.reasoning_parser, continued) if self.reasoning else None
        if parser is None:
            return token_ids, ChatFormat(self.decode, top_k, reasoning, body.include_reasoning)
        return token_ids, ToolChatFormat(self.decode, top_k, parser, reasoning, body.include_reasoning,
                                         one_call=body.parallel_tool_calls is False)

    async def submit(self, body: GenerationRequest, prompts: list, params: SamplingParams, request_ids: list[str],
                     prompt_param: str, call_id: str | None = None) -> RequestStream:
        """Tokenize the prompts off the event loop, check what the call would cost, and queue it (``call_id``: the
        answer's id, which the request log names)."""
        keep = params.truncate_prompt_tokens
        token_ids = await asyncio.gather(*(self.encoder.encode(prompt, prompt_param, keep, body.add_special_tokens)
                                           for prompt in prompts))
        await self.encoder.tokenize_bad_words(params)
        context = self.generator.max_model_len
        for ids in token_ids:
            _check_room(body, len(ids), context)
        lengths = [len(ids) for ids in token_ids]
        room = self.limits.logprob_room(body, params.n, lengths)
        if room and body.token_limit()[1] is None:  # a default limit gives way: the answer stops sooner ("length")
            params.max_tokens = min(params.max_tokens or context, room)
        new_tokens = [min(params.max_tokens or context, context - length) for length in lengths]
        self.limits.check_logprob_entries(body, params.n, new_tokens, lengths)
        lora = self.check_model(body.model)
        if lora is not None:  # read off the event loop if it was dropped since (--max-cpu-loras)
            try:
                lora = await asyncio.to_thread(self.generator.load_lora, lora)
            except ValueError as err:
                raise APIError(500, f"the adapter {lora.lora_name!r} cannot be loaded again: {err}",
                               "server_error", code=500) from err
        try:
            salted = [ids if body.cache_salt is None else {"prompt_token_ids": ids, "cache_salt": body.cache_salt}
                      for ids in token_ids]
            stream = self.engine.submit(salted, params, request_ids, lora, body.priority)
        except ValueError as err:
            raise _bad_request(err, prompt_param) from err
        except EngineOverloaded as err:
            raise overloaded(str(err)) from err
        except EngineDead as err:
            raise APIError(503, str(err), "server_error", code="engine_dead") from err
        stream.num_prompt_tokens, stream.prompt_token_ids = sum(map(len, token_ids)), list(token_ids)
        if self.options.log_requests:
            for request_id, prompt, ids in zip(request_ids, prompts, token_ids):
                self.log_request(request_id, prompt, ids, params, call_id or request_id)
        return stream

    def log_request(self, request_id: str, prompt, token_ids: list[int], params: SamplingParams,
                    call_id: str) -> None:
        """vLLM's ``--enable-log-requests``: a queued request's prompt, its token ids (each cut to ``max_log_len``)
        and its sampling parameters, with the id of the answer it is part of (the X-Request-Id's)."""
        cut = self.options.max_log_len
        text = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
        logger.info("request %s queued (answer %s): prompt %r, prompt_token_ids %s, %r", request_id, call_id,
                    text[:cut], token_ids[:cut], params)

    async def serve(self, body: GenerationRequest, prompts: list, fmt: CompletionFormat, params: SamplingParams,
                    prefix: str, prompt_param: str, request: Request) -> Response:
        """Run one call's requests; answer with a JSON body, or an event stream when ``body.stream``."""
        call_id = f"{prefix}-{getattr(request.state, 'request_id', None) or uuid.uuid4().hex}"  # X-Request-Id's
        engine_id = f"{prefix}-{uuid.uuid4().hex}"  # unique in the engine, whatever ids clients send
        request_ids = [f"{engine_id}-{i}" for i in range(len(prompts))]
        stream = await self.submit(body, prompts, params, request_ids, prompt_param, call_id)
        header = {"id": call_id, "created": int(time.time()), "model": self.models.name(body.model)}
        fmt.prompt_top, fmt.return_token_ids = body.prompt_logprobs, bool(body.return_token_ids)
        fmt.tokens_as_ids = self.options.return_tokens_as_token_ids if body.return_tokens_as_token_ids is None \
            else body.return_tokens_as_token_ids
        if body.stream:
            events = _sse(stream, fmt, header, params.n, body.include_usage, body.continuous_usage)
            return EventStream(events, stream.close, media_type="text/event-stream")
        outputs = await _finished_outputs(stream, request_ids, request)
        if outputs is None:
            return Response(status_code=499)  # the client has gone: nobody reads this
        per_prompt_token = body.prompt_logprob_entries(params.n)  # echo's and prompt_logprobs', as the limit counts
        entries = sum(len(c.token_ids) * (1 + (fmt.top_k or 0)) for o in outputs for c in o.outputs) \
            + per_prompt_token * sum(len(o.prompt_token_ids) for o in outputs)
        if entries < LARGE_RESPONSE_ENTRIES:
            return _response(header, fmt, outputs, params.n)
        return await asyncio.to_thread(_response, header, fmt, outputs, params.n)


class EventStream(StreamingResponse):
    """A streamed response that calls ``on_close`` however it ends: also when the client left before the first piece
    went out, where the pieces' generator never started (so never ran its own ``finally``) and the requests behind
    it would run on, unread, to their last token."""

    def __init__(self, pieces: AsyncIterator, on_close: Callable[[], None], **kwargs):
        super().__init__(pieces, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _bad_request(err: Exception, param: str | None) -> APIError:
    """A 400 for a ValueError, naming the parameter at fault: its own (an `InvalidParameter`), else ``param``."""
    return APIError(400, str(err).removeprefix("SamplingParams."), param=getattr(err, "param", None) or param)


def _check_room(body: GenerationRequest, prompt_tokens: int, context: int) -> None:
    """A 400 when the prompt leaves less room in the context than the token limit the call sets, as vLLM's (a
    default limit just stops at the context's end; a prompt that does not fit at all is the engine's refusal)."""
    param, limit = body.token_limit()
    if limit is None or prompt_tokens >= context or prompt_tokens + limit <= context:
        return
    raise APIError(400, f"'{param}' is too large: {limit}. This model's maximum context length is {context} tokens "
                        f"and your request has {prompt_tokens} input tokens ({limit} > {context} - {prompt_tokens})",
                   param=param)


async def _finished_outputs(stream: RequestStream, request_ids: list[str],
                            request: Request) -> list[RequestOutput] | None:
    """The call's final outputs in prompt order, or None when the client left before they were all in."""
    finals: dict[str, RequestOutput] = {}
    try:
        async for output in stream.outputs(request.is_disconnected):
            if output.request_id in finals:
                finals[output.request_id].add(output)
            else:
                finals[output.request_id] = output
    except EngineError as err:
        status = 503 if isinstance(err, EngineStopping) else 500
        raise APIError(status, str(err), "server_error", code=status) from err
    finally:
        stream.close()
    if not all(output.finished for output in finals.values()) or len(finals) < len(request_ids):
        return None
    failed = next((output for output in finals.values() if output.error is not None), None)
    if failed is not None:
        raise _failure(failed)
    return [finals[request_id] for request_id in request_ids]


def _failure(output: RequestOutput) -> APIError:
    """A failed request's error: its own parameters' doing (a 400 naming the parameter, its message the client's to
    read), or the server's (a 500; the cause is told only to the log)."""
    if output.error_param is not None:
        return _bad_request(ValueError(output.error), output.error_param)
    return APIError(500, REQUEST_FAILED, "server_error", code=500)


def _error_event(err: EngineError | APIError) -> dict:
    """The error a stream ends with."""
    if isinstance(err, APIError):
        return err.body()
    return error_body(str(err), "server_error", code=503 if isinstance(err, EngineStopping) else 500)


def _prompt_fields(fmt: CompletionFormat, output: RequestOutput, scored: list | None) -> dict:
    """What a response says of a prompt when asked: vLLM's ``prompt_logprobs`` and ``prompt_token_ids``."""
    fields = {} if scored is None else {"prompt_logprobs": scored}
    return {**fields, "prompt_token_ids": output.prompt_token_ids} if fmt.return_token_ids else fields


class _StreamedTokenIds:
    """vLLM's ``return_token_ids`` in a stream: each chunk's choice carries the token ids generated since its last
    chunk (ids whose text was held back wait); a chat's opening chunk (the role) carries its prompt's ids, a
    completion choice's first chunk its prompt's, as vLLM's."""

    def __init__(self, fmt: CompletionFormat):
        self.fmt, self.pending, self.started = fmt, {}, set()

    def opening(self, index: int, stream: RequestStream) -> dict:
        """What a chat choice's opening chunk carries at its top."""
        if not self.fmt.return_token_ids:
            return {}
        self.started.add(index)
        return {"prompt_token_ids": stream.prompt_token_ids[0]}

    def add(self, index: int, token_ids: list[int]) -> int:
        """Take a choice's new token ids; returns how many."""
        if self.fmt.return_token_ids:
            self.pending.setdefault(index, []).extend(token_ids)
        return len(token_ids)

    def attach(self, index: int, sent: dict, output: RequestOutput) -> dict:
        """Put them in the choice ``sent``; returns ``sent``."""
        if self.fmt.return_token_ids:
            sent["token_ids"] = self.pending.pop(index, [])
            if index not in self.started:
                self.started.add(index)
                sent["prompt_token_ids"] = output.prompt_token_ids
        return sent


def _response(header: dict, fmt: CompletionFormat, outputs: list[RequestOutput], n: int) -> Response:
    """The JSON response of a finished call (``outputs`` in prompt order)."""
    choices, prompt_tokens, completion_tokens, scored = [], 0, 0, None
    cached_tokens = sum(output.num_cached_tokens for output in outputs)
    for i, output in enumerate(outputs):
        prompt_tokens += len(output.prompt_token_ids)
        scored = fmt.prompt_logprobs(output)
        for choice in output.outputs:
            generated = [] if fmt.prompt_only else choice.token_ids
            completion_tokens += len(generated)
            choice = fmt.echoed(i, output, choice) if fmt.echo is not None else choice
            choices.append(fmt.choice(i * n + choice.index, choice))
            if fmt.return_token_ids:
                choices[-1]["token_ids"] = generated
            if fmt.prompt_fields_at == "choice":
                choices[-1].update(_prompt_fields(fmt, output, scored))
    body = {**header, "object": fmt.object, "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
    if fmt.prompt_fields_at == "response":  # chat: one prompt
        body.update(_prompt_fields(fmt, outputs[0], scored))
    try:
        content = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except UnicodeEncodeError:  # a lone surrogate, from a "\ud800" escape in tool-call JSON the model wrote
        content = json.dumps(body, separators=(",", ":")).encode()
    return Response(content, media_type="application/json")


async def _sse(stream: RequestStream, fmt: CompletionFormat, header: dict, n: int, include_usage: bool,
               continuous_usage: bool = False) -> AsyncIterator[str]:
    """Server-sent events of a streamed call: text deltas per choice (with the usage of that choice so far, if
    continuous: its prompt's tokens and its own, as vLLM's), then usage if asked, then ``[DONE]``. Tokens that brought
    no text yet (an incomplete character) wait, with their logprobs, for the chunk that carries their text."""
    chunk = {**header, "object": fmt.chunk_object, **({"usage": None} if include_usage else {})}  # as OpenAI's

    def event(choices: list[dict], last: bool = False, extra: dict | None = None) -> str:
        body = {**chunk, **(extra or {}), "choices": choices}
        if last:
            body["usage"] = usage(stream.num_prompt_tokens, sum(generated.values()), sum(cached.values()))
        elif continuous_usage:
            index = choices[0]["index"]
            body["usage"] = usage(len(stream.prompt_token_ids[index // n]), generated.get(index, 0))
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    first_index = {request_id: i * n for i, request_id in enumerate(stream.request_ids)}
    waiting: dict[int, CompletionOutput] = {}  # per choice: tokens not sent yet, for want of text
    text_offset: dict[int, int] = {}  # where the next token's text starts (reported with logprobs only)
    token_ids = _StreamedTokenIds(fmt)
    generated: dict[int, int] = {}  # tokens per choice
    cached: dict[str, int] = {}  # prompt tokens read from the prefix cache, per request
    try:
        for index, opening in enumerate(map(fmt.opening_choice, range(len(first_index) * n))):
            if opening is not None:
                yield event([opening], extra=token_ids.opening(index, stream))
        async for output in stream:
            if output.error is not None:
                raise _failure(output)
            for choice in output.outputs:
                index = first_index[output.request_id] + choice.index
                added = token_ids.add(index, [] if fmt.prompt_only else choice.token_ids)
                generated[index] = generated.get(index, 0) + added
                cached[output.request_id] = output.num_cached_tokens
                if fmt.echo is not None and index not in text_offset:  # its first chunk: the prompt goes first
                    choice = fmt.echoed(index // n, output, choice)
                    text_offset[index] = 0
                if (choice := _after_waiting(waiting, index, choice)) is None:
                    continue
                offset = text_offset.get(index, 0)
                if sent := fmt.chunk_choice(index, choice.text, choice.token_ids, choice.logprobs, offset,
                                            choice.finish_reason, choice.stop_reason):
                    yield event([token_ids.attach(index, sent, output)])
                if choice.logprobs is not None:
                    text_offset[index] = fmt.text_offsets(choice.token_ids, offset)[1]
        if include_usage:
            yield event([], last=True)
        yield "data: [DONE]\n\n"
    except (EngineError, APIError) as err:
        yield f"data: {json.dumps(_error_event(err))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        stream.close()


def _after_waiting(waiting: dict[int, CompletionOutput], index: int,
                   choice: CompletionOutput) -> CompletionOutput | None:
    """Choice ``index``'s new output after the tokens waiting for their text; None while it still brings no text and
    does not end the choice (it waits with them)."""
    if index in waiting:
        waiting[index].add(choice)
        choice = waiting.pop(index)
    if not choice.text and choice.finish_reason is None:
        waiting[index] = choice
        return None
    return choice


async def _response_events(stream: RequestStream, fmt: ChatFormat, events: ResponseEvents,
                           count_tokens: Callable[[str], Awaitable[int]]) -> AsyncIterator[str]:
    """Server-sent events of a streamed response (see `responses.ResponseEvents`); a failure ends it with an
    ``error`` event and ``response.failed``."""
    output_tokens, cached, status = 0, 0, "completed"
    try:
        for event in events.start():
            yield event
        async for output in stream:
            if output.error is not None:
                raise _failure(output)
            cached = output.num_cached_tokens
            for choice in output.outputs:
                output_tokens += len(choice.token_ids)
                status = "incomplete" if choice.finish_reason == "length" else status
                sent = fmt.chunk_choice(0, choice.text, choice.token_ids, None, 0, choice.finish_reason)
                for event in events.delta(sent["delta"] if sent else {}):
                    yield event
        reasoning_tokens = min(output_tokens, await count_tokens(fmt.reasoned.get(0)))
        for event in events.finish(status, response_usage(stream.num_prompt_tokens, output_tokens, cached,
                                                          reasoning_tokens)):
            yield event
    except (EngineError, APIError) as err:
        error = _error_event(renamed(err) if isinstance(err, APIError) else err)["error"]
        yield events.event("error", code=error.get("code"), message=error["message"], param=error.get("param"))
        yield events.failed(error)
    finally:
        stream.close()
