"""Beam search as Transformers' ``generate(num_beams=...)`` decides it, in the engine: each step keeps the best
continuations of a request's live beams, sets aside those that end (EOS, a stop token, the length limit) as finished
hypotheses scored with ``length_penalty``, and stops when no live beam can beat the finished ones. `beam_step` is a
pure function of one step's candidates; the scheduler applies it, and the beams share their KV blocks.

Scores are float32 sums of float32 log-probabilities, computed with torch exactly as `generate` does, so the beams
and their order are `generate`'s wherever the model's logits are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from .outputs import RequestOutputKind
from .sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from .sequence import Sequence

Candidates = tuple[list[int], list[float]]  # a beam's likeliest next tokens and their log-probabilities, best first


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search`: ``beam_width`` beams of at most ``max_tokens`` new tokens each, with
    Transformers' ``early_stopping`` beside its ``length_penalty``. Beams are ranked by the model's own
    log-probabilities, so ``temperature`` must stay 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def sampling_params(self) -> SamplingParams:
        if self.temperature != 0:
            raise InvalidParameter("temperature", f"BeamSearchParams.temperature must be 0 (beams are ranked by the "
                                   f"model's own log-probabilities), got {self.temperature!r}")
        return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=0.0, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                              include_stop_str_in_output=self.include_stop_str_in_output, use_beam_search=True,
                              output_kind=RequestOutputKind.FINAL_ONLY)


@dataclass
class BeamSearchSequence:
    """One finished beam of `LLM.beam_search`, as vLLM's: ``tokens`` and ``text`` hold the prompt too."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


@dataclass(frozen=True)
class Choice:
    """A continuation a step keeps: live beam ``source`` (its index in `BeamState.live`) followed by ``token``, with
    its cumulative log-probability; a finished one also has its ``score`` (``logprob / length ** length_penalty``)."""

    source: int
    token: int
    logprob: float
    score: float | None = None


@dataclass
class Hypothesis:
    """A finished beam: a detached, finished sequence, and its score."""

    seq: Sequence
    score: float


@dataclass
class BeamState:
    """A beam-search request's search: its live beams, best first, the best ``width`` finished ones, and the candidates
    each live beam's last step gave (a step of the search waits until every live beam has them)."""

    width: int
    keep: int  # candidates looked at per step: (1 + stop tokens, at least 2) x width, as Transformers keeps
    live: list[Sequence]
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True  # whether a live beam may still beat the worst finished one (Transformers' heuristic)
    pending: dict[int, Candidates] = field(default_factory=dict)  # by seq_id
    done: bool = False

    def ready(self) -> bool:
        return all(seq.seq_id in self.pending for seq in self.live)


@dataclass(frozen=True)
class BeamStep:
    running: list[Choice]  # the beams that go on, best first
    finished: list[Hypothesis | Choice]  # the best finished beams after the step (new ones as choices), best first
    improvable: bool
    done: bool


def beam_step(state: BeamState, params: SamplingParams, scores: list[float], rows: list[Candidates], generated: int,
              limit: int, stop_ids: frozenset[int]) -> BeamStep:
    """One step of the search: ``scores`` are the live beams' cumulative log-probabilities, ``rows`` their candidates,
    ``generated`` the tokens each has, ``limit`` the most it may have.

    As Transformers: of the best ``keep`` continuations, the first ``width`` that do not end go on; those among the
    first ``width`` that end join the finished ones (unless the heuristic already ruled improvement out, or
    ``early_stopping=True`` and ``width`` beams are finished); the search ends when no beam goes on, when the best live
    beam's score at its current length (at ``limit`` for ``early_stopping="never"`` with a positive penalty) cannot
    beat the worst of ``width`` finished ones, or, with ``early_stopping=True``, once ``width`` are finished.
    """
    width, penalty = state.width, params.length_penalty
    ids = torch.tensor([row[0] for row in rows], dtype=torch.long)
    totals = (torch.tensor([row[1] for row in rows], dtype=torch.float32)
              + torch.tensor(scores, dtype=torch.float32).unsqueeze(1)).flatten()
    top, index = totals.topk(min(state.keep, totals.numel()))
    length = generated + 1
    sources, tokens, logprobs = (index // ids.shape[1]).tolist(), ids.flatten()[index].tolist(), top.tolist()
    ends = [length >= limit or token in stop_ids for token in tokens]
    candidates = list(zip(sources, tokens, logprobs, (top / _length_factor(length, penalty)).tolist(), ends))
    running = [Choice(s, t, lp) for s, t, lp, _, end in candidates if not end][:width]
    finished: list = list(state.finished)
    if state.improvable and not (params.early_stopping is True and len(finished) == width):
        finished += [Choice(s, t, lp, score) for s, t, lp, score, end in candidates[:width] if end]
        finished = sorted(finished, key=lambda beam: beam.score, reverse=True)[:width]
    improvable = state.improvable
    if running and len(finished) == width:
        horizon = limit if params.early_stopping == "never" and penalty > 0 else length
        best = torch.tensor(running[0].logprob, dtype=torch.float32) / _length_factor(horizon, penalty)
        improvable = improvable and best.item() > min(beam.score for beam in finished)
    done = not running or not improvable or (params.early_stopping is True and len(finished) == width)
    return BeamStep(running, finished, improvable, done)


def _length_factor(length: int, penalty: float) -> float:
    """``length ** penalty``, infinite past a float's range (an extreme penalty ranks beams alike, without failing)."""
    try:
        return length**penalty
    except OverflowError:
        return math.inf


def beam_candidates(logits: torch.Tensor, draws: list[tuple[Sequence, int]],
                    draw_rows: list[int]) -> list[Candidates | None] | None:
    """Per draw (from row ``draw_rows[i]`` of ``logits``), a beam search's candidates: the ``keep`` likeliest tokens
    by the model's own log-probabilities (float32), with ``repetition_penalty`` applied to those of the beam's tokens
    so far, as `generate`'s beam search applies it; None for other rows, and None when no row is a beam's."""
    rows = [row for row, (seq, _) in enumerate(draws) if seq.request.beams is not None]
    if not rows:
        return None
    keep = [draws[row][0].request.beams.keep for row in rows]
    logprobs = logits[[draw_rows[row] for row in rows]].float().log_softmax(dim=-1)
    for i, row in enumerate(rows):
        seq = draws[row][0]
        penalty = seq.request.params.repetition_penalty
        if penalty != 1:
            seen = torch.tensor(seq.token_ids, device=logprobs.device)
            seen = seen[seen < logprobs.shape[-1]]  # tokens past the output layer's (never generated) go unpenalised
            scores = logprobs[i, seen]
            logprobs[i, seen] = torch.where(scores < 0, scores * penalty, scores / penalty)
    top = logprobs.topk(min(max(keep), logits.shape[-1]), dim=-1)
    candidates: list[Candidates | None] = [None] * len(draws)
    for row, k, ids, logprobs in zip(rows, keep, top.indices.tolist(), top.values.tolist()):
        candidates[row] = (ids[:k], logprobs[:k])
    return candidates
