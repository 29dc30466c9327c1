"""Requests, their sequences, and the outputs handed back to users."""

from __future__ import annotations

import enum
import itertools
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of a request: its prompt, its ``n`` outputs so far, and whether it has finished.

    ``error`` is set (and ``outputs`` empty) when the request was refused, e.g. a prompt longer than the model's
    context; the other requests are unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None


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
        self.matcher = None  # a structured_outputs.GrammarMatcher over the output tokens, for constrained requests

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
        """Sequences this one will be once it has a token: ``n`` for a request's first, not yet forked, else 1."""
        return self.request.params.n if len(self.request.seqs) == 1 and self.num_output_tokens == 0 else 1

    def fork(self, index: int) -> "Sequence":
        """A sibling sample that shares everything computed so far."""
        child = Sequence(self.request, index, list(self.token_ids))
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.text, child.prefix_offset, child.read_offset = self.text, self.prefix_offset, self.read_offset
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.matcher = self.matcher.fork() if self.matcher is not None else None
        return child

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )


@dataclass
class Request:
    """A prompt with its sampling parameters; it starts as one sequence and forks into ``n`` after the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    grammar: Future | None = None  # the compiled constraint of structured outputs, while it compiles and after

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        self.seqs = [Sequence(self, 0, list(self.prompt_token_ids))]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(seq.is_finished for seq in self.seqs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[seq.to_output() for seq in sorted(self.seqs, key=lambda s: s.index)],
            finished=self.is_finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
        )
