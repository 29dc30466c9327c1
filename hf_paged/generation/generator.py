"""`ContinuousBatchGenerator`: the public serving loop over any Transformers causal LM (add, step, abort, run)."""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..cache import KVCacheManager, combined_salt
from ..distributed import (DistributedError, Lockstep, check_engine_config, is_tensor_parallel,
                           prepack_sharded_linear_layers)
from ..integration import switch_to_paged_attention
from ..kernels.cpu_linear import prepack_linear_layers, unpack_linear_layers
from ..lora import LoRAAdapter, LoRAAdapters, LoRARequest
from ..native_decoder import NativeDecoder
from .config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from .detokenizer import Detokenizer
from .draft_model import DraftModel
from .inputs import (InputProcessor, Prompt, model_eos_token_ids, one_params_per_prompt, per_prompt,
                     prompt_cache_salt)
from .kv_sizing import kv_storage_for
from .model_runner import ModelRunner
from .output_router import OutputRouter
from .outputs import RequestMetrics, RequestOutput
from .sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from .scheduler import Scheduler, SchedulerOutput
from .sequence import Request
from .stats import EngineStats
from .spec_decode import Speculator
from .structured_outputs import GrammarCompiler

logger = logging.getLogger(__name__)


def _check_temperature_tuning(text_config, max_model_len: int, config: EngineConfig) -> None:
    """Llama 4 scales some layers' attention by each token's position, which it counts from a cache the engine does
    not pass (from 0 at the step's first token): exact only while positions and steps stay below ``floor_scale``."""
    tuning = getattr(text_config, "attn_temperature_tuning", False)
    floor = getattr(text_config, "floor_scale", None) if tuning else None
    if floor and max(max_model_len, config.max_num_batched_tokens) >= floor:
        raise NotImplementedError(
            f"{text_config.model_type}'s attention temperature tuning counts positions the engine cannot give it past "
            f"floor_scale ({floor}): set max_model_len and max_num_batched_tokens below {floor}")


