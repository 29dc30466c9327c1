"""`ContinuousBatchGenerator`: the public serving loop over any Transformers causal LM."""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ..distributed import DistributedError, Lockstep, is_tensor_parallel, prepack_sharded_linear_layers
from ..cache import KVCacheManager, KVCacheSpec, PagedCache
from ..integration import ATTN_IMPLEMENTATION, uses_paged_attention
from ..kernels.cpu_linear import prepack_linear_layers, unpack_linear_layers
from .detokenizer import Detokenizer, find_stop_string
from .model_runner import ModelRunner
from .sampler import SamplingBatch, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler, SchedulerConfig
from .sequence import Request, RequestMetrics, RequestOutput, Sequence

logger = logging.getLogger(__name__)
Prompt = str | list[int] | list[dict]
DEFAULT_CPU_KV_MEMORY = 2 << 30
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    num_partial_prefills: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int


class ContinuousBatchGenerator:
    """Serves many requests at once over one model: requests join the running batch at every step and leave when done.

    Args:
        model: a Transformers causal LM; its attention is switched to ``"paged"``.
        tokenizer: the model's tokenizer.
        block_size: tokens per KV block.
        num_blocks / kv_cache_memory: size the KV cache by blocks or bytes (default: 2 GiB on CPU, half the free
            memory on GPU).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most tokens computed in one step; longer prompts are prefilled in chunks.
        max_model_len: longest prompt + output (default: the model's context, capped by the cache size).
        enable_prefix_caching: reuse the KV of full blocks shared with earlier prompts.
        prepack_weights: on CPU, run the model's plain ``nn.Linear`` layers through oneDNN with their weights packed
            once (`hf_paged.kernels.cpu_linear`); faster decode, at the cost of the linear weights' memory once more.
            The model stays packed afterwards (`hf_paged.kernels.cpu_linear.unpack_linear_layers` undoes it).
        kv_cache_dtype: dtype of the KV cache (default: the model's), as a ``torch.dtype`` or its name. bf16 under an
            fp32 model halves the cache's memory and the bytes attention reads, at the cost of rounding keys and
            values to bf16.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        prepack_weights: bool = True,
        kv_cache_dtype: torch.dtype | str | None = None,
    ):
        if not getattr(model, "_supports_attention_backend", False):
            raise ValueError(
                f"{type(model).__name__} does not run its attention through Transformers' attention interface, "
                "so the paged backend cannot serve it"
            )
        scheduler_config = SchedulerConfig(max_num_seqs, max_num_batched_tokens)
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 (a prompt token and an output token), "
                             f"got {max_model_len!r}")
        kv_cache_dtype = self._kv_cache_dtype(kv_cache_dtype, model.dtype)
        if not uses_paged_attention(model):
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model.eval()
        self.tokenizer = tokenizer
        if num_blocks is None and kv_cache_memory is None:
            kv_cache_memory = self._default_kv_memory(model.device)
        self.cache = PagedCache(model.config, num_blocks=num_blocks, block_size=block_size,
                                memory_budget=kv_cache_memory, dtype=kv_cache_dtype, device=model.device,
                                spec=KVCacheSpec.from_model(model))
        self.cache.allocate(kv_cache_dtype, model.device)
        self.kv = KVCacheManager(self.cache.pool, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.runner = ModelRunner(model, self.cache, self.kv)
        self.detokenizer = Detokenizer(tokenizer)
        text_config = model.config.get_text_config(decoder=True)
        limits = [self.cache.num_blocks * block_size, getattr(text_config, "max_position_embeddings", None), max_model_len]
        self.max_model_len = min(limit for limit in limits if limit is not None)
        self.eos_token_ids = self._eos_token_ids(model, tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.requests: dict[str, Request] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live_ids: set[str] = set()  # queued or running, guarded by _ids_lock
        self._ids_lock = threading.Lock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        # Under tensor parallelism every rank runs this generator on rank 0's requests (see hf_paged.distributed).
        self.lockstep = Lockstep() if is_tensor_parallel(model) else None
        self._workers_stopped = False
        packed = 0
        if prepack_weights and model.device.type == "cpu":
            packed = prepack_linear_layers(model)
            if self.lockstep is not None:
                prepack_sharded_linear_layers(model)
        try:
            self._check_model_runs()
        except Exception:
            if packed:
                unpack_linear_layers(model)
            raise

    # ---------------------------------------------------------------------------------------------- set-up
    @staticmethod
    def _default_kv_memory(device: torch.device) -> int:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return free // 2
        return DEFAULT_CPU_KV_MEMORY

    @staticmethod
    def _kv_cache_dtype(requested: torch.dtype | str | None, model_dtype: torch.dtype) -> torch.dtype:
        if requested is None:
            return model_dtype
        dtype = getattr(torch, requested, None) if isinstance(requested, str) else requested
        if dtype not in KV_CACHE_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {names}, got {requested!r}")
        return dtype

    @staticmethod
    def _eos_token_ids(model, tokenizer) -> set[int]:
        ids = set()
        eos = getattr(model.generation_config, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else eos or [])
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return ids

    def _check_model_runs(self) -> None:
        """One tiny real step, so a model the paged backend cannot drive is refused here, not mid-serving."""
        probe = self.add_request([self.tokenizer.eos_token_id or 0], SamplingParams(max_tokens=1, temperature=0))
        try:
            while self.has_unfinished_requests():
                self.step()
        except TypeError as err:
            raise ValueError(f"{type(self.model).__name__} cannot run with the paged backend: {err}") from err
        assert probe not in self.requests and self.kv.pool.num_used_blocks == 0
        self.kv.pool.reset()
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self._prompt_tokens = self._generation_tokens = 0

    # ------------------------------------------------------------------------------------------- requests
    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt) and prompt:
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            token_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            text, token_ids = None, list(prompt)
        else:
            raise ValueError(
                f"a prompt is a string, a list of token ids or a list of chat messages, got {type(prompt)}"
            )
        # A tokenizer can know more tokens than the model embeds; such a prompt would fail every step it joins.
        bad = self._outside_vocabulary(token_ids)
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the model's vocabulary (size {self.vocab_size})")
        return text, token_ids

    def add_request(
        self, prompt: Prompt, sampling_params: SamplingParams | GenerationConfig | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; it joins the batch at the next step. Raises ``ValueError`` for bad input."""
        params = self._params(sampling_params)
        text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt is {len(token_ids)} tokens long but this engine's context (max_model_len) is "
                f"{self.max_model_len} tokens, prompt and output together"
            )
        self._check_params(params)
        request_id = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        with self._ids_lock:
            if request_id in self._live_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
        self._inbox.put(("add", Request(request_id, text, token_ids, params, seed)))
        return request_id

    def _outside_vocabulary(self, token_ids) -> list[int]:
        return [t for t in token_ids if not 0 <= t < self.vocab_size]

    def _check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check on its own: the limits of this engine and this vocabulary."""
        # Worded as SamplingParams' own checks ("SamplingParams.<field> must be ..."), so callers can name the field.
        max_num_seqs = self.scheduler.config.max_num_seqs
        if params.n > max_num_seqs:
            raise ValueError(f"SamplingParams.n must be at most this engine's max_num_seqs ({max_num_seqs}), the "
                             f"most sequences it runs at once, got {params.n}")
        bad = self._outside_vocabulary(params.stop_token_ids)
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids must be in the vocabulary (0 to {self.vocab_size - 1}), "
                             f"got {bad[:5]}")
        bad = self._outside_vocabulary(params.logit_bias)
        if bad:
            raise ValueError(f"SamplingParams.logit_bias must name token ids in the vocabulary (0 to "
                             f"{self.vocab_size - 1}), got {bad[:5]}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"SamplingParams.logprobs must be at most the vocabulary's {self.vocab_size} tokens, "
                             f"got {params.logprobs}")

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the next step, which reports it with ``finish_reason="abort"``."""
        self._inbox.put(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or not self._inbox.empty()

    @staticmethod
    def _params(params: SamplingParams | GenerationConfig | None) -> SamplingParams:
        if params is None:
            return SamplingParams()
        if isinstance(params, GenerationConfig):
            return SamplingParams.from_generation_config(params)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams or GenerationConfig, got {type(params)}")
        return params

    def _drain_inbox(self) -> list[RequestOutput]:
        actions = []
        while not self._inbox.empty():
            actions.append(self._inbox.get())
        if self.lockstep is not None:
            if self._workers_stopped:
                raise DistributedError("the other tensor-parallel ranks were stopped (stop_workers)")
            actions = self.lockstep.exchange(actions)
        aborted = []
        for action, item in actions:
            if action == "stop":
                self._workers_stopped = True
            elif action == "add":
                self.requests[item.request_id] = item
                self.scheduler.add(item.seqs[0])
                self._prompt_tokens += item.num_prompt_tokens
            elif item in self.requests:
                request = self._retire(item)
                for seq in request.seqs:
                    if not seq.is_finished:
                        seq.finish_reason = "abort"
                        self.scheduler.finish(seq)
                request.metrics.finished_time = time.monotonic()
                output = request.to_output()
                output.finished = True
                aborted.append(output)
        return aborted

    # ----------------------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that changed (new tokens, finished or aborted)."""
        outputs = self._drain_inbox()
        if not self.scheduler.has_work():
            return outputs
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return outputs
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.metrics.first_scheduled_time = now
        # Nothing is committed until the step's tokens are sampled: a step that raises leaves every sequence as it
        # was, so the next step recomputes it.
        try:
            logits, sampled = self.runner.execute(batch)
            rows, draws = self._expand_forks(sampled)
            if len(rows) != len(sampled):
                logits = logits[rows]
            result = sample(logits, self._sampling_batch(draws)) if draws else None
            if result is not None and self.lockstep is not None:
                self.lockstep.check_tokens(result.token_ids)
        except BaseException:
            for seq in batch.seqs:  # the blocks this step was to fill must not serve later prefix matches
                self.kv.uncommit(seq.seq_id, seq.num_computed_tokens)
            # A sequence admitted this step may have matched blocks that another one committed in the same step,
            # which were never written: it goes back to waiting and matches again.
            self.scheduler.unadmit(batch.admitted)
            raise
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
        if not draws:
            return outputs
        # Every sample of a request with n > 1 forks from its prompt before any of them gets a token.
        seqs = [seq if sample_index == 0 else self._fork(seq, sample_index) for seq, sample_index in draws]
        now = time.monotonic()
        changed: dict[str, Request] = {}
        for i, seq in enumerate(seqs):
            self._append(seq, result.token_ids[i], result, i, now)
            changed[seq.request.request_id] = seq.request
        for request in changed.values():
            if request.is_finished:
                request.metrics.finished_time = now
                self._retire(request.request_id)
            outputs.append(request.to_output())
        return outputs

    # ------------------------------------------------------------------------------------ tensor parallelism
    @property
    def is_driver(self) -> bool:
        """Whether requests enter here: always, except on the ranks other than 0 of a tensor-parallel model."""
        return self.lockstep is None or self.lockstep.is_driver

    def run_worker(self) -> None:
        """On a rank other than 0: step in lockstep with rank 0 until it calls `stop_workers` (or fails).

        A step that fails on every rank alike (as rank 0's does) is logged and serving goes on, as on rank 0; a failed
        collective raises `DistributedError`.
        """
        if self.is_driver:
            raise RuntimeError("run_worker is for the tensor-parallel ranks other than 0; rank 0 takes requests")
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
        self._drain_inbox()

    def _retire(self, request_id: str) -> Request:
        with self._ids_lock:
            self._live_ids.discard(request_id)
        return self.requests.pop(request_id)

    def _expand_forks(self, sampled: list[Sequence]) -> tuple[list[int], list[tuple[Sequence, int]]]:
        """A request with ``n > 1`` draws ``n`` first tokens from its prompt's logits; its samples then diverge."""
        rows, draws = [], []
        for row, seq in enumerate(sampled):
            for k in range(seq.num_samples):
                rows.append(row)
                draws.append((seq, k))
        return rows, draws

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(index)
        parent.request.seqs.append(child)
        self.kv.fork(parent.seq_id, child.seq_id)
        self.scheduler.add_running(child)
        return child

    def _sampling_batch(self, draws: list[tuple[Sequence, int]]) -> SamplingBatch:
        device = self.model.device
        params = [seq.request.params for seq, _ in draws]

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        sampling = [p for p in params if not p.greedy]
        batch = SamplingBatch(all_greedy=not sampling)
        if sampling:  # the draw tensors, only when some row samples
            # Chosen per row, never per batch: the same uniform number picks another token in sorted order.
            sort_rows = [row for row, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1)]
            batch.sort_rows = column(sort_rows, torch.long) if sort_rows else None
            batch.needs_min_p = any(p.min_p > 0 for p in sampling)
            batch.temperature = column([0.0 if p.greedy else p.temperature for p in params], torch.float32)
            batch.top_k = column([p.top_k for p in params], torch.long)
            batch.top_p = column([p.top_p for p in params], torch.float32)
            batch.min_p = column([p.min_p for p in params], torch.float32)
            batch.seeds = column([seq.request.seed for seq, _ in draws], torch.long)
            batch.counters = column(
                [seq.num_output_tokens * p.n + seq.index + k for (seq, k), p in zip(draws, params)], torch.long
            )
        if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
            batch.repetition_penalty = column([p.repetition_penalty for p in params], torch.float32)
            batch.presence_penalty = column([p.presence_penalty for p in params], torch.float32)
            batch.frequency_penalty = column([p.frequency_penalty for p in params], torch.float32)
            batch.prompt_tokens = self._padded([seq.request.prompt_token_ids for seq, _ in draws])
            batch.output_tokens = self._padded([seq.output_token_ids for seq, _ in draws])
        banned_rows, banned_tokens = [], []
        for row, ((seq, _), p) in enumerate(zip(draws, params)):
            if seq.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
                banned_rows += [row] * len(stops)
                banned_tokens += sorted(stops)
        if banned_rows:
            batch.banned = (column(banned_rows, torch.long), column(banned_tokens, torch.long))
        bias = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias.items()]
        if bias:
            rows, tokens, values = zip(*bias)
            batch.logit_bias = (column(rows, torch.long), column(tokens, torch.long), column(values, torch.float32))
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            batch.max_logprobs = max(1, *wanted)
        return batch

    def _padded(self, lists: list[list[int]]) -> torch.Tensor:
        width = max(1, max(len(x) for x in lists))
        return torch.tensor([x + [-1] * (width - len(x)) for x in lists], dtype=torch.long, device=self.model.device)

    def _append(self, seq: Sequence, token: int, result, row: int, now: float) -> None:
        request, params = seq.request, seq.request.params
        seq.token_ids.append(token)
        self._generation_tokens += 1
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        if seq.logprobs is not None:
            top = dict(zip(result.top_ids[row][: params.logprobs], result.top_logprobs[row][: params.logprobs]))
            top[token] = result.sampled_logprobs[row]
            seq.logprobs.append(top)
            seq.cumulative_logprob += result.sampled_logprobs[row]
        new_text = self.detokenizer.step(seq, params.skip_special_tokens)
        if seq.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif token in self.eos_token_ids and not params.ignore_eos:
                seq.finish_reason = "stop"
            else:
                stop = find_stop_string(seq, new_text, params.stop, params.include_stop_str_in_output)
                if stop is not None:
                    seq.finish_reason, seq.stop_reason = "stop", stop
        if seq.finish_reason is None and (
            (params.max_tokens is not None and seq.num_output_tokens >= params.max_tokens)
            or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
        if seq.finish_reason is not None:
            self.scheduler.finish(seq)

    # ------------------------------------------------------------------------------------- batch interfaces
    def _submit(self, prompts, sampling_params) -> list[tuple[str | None, RequestOutput | None]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            per_prompt = sampling_params
        else:
            per_prompt = [sampling_params] * len(prompts)
        submitted = []
        for prompt, params in zip(prompts, per_prompt):
            try:
                submitted.append((self.add_request(prompt, params), None))
            except ValueError as err:
                failed = RequestOutput(uuid.uuid4().hex, prompt if isinstance(prompt, str) else None, [], [], True,
                                       RequestMetrics(time.monotonic()), error=str(err))
                submitted.append((None, failed))
        return submitted

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield each request's output every time it grows; refused prompts come first with ``error`` set."""
        submitted = self._submit(prompts, sampling_params)
        pending = {rid for rid, _ in submitted if rid is not None}
        for _, failed in submitted:
            if failed is not None:
                yield failed
        while pending:
            for output in self.step():
                if output.request_id in pending:
                    if output.finished:
                        pending.discard(output.request_id)
                    yield output

    def run(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for all ``prompts`` together; outputs come back in input order.

        ``sampling_params`` is one `SamplingParams` (or `GenerationConfig`) for all, a list with one per prompt, or
        None for the defaults. A prompt that cannot be served (empty, too long) gets an output with ``error`` set.
        """
        submitted = self._submit(prompts, sampling_params)
        results = {rid: None for rid, _ in submitted if rid is not None}
        with tqdm(total=len(submitted), desc="Generating", disable=not use_tqdm) as bar:
            bar.update(len(submitted) - len(results))
            for output in self.stream_ids(set(results)):
                results[output.request_id] = output
                bar.update(1)
        return [failed if rid is None else results[rid] for rid, failed in submitted]

    def stream_ids(self, request_ids: set[str]) -> Iterator[RequestOutput]:
        """Step until the given requests finish, yielding each one's final output."""
        pending = set(request_ids)
        while pending:
            for output in self.step():
                if output.finished and output.request_id in pending:
                    pending.discard(output.request_id)
                    yield output

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=pool.num_used_blocks / pool.num_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_blocks=pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_partial_prefills=self.scheduler.num_partial_prefills,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )
