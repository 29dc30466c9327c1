"""`AsyncLLM`: vLLM's asynchronous entry point (``async for output in engine.generate(...)``) over the engine."""

from __future__ import annotations

import asyncio
import atexit
import copy
import dataclasses
import os
import uuid
import weakref
from collections.abc import AsyncIterator, Iterable

from transformers import GenerationConfig

from .engine_args import EngineArgs
from .engine_loop import EngineLoop
from .generation import ContinuousBatchGenerator, RequestOutput, RequestOutputKind, SamplingParams
from .generation.inputs import Prompt, prompt_cache_salt, tokenize_prompt
from .local_ranks import start_engine
from .lora import LoRARequest

# How long `generate` waits for a request given up to release the id it reuses (one engine step, as a rule).
RELEASE_TIMEOUT_S = 30.0


class AsyncLLM:
    """Serves requests from asyncio code, as vLLM's ``AsyncLLM``: each `generate` call is one request, batched with
    all others in flight by one engine thread that steps a `ContinuousBatchGenerator` while there is work.

    ``AsyncLLM(model, dtype, device, **engine_options)`` loads a model as `LLM` does (``tensor_parallel_size`` and
    ``quantization`` too: `shutdown` then ends the other ranks for good); `from_engine_args` takes the same as vLLM's
    `AsyncEngineArgs`, and `from_generator` serves a generator already built. Requests that
    fail while running yield an output with ``error`` set, as the generator's; `hf_paged.engine_loop.EngineError` is
    raised when the engine itself failed or was shut down under them.
    """

    def __init__(self, model: str | os.PathLike | None = None, dtype: str = "auto", device: str = "auto",
                 trust_remote_code: bool = False, tokenizer: str | os.PathLike | None = None,
                 tensor_parallel_size: int = 1, quantization: str | None = None, revision: str | None = None,
                 download_dir: str | os.PathLike | None = None, load_format: str = "auto", **engine_options):
        generator, ranks = start_engine(model, dtype, device, trust_remote_code, tokenizer, engine_options,
                                        tensor_parallel_size, quantization, revision, download_dir, load_format)
        self._serve(generator)
        if ranks is not None:  # the engine thread's heartbeats stop before the ranks do
            self._ranks = weakref.finalize(self, _stop_ranks, self.engine, ranks)
            # At exit too: before the ranks' own handler (registered earlier, so run later), whose stop the
            # engine thread would otherwise meet mid-step and report as its failure.
            atexit.register(self._ranks)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "AsyncLLM":
        """vLLM's way to make one: the model and the engine options of an `AsyncEngineArgs` (or `EngineArgs`)."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(f"from_engine_args takes hf_paged's AsyncEngineArgs, got {type(engine_args).__name__}")
        return cls(**engine_args.keyword_arguments())

    @classmethod
    def from_generator(cls, generator: ContinuousBatchGenerator) -> "AsyncLLM":
        """Serve ``generator``, which nothing else may step meanwhile."""
        engine = cls.__new__(cls)
        engine._serve(generator)
        return engine

    _ranks: weakref.finalize | None = None

    def _serve(self, generator: ContinuousBatchGenerator) -> None:
        if not generator.is_driver:
            raise ValueError("AsyncLLM serves rank 0 of a tensor-parallel model; the other ranks call run_worker()")
        self.generator = generator
        # The event loop's own tokenizer: a fast tokenizer used from two threads at once can raise "Already borrowed",
        # and the engine thread detokenizes with the generator's.
        self.tokenizer = copy.deepcopy(generator.tokenizer)
        self.engine = EngineLoop(generator)
        self.engine.start()
        weakref.finalize(self, self.engine.release).atexit = False  # dropped without shutdown(): the thread ends

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | GenerationConfig | None = None,
                       request_id: str | None = None, lora_request: LoRARequest | None = None, priority: int = 0,
                       ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as ``sampling_params.output_kind`` asks (by default each time it grows, with
        everything generated so far); the last has ``finished`` set. A generator closed early (left by ``break``
        and released, or ``aclose()``d) aborts its request, as vLLM's. Raises ``ValueError`` for a prompt or
        parameters the engine refuses (an invalid constraint too), before anything is yielded. ``lora_request`` runs
        it under that LoRA adapter (an engine with ``enable_lora``; `add_lora` loads one ahead of its first request);
        ``priority`` as in `ContinuousBatchGenerator.add_request`."""
        params = self.generator.inputs.sampling_params(sampling_params)
        kind = params.output_kind
        deltas = params.replace(output_kind=RequestOutputKind.DELTA)
        # Tokenized here, not under the engine loop's lock (the bad words' tokens are kept in ``deltas``).
        text, token_ids = tokenize_prompt(self.tokenizer, prompt)
        deltas.bad_words_token_ids(self.tokenizer)
        compiled = self.generator.compile_constraint(deltas.structured_outputs)
        if compiled is not None:  # compiled off the event loop; an invalid one raises here
            await asyncio.wrap_future(compiled)
        if lora_request is not None:  # read off the event loop, not under the engine loop's lock
            lora_request = await asyncio.to_thread(self.generator.load_lora, lora_request)
        tokenized = {"prompt": text, "prompt_token_ids": token_ids}
        if prompt_cache_salt(prompt) is not None:
            tokenized["cache_salt"] = prompt["cache_salt"]
        if request_id is not None:  # reused once the request that had it ends, as vLLM's: aborted, it ends now
            await self.engine.id_released(request_id, RELEASE_TIMEOUT_S)
        stream = self.engine.submit([tokenized], deltas,
                                    [request_id or uuid.uuid4().hex], lora_request, priority)
        so_far: RequestOutput | None = None
        try:
            async for delta in stream:
                if kind is RequestOutputKind.DELTA:
                    yield delta
                    continue
                if so_far is None:
                    so_far = delta
                else:
                    so_far.add(delta)
                if kind is RequestOutputKind.CUMULATIVE or so_far.finished:
                    yield _copy(so_far)
        finally:
            stream.close()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or each of a list); its `generate` ends with ``finish_reason="abort"``."""
        self.engine.abort(request_id)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter (off the event loop), as vLLM's; ``ValueError`` names what does not fit."""
        return await asyncio.to_thread(self.generator.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return self.generator.remove_lora(lora_int_id)

    async def list_loras(self) -> set[int]:
        return self.generator.list_loras()

    async def get_tokenizer(self):
        return self.tokenizer

    async def reset_prefix_cache(self) -> bool:
        return self.generator.reset_prefix_cache()

    @property
    def is_running(self) -> bool:
        """Whether the engine thread serves (False after `shutdown` or an unrecoverable error)."""
        return self.engine.running

    @property
    def errored(self) -> bool:
        """Whether the engine stopped after an unrecoverable error (`generate` then raises `EngineDead`)."""
        return self.engine.fatal is not None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step; requests still in flight raise `EngineError`. A later
        `generate` starts it again, except under tensor parallelism, whose other ranks end here."""
        self.engine.stop(timeout, reason="AsyncLLM.shutdown() was called")
        detached = None if self._ranks is None else self._ranks.detach()
        if self._ranks is not None:
            atexit.unregister(self._ranks)
        if detached is not None:  # the ranks wait as long for their last step
            _, _, (_, ranks), _ = detached
            ranks.stop(timeout)


def _stop_ranks(engine: EngineLoop, ranks) -> None:
    engine.stop()
    ranks.stop()


def _copy(output: RequestOutput) -> RequestOutput:
    """A snapshot of a growing output, which later deltas do not change."""
    samples = [dataclasses.replace(sample, token_ids=list(sample.token_ids),
                                   logprobs=None if sample.logprobs is None else list(sample.logprobs))
               for sample in output.outputs]
    return dataclasses.replace(output, outputs=samples)
