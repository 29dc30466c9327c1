"""What a request hands back: `RequestOutput` with one `CompletionOutput` per sample, cumulative, as deltas, or only
once finished (`RequestOutputKind`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ..lora import LoRARequest


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names).

    ``CUMULATIVE``: everything generated so far (copies grow with the output). ``DELTA``: only what the step added,
    so a step's work never grows with the length generated before (merge with `RequestOutput.add`).
    ``FINAL_ONLY``: one output, when the request finishes.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class Logprob(float):
    """A token's log-probability: a float, with vLLM's ``Logprob`` fields ``logprob`` (the same number), ``rank``
    (1: the likeliest token at its position) and ``decoded_token`` (the token's text)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None):
        entry = super().__new__(cls, logprob)
        entry.rank, entry.decoded_token = rank, decoded_token
        return entry

    def __reduce__(self):  # pickled with its fields (a float's own reduction drops them)
        return Logprob, (float(self), self.rank, self.decoded_token)

    @property
    def logprob(self) -> float:
        return float(self)


def ranked_logprobs(entry: dict[int, float], token: int, rank: int, text) -> dict[int, Logprob]:
    """One position's logprobs as `Logprob` objects: ``entry`` holds the likeliest tokens in order (ranks 1, 2, ...)
    and ``token`` (the one sampled or prompted), whose own ``rank`` is given; ``text(id)`` is a token's text."""
    ranked = {t: Logprob(lp, place, text(t)) for place, (t, lp) in enumerate(entry.items(), 1)}
    ranked[token] = Logprob(entry[token], rank, text(token))
    return ranked


@dataclass
class CompletionOutput:
    """One generated sequence of a request (or, with ``DELTA``, what it added since its last output)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, later: "CompletionOutput") -> None:
        """Append a later delta of the same sample."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.cumulative_logprob = later.cumulative_logprob


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0  # of the longest sample


@dataclass
class RequestOutput:
    """A request's prompt, its outputs (see `RequestOutputKind`), and whether it has finished.

    ``prompt_token_ids`` is the request's own list, shared and not copied: do not change it. ``error`` is set when
    the request was refused (``outputs`` empty; e.g. a prompt longer than the model's context) or failed while
    running; the other requests are unaffected. ``error_param`` names the request parameter at fault when the
    failure was the request's own doing (an invalid constraint, one too slow to enforce).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    error_param: str | None = None
    # With ``prompt_logprobs``: one {token id: logprob} per prompt token, None for the first; in every output once the
    # prompt is computed (a DELTA request's: in the first such output only).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # alongside: each prompt token's rank there (1: the likeliest)
    lora_request: LoRARequest | None = None  # the adapter it ran under (vLLM's)

    def add(self, later: "RequestOutput") -> None:
        """Merge a later ``DELTA`` output of the same request into this one."""
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.prompt_ranks = self.prompt_ranks or later.prompt_ranks
        mine = {output.index: output for output in self.outputs}
        for output in later.outputs:
            if output.index in mine:
                mine[output.index].add(output)
            else:
                self.outputs.append(output)
        self.outputs.sort(key=lambda output: output.index)
        self.finished, self.metrics, self.error = later.finished, later.metrics, later.error
        self.error_param = later.error_param
        self.num_cached_tokens = later.num_cached_tokens
