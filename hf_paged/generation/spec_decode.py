"""Speculative decoding: cheap guesses of a sequence's next tokens, verified by the model in one step.

A running sequence with proposals (`Speculator.propose`) computes its last token and its ``k`` guesses in one step, and
the model's logits at those ``k + 1`` positions decide how many guesses it keeps (`verify_drafts`):

* greedy rows keep guesses while each equals the model's argmax, then take the argmax where they differ (or after
  the last guess): the tokens are exactly those of decoding one token at a time;
* sampled rows use rejection sampling against the proposal, which for prompt lookup is certain (one-hot): guess
  ``d`` is kept with probability ``p(d)``, and a rejected position draws from ``p`` without ``d``, renormalised. The
  output has the model's distribution. Draws are counter-based, seeded per request, as in the sampler.

The guesses' KV slots past the kept ones are given back by moving ``num_computed_tokens`` back (no copy; see
`Scheduler._settle_guesses`). Guesses come from prompt lookup (method ``ngram``, `propose_ngram`), made before the
step is scheduled, or from a draft model (``draft_model``, `DraftModel`), which the scheduler first gives room for and
which then writes them once the step's blocks are allocated.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence as TokenList
from typing import TYPE_CHECKING

import numpy as np
import torch

from .config import SpeculativeConfig
from .sampler import NO_TOKEN, SamplerOutput, build_sampling_batch, sample, target_probs, uniform_from_counter

if TYPE_CHECKING:
    from .draft_model import DraftModel
    from .scheduler import SchedulerOutput
    from .sequence import Sequence

_ACCEPT_STREAM = 1  # the uniform numbers of the accept tests, apart from those that pick tokens


def propose_ngram(token_ids: TokenList[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
    ``n`` tokens, for the longest ``n`` from ``max_n`` down to ``min_n`` that occurs; ``[]`` when none does."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram but the suffix
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []


def next_window(window: int, guessed: int, kept: int, most: int) -> int:
    """The heuristic schedule's guesses for a sequence's next step, after a step that verified ``guessed`` guesses
    and kept ``kept``: two more when it kept them all, one fewer (at least one) otherwise, at most ``most``."""
    return min(most, window + 2) if kept == guessed else max(1, window - 1)


def accepted_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a greedy sequence keeps: its guesses while each equals the model's choice, then the model's choice
    at the first difference (or after the last guess). ``targets`` has one more entry than ``drafts``."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return targets[: n + 1]


def accepted_sampled(drafts: list[int], accept: list[bool], picks: list[int]) -> list[int]:
    """Rejection sampling's result: guesses up to the first rejected one, then that position's pick (drawn without
    the rejected guess) or, all kept, the pick after the last guess."""
    n = 0
    while n < len(drafts) and accept[n]:
        n += 1
    return drafts[:n] + [picks[n]]


class Speculator:
    """Proposes guesses for the running sequences of each step and counts how many the model kept."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None):
        self.config = config
        self.max_len = draft.max_positions if draft is not None else max_model_len  # the draft's is the shorter
        self.draft = draft
        self.num_drafts = 0  # verifications of at least one guess
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_per_position = [0] * config.num_speculative_tokens  # guesses kept at each position
        # Per sequence, the most guesses the heuristic schedule gives its next step (`next_window`); an entry goes
        # with its sequence (a preempted one keeps its window).
        self.windows: weakref.WeakKeyDictionary[Sequence, int] = weakref.WeakKeyDictionary()

    def budget(self, seq: Sequence) -> int:
        """How many guesses ``seq`` may take now: none while it is prefilling, is a beam, asks for logprobs,
        penalties, a grammar (or one that starts when its reasoning block ends: guesses kept past the end would escape
        it) or bad words of several tokens (which change with every token), must not stop yet (min_tokens), or has too
        little room left."""
        params = seq.request.params
        # A prompt (no output yet) takes none: with n > 1 it forks after this step, and its samples must start even.
        if (seq.num_tokens - seq.num_computed_tokens != 1 or seq.num_output_tokens == 0 or params.logprobs is not None
                or seq.matcher is not None or seq.in_reasoning or params.use_beam_search
                or params.repetition_penalty != 1 or params.presence_penalty or params.frequency_penalty
                or seq.num_output_tokens < params.min_tokens
                or any(len(word) > 1 for word in seq.request.bad_words_token_ids)):
            return 0
        room = self.max_len - seq.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        heuristic = self.config.num_speculative_tokens_schedule == "heuristic"
        window = self.windows.get(seq, 1)
        return max(0, min(window if heuristic else self.config.num_speculative_tokens, room))

    def propose(self, running: list[Sequence]) -> dict[int, list[int]]:
        """Before the step is scheduled: the guesses of the running sequences that speculate, by seq_id (none while
        the batch is large), for `Scheduler.schedule`. A draft model's are placeholders, as many as the sequence may
        take, that `write_drafts` fills."""
        large = len(running) > self.config.disable_by_batch_size
        if self.draft is not None:
            self.draft.retain(running)
        c, guesses = self.config, {}
        for seq in [] if large else running:
            k = self.budget(seq)
            if not k:
                continue
            proposal = [0] * k if self.draft is not None else propose_ngram(seq.token_ids, k, c.prompt_lookup_min,
                                                                            c.prompt_lookup_max)
            if proposal:
                guesses[seq.seq_id] = proposal
        return guesses

    def write_drafts(self, out: SchedulerOutput) -> None:
        """After the step is scheduled, before it is computed: the draft model's guesses (nothing for ngram). A step
        of more sequences than speculate in a batch, none of them speculating, the draft sits out."""
        if self.draft is None:
            return
        if out.spec_token_ids or len(out.seqs) <= self.config.disable_by_batch_size:
            out.spec_token_ids.update(self.draft.write_guesses(out))  # as many as the scheduler took, in place
        else:
            self.draft.skip(out)

    def record_step(self, out: SchedulerOutput, sampled: SamplerOutput) -> None:
        """Count the verifications of a step, once it is committed (a step undone, and computed again, counts once)."""
        if not out.spec_token_ids:
            return
        for row, (seq, _) in enumerate(out.draws):
            self.record(seq, out.spec_token_ids.get(seq.seq_id, []), sampled.new_tokens(row))

    def record(self, seq: Sequence, drafts: list[int], kept: list[int]) -> None:
        """Count a verification: ``kept`` is what ``seq`` took from its ``drafts``, then the model's own token."""
        if drafts:
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += len(kept) - 1
            for position in range(len(kept) - 1):
                self.num_accepted_per_position[position] += 1
            self.windows[seq] = next_window(self.windows.get(seq, 1), len(drafts), len(kept) - 1,
                                            self.config.num_speculative_tokens)


def verify_drafts(logits: torch.Tensor, out: SchedulerOutput) -> SamplerOutput:
    """Sample a step that verifies guesses: ``logits`` has, for draw ``i``, rows ``draw_rows[i]`` onwards, one per
    position from its last token to its last guess. Returns each draw's final token in ``token_ids`` and the guesses
    it kept before it in ``accepted``."""
    rows, draws, offsets, spans = [], [], [], []
    for (seq, k), first in zip(out.draws, out.draw_rows):
        drafts = out.spec_token_ids.get(seq.seq_id, [])
        spans.append((len(rows), drafts))
        for j in range(len(drafts) + 1):
            rows.append(first + j)
            draws.append((seq, k))
            offsets.append(j)
    logits = logits[rows]
    batch = build_sampling_batch(draws, logits.device, offsets)
    # Every row drawn as without speculation: the greedy rows' choices, and the sampled rows' tokens where no guess
    # was rejected (a row without a guess draws exactly what it would have drawn in a step without any).
    drawn = sample(logits, batch)
    plain = drawn.token_ids
    accept, residual = (None, None) if batch.all_greedy else _rejection_draws(logits, batch, spans)
    tokens, accepted = [], []
    for (start, drafts), (seq, _) in zip(spans, out.draws):
        end = start + len(drafts)
        if seq.request.params.greedy:
            kept = accepted_greedy(drafts, plain[start : end + 1])
        else:
            kept = accepted_sampled(drafts, accept[start:end], residual[start:end] + [plain[end]])
        tokens.append(kept[-1])
        accepted.append(kept[:-1])
    # Logprobs: only sequences that do not speculate ask for them, and their one row is their first.
    firsts = [start for start, _ in spans]

    def first_rows(values):
        return None if values is None else [values[row] for row in firsts]

    return SamplerOutput(tokens, first_rows(drawn.sampled_logprobs), first_rows(drawn.sampled_ranks),
                         first_rows(drawn.top_ids), first_rows(drawn.top_logprobs), accepted=accepted)


def _rejection_draws(logits: torch.Tensor, batch, spans: list[tuple[int, list[int]]]) -> tuple[list, list]:
    """For every row with a guess: whether the guess is kept (with probability ``p(guess)``), and a token drawn from
    the model's distribution without the guess, renormalised (what a rejected position takes)."""
    probs = target_probs(logits, batch).double()
    guess = torch.zeros(probs.shape[0], dtype=torch.long, device=probs.device)
    for start, drafts in spans:
        guess[start : start + len(drafts)] = torch.tensor(drafts, dtype=torch.long)
    p_guess = probs.gather(1, guess.unsqueeze(1)).squeeze(1)
    accept = uniform_from_counter(batch.seeds, batch.counters, _ACCEPT_STREAM) < p_guess
    cdf = probs.scatter(1, guess.unsqueeze(1), 0.0).cumsum(dim=-1)
    threshold = uniform_from_counter(batch.seeds, batch.counters) * cdf[:, -1]
    picks = torch.searchsorted(cdf, threshold.unsqueeze(1)).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    picks = picks.masked_fill(probs.isnan().any(dim=-1), NO_TOKEN)  # every token masked: no distribution
    return accept.tolist(), picks.tolist()