def _with_step_budget(config: EngineConfig, native: NativeDecoder | None) -> EngineConfig:
    """``config`` with ``max_num_batched_tokens`` set: the caller's, else the steps the native decoder takes where it
    is the faster for all of them (`NativeDecoder.takes_whole_steps`), so that every step runs natively (prompts
    compute faster in its 512-token steps than in 2048-token Transformers forwards, and decodes wait less behind
    them), else 2048; never below ``max_num_seqs`` (a step decodes every running sequence, as vLLM asks).
    ``long_prefill_token_threshold`` likewise: the caller's, else a quarter of the budget but at least 512 tokens
    (smaller chunks only delay the first tokens of many mid-length prompts arriving at once), and at most half of it
    (so that a long prompt leaves room in its steps for others)."""
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = native.max_tokens if native is not None and native.takes_whole_steps else \
            DEFAULT_MAX_NUM_BATCHED_TOKENS
        budget = max(budget, config.max_num_seqs)
    threshold = config.long_prefill_token_threshold
    return config.replace(max_num_batched_tokens=budget,
                          long_prefill_token_threshold=min(budget // 2, max(512, budget // 4)) if threshold is None
                          else threshold)


def _naming_prompt(err: ValueError, index: int | None) -> ValueError:
    """``err`` as raised for the batch's prompt ``index`` (None: the only one), as a new `InvalidParameter` or
    `ValueError` (``err`` is its cause): a constraint's error is shared by the compile cache."""
    message = str(err) if index is None else f"prompt {index}: {err}"
    return InvalidParameter(err.param, message) if isinstance(err, InvalidParameter) else ValueError(message)


class ContinuousBatchGenerator:
    """Serves many requests at once over one model: requests join the running batch at every step and leave when done.

    Args:
        model: a Transformers causal LM; its attention is switched to ``"paged"`` (and back if the engine is
            refused). Steps run it in eval mode, whatever mode it is left in between them.
        tokenizer: the model's tokenizer.
        config: the engine's options (`EngineConfig`); keyword arguments override single fields, e.g.
            ``ContinuousBatchGenerator(model, tokenizer, max_num_seqs=32)``. With ``prepack_weights`` (the default)
            the model's plain ``nn.Linear`` layers run through oneDNN with packed weights on CPU and stay packed
            afterwards (`hf_paged.kernels.cpu_linear.unpack_linear_layers` undoes it).
    """

    def __init__(self, model: torch.nn.Module, tokenizer, config: EngineConfig | None = None, **options):
        config = (config or EngineConfig()).replace(**options)
        previous = model.config.get_text_config(decoder=True)._attn_implementation
        switch_to_paged_attention(model)
        try:
            self._build(model, tokenizer, config)
        except BaseException:  # a refused engine leaves the model as it found it
            if previous not in (None, "paged"):
                with contextlib.suppress(Exception):  # the refusal is what the caller must read
                    model.set_attn_implementation(previous)
            raise

    def _build(self, model: torch.nn.Module, tokenizer, config: EngineConfig) -> None:
        self.model = model  # left in its mode: each step runs in eval mode (see ModelRunner.run)
        self.tokenizer = tokenizer
        self.kv_storage = kv_storage_for(model, config)
        self.kv_manager = KVCacheManager(self.kv_storage.pool, config.enable_prefix_caching)
        native = None if config.enforce_eager else NativeDecoder.for_model(model, self.kv_storage)
        config = self.config = _with_step_budget(config, native)
        self.max_model_len = self._max_model_len(config)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        eos_token_ids = model_eos_token_ids(model, tokenizer)
        self.inputs = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, config.max_num_seqs,
                                     eos_token_ids, getattr(model, "generation_config", None), config.seed,
                                     config.scheduling_policy, is_tensor_parallel(model))
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, eos_token_ids)
        self.scheduler = Scheduler(config, self.kv_manager, Detokenizer(tokenizer), self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._router = OutputRouter()
        self._interrupted: list[Request] = []  # failed when an interrupt cut their step short, not reported yet
        # One step at a time: `run` and `stream` called from several threads take turns stepping (each step serves
        # every thread's requests); `add_request` and `abort_request` need not take this lock.
        self._stepping = threading.RLock()
        # Under tensor parallelism every rank runs this generator on rank 0's requests (see hf_paged.distributed).
        self.lockstep = Lockstep() if is_tensor_parallel(model) else None
        if self.lockstep is not None:
            check_engine_config(config)
        self._workers_stopped = False
        self.loras = self._loras(config)
        packed = 0
        try:
            self.runner = self._runner(config, native)
            if config.prepack_weights and model.device.type == "cpu":
                packed = prepack_linear_layers(model, keep_plain=self.runner.native_linear_layers())
                if self.lockstep is not None:
                    prepack_sharded_linear_layers(model)
            self.speculator = self._speculator(config)
            self._check_model_runs()
        except BaseException:
            if packed:  # layers an earlier engine packed stay as they were
                unpack_linear_layers(model)
            raise

    # ---------------------------------------------------------------------------------------------- set-up
    def _max_model_len(self, config: EngineConfig) -> int:
        """The model's context, capped by what the cache holds; a ``max_model_len`` above either is refused."""
        text = self.model.config.get_text_config(decoder=True)
        context = getattr(text, "max_position_embeddings", None)
        held = self.kv_storage.num_blocks * config.block_size
        asked = config.max_model_len
        _check_temperature_tuning(text, min(limit for limit in (held, asked, context) if limit is not None), config)
        if asked is not None and context is not None and asked > context:
            raise ValueError(f"EngineConfig.max_model_len ({asked}) is longer than the model's context ({context} "
                             "tokens, its max_position_embeddings)")
        if asked is not None and asked > held:
            raise ValueError(f"EngineConfig.max_model_len ({asked}) is more than the KV cache holds ({held} tokens): "
                             "give the cache more memory (kv_cache_memory, num_blocks) or lower max_model_len")
        return min(limit for limit in (held, asked, context) if limit is not None)

    def _loras(self, config: EngineConfig) -> LoRAAdapters | None:
        if not config.enable_lora:
            return None
        return LoRAAdapters(self.model, config.max_lora_rank, config.max_cpu_loras or config.max_loras)

    def _runner(self, config: EngineConfig, native: NativeDecoder | None) -> ModelRunner:
        spec = config.speculative_config  # a verifying step holds 1 + k tokens per sequence
        return ModelRunner(self.model, self.kv_storage, self.kv_manager, native, config, self.max_model_len,
                           1 + (spec.num_speculative_tokens if spec else 0))

    def _speculator(self, config: EngineConfig) -> Speculator | None:
        spec = config.speculative_config
        if spec is None:
            return None
        draft = None
        if spec.method == "draft_model":
            draft = DraftModel(spec.model, self.model, self.kv_storage, self.kv_manager, config, self.max_model_len,
                               len(self.tokenizer))
        return Speculator(spec, self.max_model_len, draft)

    def _check_model_runs(self) -> None:
        """One tiny real step, so a model the paged backend cannot drive is refused here, not mid-serving."""
        probe = self.add_request([self.tokenizer.eos_token_id or 0], SamplingParams(max_tokens=1, temperature=0))
        try:
            while self.has_unfinished_requests():
                self.step()
        except TypeError as err:
            raise ValueError(f"{type(self.model).__name__} cannot run with the paged backend: {err}") from err
        if probe in self.requests or not self.kv_manager.reset_prefix_cache():  # its prompt is forgotten too
            raise RuntimeError("the engine's start-up step left its request or its KV blocks behind")
        self.kv_manager.reset_counters()
        self.scheduler.reset_counters()

    # ------------------------------------------------------------------------------------------- requests
    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | GenerationConfig | None = None,
        request_id: str | None = None, lora_request: LoRARequest | LoRAAdapter | None = None, priority: int = 0,
    ) -> str:
        """Queue a request, under the LoRA adapter ``lora_request`` if given (loaded on first use, as by `load_lora`,
        or the adapter `load_lora` returned); it joins the batch at the next step. ``priority`` (vLLM's; with
        ``scheduling_policy="priority"``): lower runs first. Raises ``ValueError`` for bad input."""
        request_id = request_id or uuid.uuid4().hex
        request = self.inputs.request(request_id, prompt, sampling_params, priority)
        if self.lockstep is not None:
            self.lockstep.check_sendable(request)
        if lora_request is not None:
            request.lora = self.load_lora(lora_request)
        salt = prompt_cache_salt(prompt)
        request.cache_salt = combined_salt(request.lora.cache_salt if request.lora else None,
                                           self.runner.cache_salt(request.num_prompt_tokens),
                                           None if salt is None else salt.encode())
        # On another thread; the request waits for it.
        request.grammar = self.compile_constraint(request.params.structured_outputs)
        self._router.reserve(request_id)
        self._inbox.put(("add", request))
        return request_id

    def compile_constraint(self, spec: StructuredOutputsParams | None) -> Future | None:
        """Start compiling the grammar of a request's structured outputs (None without one): a future of the compiled
        grammar, which raises ``ValueError`` for an invalid constraint. Compiles are cached: a caller may wait for
        one (off its own event loop) before it adds the request, so that an invalid one is refused."""
        return None if spec is None else self.grammars.compile(spec)

    def load_lora(self, lora_request: LoRARequest | LoRAAdapter) -> LoRAAdapter:
        """The loaded adapter of ``lora_request``, read now if need be; ``ValueError`` names what in it does not fit
        the model. A caller that must not read files on its own thread loads here from another and queues requests
        with the adapter returned, which stays loaded for them whatever is dropped meanwhile."""
        if self.loras is None:
            raise InvalidParameter("lora_request", "a LoRA adapter was asked for, but the engine serves none: build it "
                                   "with enable_lora=True (hf-paged serve --enable-lora)")
        if isinstance(lora_request, LoRAAdapter):
            if not (self.loras.holds(lora_request) or lora_request.fits(self.model)):
                raise InvalidParameter("lora_request", f"LoRA adapter {lora_request.request.lora_name!r} was read for "
                                       "another model (its layers' sizes, dtype or device are not this engine's): "
                                       "pass its LoRARequest")
            return lora_request
        if not isinstance(lora_request, LoRARequest):
            raise InvalidParameter("lora_request", f"lora_request must be a LoRARequest, got "
                                   f"{type(lora_request).__name__}")
        return self.loras.get(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter now (vLLM's ``add_lora``), so its first request does not wait for it; ``ValueError``
        names what in it does not fit the model."""
        self.load_lora(lora_request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter (requests running under it finish under it); False if none has that id."""
        return self.loras is not None and self.loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        return set() if self.loras is None else self.loras.ids()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request (or each of a list of them, as vLLM's); its blocks are freed at the next step, which
        reports it with ``finish_reason="abort"``."""
        single = isinstance(request_id, (str, bytes)) or not isinstance(request_id, Iterable)
        request_ids = [request_id] if single else list(request_id)
        for rid in request_ids:
            if not isinstance(rid, Hashable) or (isinstance(rid, Iterable) and not isinstance(rid, (str, bytes))):
                raise TypeError(f"a request id is a string, got {type(rid).__name__}")
        for rid in request_ids:
            self._inbox.put(("abort", rid))

    def request_id_in_use(self, request_id: str) -> bool:
        """Whether a request holds ``request_id`` (until its last output, an abort's too, is handed out)."""
        return self._router.in_use(request_id)

    def has_unfinished_requests(self) -> bool:
        """Whether `step` has requests to run or outputs still to hand back."""
        held = self._router.holds_unclaimed()
        return bool(self.requests) or held or bool(self._interrupted) or not self._inbox.empty()

    def _drain_inbox(self) -> list[Request]:
        """Admit queued requests to the scheduler and abort the ones asked; returns the aborted."""
        actions = []
        while not self._inbox.empty():
            actions.append(self._inbox.get())
        if self.lockstep is not None:
            if self._workers_stopped:
                raise DistributedError("the other tensor-parallel ranks were stopped (stop_workers)")
            actions = self.lockstep.exchange(actions)
        aborted, asked = [], set()
        for action, item in actions:
            if action == "stop":
                self._workers_stopped = True
            elif action == "add":
                if item.grammar is not None and item.grammar.cancelled():  # its other waiters left before it came
                    item.grammar = self.compile_constraint(item.params.structured_outputs)
                self.requests[item.request_id] = item
                self.scheduler.add(item)
            elif item in self.requests and item not in asked and not self.requests[item].is_finished:
                # Asked twice, or of a request an interrupted step failed (reported already): not reported again.
                asked.add(item)
                self.scheduler.abort(self.requests[item])
                aborted.append(self.requests[item])
        return aborted

    # ----------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of the requests that changed (new tokens, finished, aborted), as
        each request's ``output_kind`` asks."""
        return self._step(only=None)

    def _step(self, only: set[str] | None) -> list[RequestOutput]:
        with self._stepping, _interrupt_after_step(self.lockstep is not None):
            try:
                return self._outputs(self._advance(), only)
            except BaseException as err:
                if self.lockstep is not None and not isinstance(err, Exception):
                    # Ctrl+C on rank 0 mid-step: the other ranks are still in it, and would wait for ever.
                    self.lockstep.broken = f"a step was interrupted ({type(err).__name__})"
                raise

    def _advance(self) -> list[Request]:
        """Admit and abort what the inbox holds, then compute one step; returns the requests that changed."""
        changed, self._interrupted = self._drain_inbox() + self._interrupted, []
        if self.scheduler.compiling:
            changed += self.scheduler.admit_compiled()
        guesses = self.speculator.propose(self.scheduler.running) if self.speculator is not None else None
        out = self.scheduler.schedule(guesses) if self.scheduler.has_work() else None
        if out is not None:
            changed += out.failed
        if out is not None and out.seqs:
            try:  # nothing about a sequence changes until `update`; a step that raises is undone
                self.runner.copy_blocks(out)
                if self.speculator is not None:
                    self.speculator.write_drafts(out)
                sampled = self.runner.sample(out, self._forward(out))
                if sampled is not None and self.lockstep is not None:
                    self.lockstep.check_tokens(sampled.token_ids)
            except BaseException:
                self.scheduler.rollback(out)
                raise
            try:
                changed += self.scheduler.update(out, sampled)
                if self.speculator is not None and sampled is not None:
                    self.speculator.record_step(out, sampled)
            except BaseException:  # an interrupt, half applied: the step's requests fail, reported by the next step
                self._interrupted = self.scheduler.fail_all(out, "the engine was interrupted while this request's "
                                                                 "step was applied")
                raise
        return changed

    def _outputs(self, changed: list[Request], only: set[str] | None) -> list[RequestOutput]:
        """The caller's outputs (see `OutputRouter.route`); finished requests leave the engine."""
        for request in changed:
            if request.is_finished or request.error is not None:
                self.requests.pop(request.request_id, None)
        return self._router.route(changed, only)

    def _forward(self, out: SchedulerOutput) -> torch.Tensor:
        try:
            return self.runner.execute(out)
        except Exception as err:
            if self.lockstep is None:
                raise
            # Its collectives may have failed, or run on some ranks only: the ranks cannot be known to agree, and
            # another may wait in one until its timeout. Nothing more is sent to them: they are ended.
            self.lockstep.broken = f"a forward failed on rank {self.lockstep.rank} ({err!r})"
            raise DistributedError(f"a tensor-parallel forward failed on this rank: {err!r}") from err

    # ------------------------------------------------------------------------------------ tensor parallelism
    @property
    def is_tensor_parallel(self) -> bool:
        """Whether this engine is one rank of a tensor-parallel model (see `hf_paged.distributed`)."""
        return self.lockstep is not None

    @property
    def num_generated_tokens(self) -> int:
        """Tokens generated since the engine started (every sequence's), a count that grows with each step's."""
        return self.scheduler.num_generated_tokens

    @property
    def is_driver(self) -> bool:
        """Whether requests enter here: always, except on the ranks other than 0 of a tensor-parallel model."""
        return self.lockstep is None or self.lockstep.is_driver

    def run_worker(self) -> None:
        """On a rank other than 0: step in lockstep with rank 0 until it calls `stop_workers` (or fails).

        A step that fails outside the forward, on every rank alike (as rank 0's does), is logged and serving goes on,
        as on rank 0; a failed forward or collective raises `DistributedError`. SIGINT and SIGTERM are ignored
        meanwhile: rank 0 gets them too, finishes its requests, then calls `stop_workers`.
        """
        if self.is_driver:
            raise RuntimeError("run_worker is for the tensor-parallel ranks other than 0; rank 0 takes requests")
        with _signals_ignored():  # Ctrl+C / SIGTERM reach every rank: rank 0 finishes its requests, then stops us
            while not self._workers_stopped:
                try:
                    self.step()
                except DistributedError:
                    raise
                except Exception:
                    logger.exception("engine step failed on this rank, as on rank 0; going on")

    def stop_workers(self) -> None:
        """On rank 0 of a tensor-parallel model: end the other ranks' `run_worker` (no step may follow)."""
        if self.lockstep is None or not self.is_driver or self._workers_stopped:
            return
        self._inbox.put(("stop", None))
        with self._stepping:
            self._drain_inbox()

    # ------------------------------------------------------------------------------------- batch interfaces
    def _submit(self, prompts, sampling_params, lora_request=None,
                priority=None, strict: bool = False) -> list[tuple[str | None, RequestOutput | None]]:
        """Add every prompt; one refused (a ``ValueError``) gets a failed output, or with ``strict`` is raised
        (naming the prompt's index when there are several), as any other error is, once the prompts added before it
        are withdrawn (``strict`` waits for each constraint's compile, so that an invalid one is raised too)."""
        prompts, params_each = one_params_per_prompt(prompts, sampling_params)
        loras = per_prompt(lora_request, prompts, "LoRA requests")
        priorities = per_prompt(0 if priority is None else priority, prompts, "priorities")
        submitted = []
        try:
            for index, (prompt, params, lora, level) in enumerate(zip(prompts, params_each, loras, priorities)):
                try:
                    submitted.append((self.add_request(prompt, params, lora_request=lora, priority=level), None))
                    compiled = self.compile_constraint(getattr(params, "structured_outputs", None)) if strict else None
                    if compiled is not None:
                        compiled.result()  # the request's own compile: an invalid constraint raises here
                except ValueError as err:
                    if strict:
                        raise _naming_prompt(err, index if len(prompts) > 1 else None) from err
                    failed = RequestOutput(uuid.uuid4().hex, prompt if isinstance(prompt, str) else None, [], [],
                                           True, RequestMetrics(time.monotonic()), error=str(err),
                                           error_param=getattr(err, "param", None))
                    submitted.append((None, failed))
        except BaseException:
            self._withdraw({rid for rid, _ in submitted if rid is not None})
            raise
        return submitted

    def stream(self, prompts, sampling_params=None, lora_request=None, priority=None) -> Iterator[RequestOutput]:
        """Yield each request's outputs as its ``output_kind`` asks (by default cumulative, every time it grows);
        refused prompts come first with ``error`` set. The arguments are `run`'s."""
        submitted = self._submit(prompts, sampling_params, lora_request, priority)
        yield from self._until_finished({rid for rid, _ in submitted if rid is not None}, finished_only=False,
                                        first=[failed for _, failed in submitted if failed is not None])

    def run(self, prompts, sampling_params=None, use_tqdm: bool | Callable = True, lora_request=None,
            priority=None, strict: bool = False) -> list[RequestOutput]:
        """Generate for all ``prompts`` together; outputs come back complete, in input order.

        ``sampling_params`` is one `SamplingParams` (or `GenerationConfig`) for all, a list with one per prompt, or
        None for the sampling settings of the model's generation config; ``lora_request`` likewise one `LoRARequest`
        for all, a list of one (or None) per prompt, or None; ``priority`` one for all or one per prompt (see
        `add_request`). A prompt that cannot be served (empty, too long, an adapter that does not fit, an invalid
        constraint) gets an output with ``error`` set; with ``strict`` (vLLM's ``LLM.generate``) its ``ValueError``
        is raised instead, before anything runs.
        """
        if isinstance(sampling_params, (list, tuple)):
            sampling_params = [self.inputs.final_only(p) for p in sampling_params]
        else:
            sampling_params = self.inputs.final_only(sampling_params)
        submitted = self._submit(prompts, sampling_params, lora_request, priority, strict)
        results = {rid: None for rid, _ in submitted if rid is not None}
        progress = use_tqdm if callable(use_tqdm) else tqdm  # vLLM's: a tqdm-like class may be given instead
        with progress(total=len(submitted), desc="Generating", disable=not use_tqdm) as bar:
            bar.update(len(submitted) - len(results))
            for output in self._until_finished(set(results), finished_only=True):
                results[output.request_id] = output
                bar.update(1)
        return [failed if rid is None else results[rid] for rid, failed in submitted]

    def _until_finished(self, request_ids: set[str], finished_only: bool,
                        first: Iterable[RequestOutput] = ()) -> Iterator[RequestOutput]:
        """Yield ``first``, then step until the given requests finish, yielding their outputs (with ``finished_only``,
        the finished ones). Other requests' outputs are kept for the next `step`; requests left unfinished (the
        caller stopped reading, or an error) are aborted."""
        pending = set(request_ids)
        with self._stepping:
            self._router.claim(pending)
        try:
            yield from first
            while pending:
                for output in self._step(only=pending):
                    if output.finished:
                        pending.discard(output.request_id)
                    if output.finished or not finished_only:
                        yield output
        finally:
            with self._stepping:
                self._router.unclaim(request_ids)
                self._withdraw(pending)

    def _withdraw(self, request_ids: set[str]) -> None:
        """Abort ``request_ids``, whose outputs nobody reads: `step` drops them."""
        with self._stepping:
            live = self._router.drop(request_ids)
        for request_id in live:
            self.abort_request(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's ``LLM.reset_prefix_cache``: call it after changing the model's
        weights (an RL loop's update, ``load_state_dict``), whose cached keys and values no longer hold. Returns
        False, changing nothing, while requests are in flight (their blocks were computed with the old weights too)."""
        if self.lockstep is not None:  # every rank would have to forget the same blocks at the same step
            raise NotImplementedError("reset_prefix_cache is not supported on a tensor-parallel engine yet")
        with self._stepping:
            done = not self.has_unfinished_requests() and self.kv_manager.reset_prefix_cache()
        if not done:
            logger.warning("hf_paged: the prefix cache was not reset: requests are in flight")
        return done

    def stats(self) -> EngineStats:
        pool = self.kv_manager.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.compiling),
            kv_cache_usage=pool.num_used_blocks / pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_blocks=pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_partial_prefills=self.scheduler.num_partial_prefills,
            prefix_cache_queries=self.kv_manager.prefix_queries,
            prefix_cache_hits=self.kv_manager.prefix_hits,
            prompt_tokens=self.scheduler.num_prompt_tokens,
            generation_tokens=self.scheduler.num_generated_tokens,
            **self._spec_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.loras is None:
            return {}
        scheduler = self.scheduler

        def names(requests) -> tuple[str, ...]:
            return tuple(sorted({r.lora.request.lora_name for r in requests if r.lora is not None}))

        return dict(max_loras=self.config.max_loras,
                    running_lora_adapters=names(seq.request for seq in scheduler.running),
                    waiting_lora_adapters=names([*(seq.request for seq in scheduler.waiting),
                                                 *scheduler.compiling.values()]))

    def _spec_stats(self) -> dict:
        s = self.speculator
        if s is None:
            return {}
        return dict(spec_decode_num_drafts=s.num_drafts, spec_decode_num_draft_tokens=s.num_draft_tokens,
                    spec_decode_num_accepted_tokens=s.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=tuple(s.num_accepted_per_position))


@contextlib.contextmanager
def _signals_ignored():
    """SIGINT and SIGTERM ignored while the block runs (in the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _interrupt_after_step(hold: bool):
    """With ``hold`` (a rank of a tensor-parallel group, whose other ranks are in the same step), Ctrl+C waits for the
    block's end: the SIGINT handler in place (Python's raises `KeyboardInterrupt`) then runs, as if the signal came
    just after it (in the main thread)."""
    if not hold or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)
    if caught and callable(previous):
        previous(signal.SIGINT, caught[-1])
    elif caught and previous in (signal.SIG_DFL, None):
        signal.raise_signal(signal.SIGINT)
