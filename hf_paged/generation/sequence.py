"""Requests and their sequences: the tokens of each sample, how many are in the KV cache, and what was handed back."""

from __future__ import annotations

import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import cached_property

import torch

from ..lora import LoRAAdapter
from .beam_search import BeamState
from .outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """The tokens of one output sample, and how many of them are in the KV cache (``num_computed_tokens``)."""

    def __init__(self, request: "Request", index: int, token_ids: list[int]):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Incremental detokenization state (see detokenizer.py).
        self.text = ""
        self.prefix_offset = max(0, request.num_prompt_tokens - 5)
        self.read_offset = request.num_prompt_tokens
        # What earlier DELTA outputs handed back.
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.sent_finish = False
        self.matcher = None  # a structured_outputs.GrammarMatcher over the output, for a constrained request
        # With a constraint and a reasoning parser (see `reasoning.ReasoningEnd`): in a reasoning block its grammar
        # starts after, or the token that may open one as its first token, beside the grammar's.
        self.in_reasoning = False
        self.reasoning_opener: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_samples(self) -> int:
        """Sequences this one becomes at its first token: ``n`` for a request's prompt, not yet forked, else 1."""
        return self.request.params.n if len(self.request.seqs) == 1 and self.num_output_tokens == 0 else 1

    @property
    def num_draws(self) -> int:
        """Samples drawn from its logits once its last token is computed: ``num_samples``; a beam's candidates, once."""
        return 1 if self.request.beams is not None else self.num_samples

    def fork(self, index: int) -> "Sequence":
        """A sibling sample that shares everything computed so far (it has generated nothing yet)."""
        child = Sequence(self.request, index, [])
        child.become(self)
        child.matcher = self.matcher.fork() if self.matcher is not None else None
        child.in_reasoning, child.reasoning_opener = self.in_reasoning, self.reasoning_opener
        self.request.seqs.append(child)
        return child

    def become(self, source: "Sequence") -> None:
        """Take over the tokens and decoding state of ``source`` (a beam that continues another; its KV blocks are the
        scheduler's to share)."""
        self.token_ids, self.num_computed_tokens = list(source.token_ids), source.num_computed_tokens
        self.status, self.text = source.status, source.text
        self.prefix_offset, self.read_offset = source.prefix_offset, source.read_offset
        self.cumulative_logprob = source.cumulative_logprob

    def detached(self) -> "Sequence":
        """A copy outside the request's sequences and the KV cache (a beam that finished)."""
        copy = Sequence(self.request, self.index, [])
        copy.become(self)
        return copy

    def take_output(self, delta: bool) -> CompletionOutput | None:
        """This sample's output: all of it, or (``delta``) what was not handed back before (None: nothing new).

        With stop strings, the last ``len(longest) - 1`` characters are held back until more text follows (they
        could begin one), so text once handed back is never cut again.
        """
        end = len(self.text) if self.is_finished else max(0, len(self.text) - self.request.stop_holdback)
        first_token, first_char = (self.num_sent_tokens, self.num_sent_chars) if delta else (0, 0)
        if delta and (self.sent_finish or (self.num_output_tokens == first_token and end <= first_char
                                           and not self.is_finished)):
            return None
        start = self.request.num_prompt_tokens + first_token
        output = CompletionOutput(
            index=self.index,
            text=self.text[first_char:end],
            token_ids=self.token_ids[start:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs[first_token:] if self.logprobs is not None else None,
            cumulative_logprob=(self.cumulative_logprob
                                if self.logprobs is not None or self.request.params.use_beam_search else None),
        )
        if delta:
            self.num_sent_tokens, self.num_sent_chars = self.num_output_tokens, max(first_char, end)
            self.sent_finish = self.is_finished
        return output


@dataclass
class Request:
    """A prompt with its sampling parameters; it starts as one sequence and forks into ``n`` after the prompt.

    ``stop_ids`` (stop tokens, and EOS unless ignored) and ``stop_holdback`` are worked out once, at creation.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    eos_token_id: int | None = None  # the tokenizer's, among them (its stop_reason is None, as in vLLM)
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when it was first admitted
    admitted: bool = False  # once: a request admitted again after a preemption keeps its first num_cached_tokens
    error: str | None = None
    error_param: str | None = None  # the parameter at fault when ``error`` is the request's own doing
    grammar: Future | None = None  # the compiled constraint of structured outputs (compiling, then compiled)
    cache_salt: bytes | None = None  # prefix-cache blocks are shared only among requests with the same salt
    prompt_logprobs: list[dict[int, float] | None] | None = None  # as computed so far (``params.prompt_logprobs``)
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank, alongside
    sent_prompt_logprobs: bool = False
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # ``params.bad_words``, tokenized
    lora: LoRAAdapter | None = None  # the adapter the request runs under (None: the base model)
    beams: BeamState | None = None  # the search of a ``use_beam_search`` request
    priority: int = 0  # under the priority scheduling policy, lower runs first

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs = [Sequence(self, 0, list(self.prompt_token_ids))]
        params = self.params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        self.stop_holdback = max((len(s) for s in params.stop), default=1) - 1
        if params.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]
        if params.use_beam_search and params.n > 1:  # one beam is greedy decoding, as in `generate`
            self.beams = BeamState(params.n, max(2, 1 + len(self.stop_ids)) * params.n, live=[self.seqs[0]])

    def wire_fields(self) -> dict:
        """What another rank rebuilds this request from (``Request(**fields)``), before any step touched it."""
        return dict(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                    params=self.params, seed=self.seed, eos_token_ids=self.eos_token_ids,
                    eos_token_id=self.eos_token_id, cache_salt=self.cache_salt,
                    bad_words_token_ids=self.bad_words_token_ids, priority=self.priority,
                    arrival_time=self.arrival_time)  # ties of priority are broken alike on every rank

    @property
    def scores_prompt(self) -> bool:
        """Whether prompt tokens still need their logprobs (so none of the prompt is read from the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def adapter(self) -> bytes | None:
        """What the request's adapter computes (None: the base model), which ``max_loras`` counts: not its
        ``lora_int_id``, which another adapter may take once this one leaves the engine's table."""
        return None if self.lora is None else self.lora.digest

    # What the sampler needs of the request at every step, as tensors made once.
    @cached_property
    def prompt_tensor(self) -> torch.Tensor:
        return torch.tensor(self.prompt_token_ids, dtype=torch.long)

    @cached_property
    def stop_ids_tensor(self) -> torch.Tensor:
        return torch.tensor(sorted(self.stop_ids), dtype=torch.long)

    @cached_property
    def allowed_ids_tensor(self) -> torch.Tensor:
        return torch.tensor(sorted(set(self.params.allowed_token_ids)), dtype=torch.long)

    @cached_property
    def logit_bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        bias = self.params.logit_bias
        return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float32)

    @property
    def is_finished(self) -> bool:
        # A request aborted before its prompt forked into n samples has fewer sequences, all finished.
        complete = len(self.seqs) == self.params.n if self.beams is None else self.beams.done
        return all(seq.is_finished for seq in self.seqs) and (
            complete or any(seq.finish_reason == "abort" for seq in self.seqs))

    def take_output(self) -> RequestOutput | None:
        """The output this request hands back now, per its ``output_kind`` (None: nothing to hand back yet)."""
        kind, finished = self.params.output_kind, self.is_finished or self.error is not None
        if (kind is RequestOutputKind.FINAL_ONLY or self.beams is not None) and not finished:
            return None  # a search's beams change until it ends
        delta = kind is RequestOutputKind.DELTA
        if self.beams is not None:  # the finished beams, best first (none when aborted before the search ended)
            outputs = [self._beam_output(rank, hypothesis.seq) for rank, hypothesis in
                       enumerate(self.beams.finished)] if self.beams.done else []
        else:
            outputs = [seq.take_output(delta) for seq in sorted(self.seqs, key=lambda s: s.index)]
        prompt_logprobs = prompt_ranks = None
        if self.prompt_logprobs is not None and not self.scores_prompt and not (delta and self.sent_prompt_logprobs):
            prompt_logprobs, prompt_ranks, self.sent_prompt_logprobs = self.prompt_logprobs, self.prompt_ranks, True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[output for output in outputs if output is not None],
            finished=finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            error_param=self.error_param,
            prompt_logprobs=prompt_logprobs,
            prompt_ranks=prompt_ranks,
            lora_request=None if self.lora is None else self.lora.request,
        )

    @staticmethod
    def _beam_output(rank: int, seq: Sequence) -> CompletionOutput:
        return CompletionOutput(index=rank, text=seq.text, token_ids=seq.output_token_ids,
                                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                                cumulative_logprob=seq.cumulative_logprob)
