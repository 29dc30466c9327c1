"""The `Scheduler`: decides what each step computes, and owns every change to a sequence after it (tokens appended,
forks, stops, preemption, freeing, and the rollback of a failed step)."""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, CancelledError, wait
from dataclasses import dataclass, field

from ..cache import KVCacheManager
from ..cache.kv_cache_manager import BlockCopy
from ..reasoning import ReasoningEnd
from .beam_search import Choice, Hypothesis, beam_step
from .config import EngineConfig
from .detokenizer import Detokenizer
from .outputs import ranked_logprobs
from .sampler import NO_TOKEN, SamplerOutput
from .sequence import Request, Sequence, SequenceStatus
from .stopping import Stop, check_stop, token_stop
from .sampling_params import InvalidParameter, SamplingParams
from .structured_outputs import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """What one step computes: ``num_tokens[i]`` new tokens of ``seqs[i]``, one-token sequences (decodes) first.

    ``draws`` are the tokens the step samples, ``(sequence, k)``: the ``k``-th sample drawn from that sequence's
    logits, which are row ``draw_rows[i]`` of the runner's logits (a prompt with ``n > 1`` is drawn ``n`` times).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    block_copies: list[BlockCopy] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue for this step
    first_admitted: list[Request] = field(default_factory=list)  # admitted for the first time (their cached tokens)
    prefix_matches: list[tuple[int, int]] = field(default_factory=list)  # (tokens, cached) per admission
    # Running prompts that took blocks others computed: (sequence, tokens it had computed, tokens it then held).
    caught_up: list[tuple[Sequence, int, int]] = field(default_factory=list)
    num_partial_prefills: int = 0  # prompt chunks that leave the rest of their prompt for later steps
    draws: list[tuple[Sequence, int]] = field(default_factory=list)
    draw_rows: list[int] = field(default_factory=list)
    # Speculative guesses computed this step after a sequence's last token, by seq_id (as many of those proposed to
    # `Scheduler.schedule` as the budget and the blocks allow); ``num_tokens`` counts them and the logits have a row
    # for each, after its sequence's draw row.
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # Prompt logprobs: ``(sequence, first position, count)``, positions whose logits score the prompt token after
    # them; their rows follow all the others, in this order.
    prompt_logprob_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # beam searches that cannot fit in the KV cache

    @property
    def num_prompt_logprob_rows(self) -> int:
        return sum(count for _, _, count in self.prompt_logprob_spans)

    def samples(self, i: int) -> bool:
        """Whether the step computes ``seqs[i]``'s last known token, so that the next is drawn from its logits. The
        runner's logits hold, in step order, one row for each such sequence and one for each of its guesses, then
        the prompt-logprob rows."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_tokens[i] >= seq.num_tokens


class Scheduler:
    """Each step: which sequences compute how many tokens; after it: what their sampled tokens do to them.

    A sequence never has phases: it has ``token_ids`` and ``num_computed_tokens``, and each step computes some of the
    difference. Running sequences go first (a decode is one token; a prompt being prefilled in chunks takes what
    the budget leaves), then waiting ones in arrival order. When blocks run out the newest running sequence is
    preempted: its blocks are freed and it waits to be recomputed (prefix caching usually makes that cheap). Under
    the ``priority`` policy both queues are kept in order of the requests' priority (lower first), then arrival: the
    waiting are admitted, and the running scheduled, in that order, and the last running is preempted first.
    ``config.max_num_batched_tokens`` is each step's budget, set (the engine sets it when the caller did not).
    """

    def __init__(self, config: EngineConfig, kv_manager: KVCacheManager, detokenizer: Detokenizer,
                 max_model_len: int):
        self.config = config
        self.kv_manager = kv_manager
        self.detokenizer = detokenizer
        self.max_model_len = max_model_len
        self.reasoning_end = ReasoningEnd(detokenizer.tokenizer, config.reasoning_parser) if config.reasoning_parser \
            else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.compiling: dict[str, Request] = {}  # constrained requests whose grammar is not compiled yet, by id
        self.num_preemptions = 0
        self.num_partial_prefills = 0  # prompt chunks that left the rest of their prompt for later steps
        self.num_prompt_tokens = 0  # of the requests whose prompt was computed (their first token came)
        self.num_generated_tokens = 0

    def reset_counters(self) -> None:
        """Start the token counts again (the engine's start-up probe is not counted)."""
        self.num_prompt_tokens = self.num_generated_tokens = 0

    def add(self, request: Request) -> None:
        if request.grammar is not None:
            self.compiling[request.request_id] = request
        else:
            self._wait(request.seqs[0])

    def _wait(self, seq: Sequence, first: bool = False) -> None:
        """Queue ``seq`` last (``first``: first) among the waiting of its priority, under the priority policy."""
        if self.config.scheduling_policy == "priority":
            (bisect.insort_left if first else bisect.insort_right)(self.waiting, seq, key=_priority)
        elif first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _run(self, seq: Sequence) -> None:
        """Add ``seq`` to the running, last among those of its priority under the priority policy."""
        if self.config.scheduling_policy == "priority":
            bisect.insort_right(self.running, seq, key=_priority)
        else:
            self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.compiling)

    def admit_compiled(self) -> list[Request]:
        """Queue the requests whose grammar has compiled, and fail those whose grammar did not; returns the failed.

        A request waits here, out of the batch, while its grammar compiles on another thread; with nothing else to
        run the engine waits for the first grammar a little rather than spin.
        """
        if not (self.waiting or self.running):
            wait([r.grammar for r in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        failed = []
        for request in [r for r in self.compiling.values() if r.grammar.done()]:
            del self.compiling[request.request_id]
            error = CancelledError("its grammar's compile was cancelled") if request.grammar.cancelled() else \
                request.grammar.exception()
            if error is not None:
                self.fail(request, str(error), getattr(error, "param", None))
                failed.append(request)
            else:
                self._queue_constrained(request.seqs[0])
        return failed

    def _queue_constrained(self, seq: Sequence) -> None:
        """Queue a request whose grammar compiled: constrained from its first token, or, with a reasoning parser,
        from the end of the reasoning block its prompt opens or its first token may open (see `_append`)."""
        start = "after" if self.reasoning_end is None else self.reasoning_end.start(seq.request.prompt_token_ids)
        seq.in_reasoning = start == "inside"
        if not seq.in_reasoning:
            seq.matcher = GrammarMatcher.of(seq.request.grammar.result())
        if start == "may_open":
            seq.reasoning_opener = self.reasoning_end.open_id
        self._wait(seq)

    def _start_grammar(self, seq: Sequence) -> None:
        """The reasoning block of ``seq`` has ended: its grammar starts, from the text after the tag."""
        seq.in_reasoning, seq.matcher = False, GrammarMatcher.of(seq.request.grammar.result())
        carried = self.reasoning_end.after(seq.text)
        if carried and not seq.matcher.accept_text(carried):
            raise InvalidParameter("structured_outputs", f"the token that ended the reasoning block carried "
                                   f"{carried[:40]!r} after </think>, which the constraint does not allow")

    # ------------------------------------------------------------------------------------------------- schedule
    def schedule(self, guesses: dict[int, list[int]] | None = None) -> SchedulerOutput:
        """The next step; ``guesses`` are the speculative tokens proposed for running sequences, by seq_id, which
        they compute after their last token where the budget and the free blocks allow."""
        out = SchedulerOutput()
        preemptions = self.num_preemptions
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, guesses or {})
        if self.num_preemptions == preemptions:  # admit only when nobody had to be preempted
            self._schedule_waiting(out, budget)
        out.num_partial_prefills = sum(n < s.num_tokens - s.num_computed_tokens for s, n in zip(out.seqs,
                                                                                                  out.num_tokens))
        order = sorted(range(len(out.seqs)), key=lambda i: out.num_tokens[i] != 1)
        out.seqs, out.num_tokens = [out.seqs[i] for i in order], [out.num_tokens[i] for i in order]
        self._plan_draws(out)
        now = time.monotonic()
        for seq in out.seqs:
            seq.request.metrics.first_scheduled_time = seq.request.metrics.first_scheduled_time or now
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, proposed: dict[int, list[int]]) -> int:
        running, searches = list(self.running), set()
        for i, seq in enumerate(running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if seq.request.beams is not None:
                if seq.request.request_id not in searches:  # its beams are scheduled with its first
                    searches.add(seq.request.request_id)
                    budget = self._schedule_beams(out, seq.request, budget)
                continue
            self._catch_up(out, seq)
            # Guesses take only the budget left once every later sequence has a token: they are optional.
            needed = self._chunk(seq, seq.num_tokens - seq.num_computed_tokens)
            guesses = proposed.get(seq.seq_id, [])[: max(0, budget - needed - (len(running) - 1 - i))]
            n = min(needed + len(guesses), budget)
            copies = self._grow(seq, n)
            if copies is None and (guesses or out.spec_token_ids):  # guesses never cost a preemption
                guesses = []
                budget += self._drop_guesses(out)
                n = min(needed, budget)
                copies = self._grow(seq, n)
            while copies is None and seq.status is SequenceStatus.RUNNING:
                self._preempt(self.running[-1])
                if seq.status is SequenceStatus.RUNNING:
                    copies = self._grow(seq, n)
            if copies is not None:
                self._take(out, seq, n, copies)
                if n > needed:
                    out.spec_token_ids[seq.seq_id] = guesses[: n - needed]
                budget -= n
        return budget

    def _schedule_beams(self, out: SchedulerOutput, request: Request, budget: int) -> int:
        """Schedule the running beams of a search together: each takes what it needs of ``budget``, and their blocks
        are found for all of them or (the newest sequences preempted first; the beams themselves, all together, when
        they are the newest) for none. Returns the budget left."""
        beams = [seq for seq in request.seqs if seq.status is SequenceStatus.RUNNING]
        for beam in beams:
            if beam.num_tokens - beam.num_computed_tokens > 1:  # recomputing after a preemption
                self._share_computed(beam, beams)
        plan = []
        for beam in beams:
            n = min(self._chunk(beam, beam.num_tokens - beam.num_computed_tokens), budget)
            if n > 0 and not self._waits_for(beam, beam.num_computed_tokens, [planned for planned, _ in plan]):
                plan.append((beam, n))
                budget -= n
        needed = self.kv_manager.num_blocks_needed_all([(b.seq_id, b.num_computed_tokens, b.num_computed_tokens + n)
                                                        for b, n in plan])
        if needed > self.kv_manager.pool.num_free_blocks and out.spec_token_ids:  # guesses never cost a preemption
            budget += self._drop_guesses(out)
        while needed > self.kv_manager.pool.num_free_blocks:
            if all(seq.request is request for seq in self.running):  # it holds every block in use
                self._fail_search(out, request)
                return budget + sum(n for _, n in plan)
            victim = self.running[-1]
            self._preempt(victim)
            if victim.request is request:
                return budget + sum(n for _, n in plan)
        for beam, n in plan:
            self._take(out, beam, n, self._grow(beam, n))
        return budget

    def _grow(self, seq: Sequence, n: int) -> list[BlockCopy] | None:
        """Room for ``n`` more tokens of running ``seq``: its block copies, or None (nothing changed) if short."""
        return self.kv_manager.allocate(seq.seq_id, seq.num_computed_tokens, seq.num_computed_tokens + n)

    def _drop_guesses(self, out: SchedulerOutput) -> int:
        """Take the guesses out of the sequences scheduled so far, with the blocks they took; returns their count."""
        dropped = 0
        for i, seq in enumerate(out.seqs):
            guesses = out.spec_token_ids.pop(seq.seq_id, [])
            if guesses:
                out.num_tokens[i] -= len(guesses)
                dropped += len(guesses)
                self.kv_manager.truncate(seq.seq_id, seq.num_tokens)
        return dropped

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        seats = sum(seq.num_samples for seq in self.running)  # n > 1 forks after the prompt
        loras = {seq.request.adapter for seq in self.running} - {None}
        passed: list[Sequence] = []  # of adapters beyond max_loras: they keep their place for a later step
        owed = sum(map(self._owed_blocks, self.running))
        while self.waiting and budget > 0:
            unit = self._waiting_unit()
            samples = sum(seq.num_samples for seq in unit)
            if seats + samples > self.config.max_num_seqs:
                break
            lora = unit[0].request.adapter
            if lora is not None and lora not in loras and len(loras) >= self.config.max_loras:
                passed += [self.waiting.popleft() for _ in unit]
                continue
            plan = self._fit(unit, budget, owed)
            if plan is None and not self.running and unit[0].request.beams is not None:  # every block is free
                self._fail_search(out, unit[0].request)
                continue
            if plan is None:
                break
            for seq, num_cached, n, copies in plan:
                self._admit(out, self.waiting.popleft(), num_cached, n, copies)
                budget -= n
                owed += self._owed_blocks(seq)
            seats += samples
            if lora is not None:
                loras.add(lora)
        self.waiting.extendleft(reversed(passed))

    def _waiting_unit(self) -> list[Sequence]:
        """What is admitted next, all or nothing: the first waiting sequence, with the other beams of a beam search."""
        first = self.waiting[0]
        if first.request.beams is None:
            return [first]
        return list(itertools.takewhile(lambda seq: seq.request is first.request, self.waiting))

    def _fit(self, unit: list[Sequence], budget: int,
             owed: int) -> list[tuple[Sequence, int, int, list[BlockCopy]]] | None:
        """Attach each sequence's cached prefix and find blocks for what it computes of ``budget``, leaving the
        ``owed`` blocks that running prompts still need free: per sequence ``(sequence, cached tokens, tokens, block
        copies)``, or None, every block given back, when they are short."""
        plan = []
        for seq in unit:
            num_cached = self.kv_manager.match_prefix(seq.seq_id, seq.token_ids, seq.request.cache_salt,
                                                      reuse=not seq.request.scores_prompt)
            num_cached = self._share_planned(seq, num_cached, plan)
            n = min(self._chunk(seq, seq.num_tokens - num_cached), budget)
            if self._waits_for(seq, num_cached, [held for held, *_ in plan]):
                n = 0
            # Room for the whole prompt, though only this step's chunk is allocated: one admitted when its rest
            # cannot fit would take the blocks of others as it grows (preempting them, to be computed again).
            needed = self.kv_manager.num_blocks_needed(seq.seq_id, num_cached, seq.num_tokens)
            room = self.kv_manager.pool.num_free_blocks - (self._headroom() if self.running else 0) - owed
            copies = self.kv_manager.allocate(seq.seq_id, num_cached, num_cached + n) if needed <= room else None
            if copies is None:
                for held in unit[: len(plan) + 1]:
                    self.kv_manager.free(held.seq_id)
                return None
            plan.append((seq, num_cached, n, copies))
            budget -= n
        return plan

    def _chunk(self, seq: Sequence, needed: int) -> int:
        """What ``seq``, which needs ``needed`` tokens computed, computes this step, the budget aside: at most
        ``long_prefill_token_threshold`` (vLLM's option; 0 or None: no limit)."""
        cap = self.config.long_prefill_token_threshold
        return min(needed, cap) if cap else needed

    def _catch_up(self, out: SchedulerOutput, seq: Sequence) -> None:
        """A prompt computed in chunks takes the blocks that other sequences computed of its next tokens, earlier in
        this step included (prompts sharing a long prefix, admitted together, each compute a different chunk of it);
        `rollback` gives them back if the step fails."""
        if seq.num_tokens - seq.num_computed_tokens > 1 and not seq.request.scores_prompt:
            held = self.kv_manager.extend_prefix(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                                 seq.request.cache_salt)
            if held > seq.num_computed_tokens:
                out.caught_up.append((seq, seq.num_computed_tokens, held))
                seq.num_computed_tokens = held

    def _share_planned(self, seq: Sequence, num_cached: int, plan: list) -> int:
        """Beams recomputed together share their common prefix: ``seq`` takes the whole blocks of the longest one that
        a beam planned before it holds or computes this step, where longer than its own ``num_cached`` (with or
        without prefix caching). Returns the tokens it now holds."""
        return self._share(seq, num_cached, [(held, cached + n) for held, cached, n, _ in plan])

    def _share_computed(self, beam: Sequence, beams: list[Sequence]) -> None:
        """A beam recomputed in chunks takes what a sibling has computed of their common prefix since (`_waits_for`
        kept it from computing that itself)."""
        siblings = [(other, other.num_computed_tokens) for other in beams if other is not beam]
        beam.num_computed_tokens = self._share(beam, beam.num_computed_tokens, siblings)

    def _share(self, seq: Sequence, num_computed: int, sources: list[tuple[Sequence, int]]) -> int:
        """Give ``seq``, which holds ``num_computed`` tokens, the whole blocks of the longest prefix it has in common
        with a source's first tokens (``(source, tokens)``), where longer. Returns the tokens it now holds."""
        for source, extent in sources:
            common = self._common_blocks(seq, source.token_ids[:extent])
            if common > num_computed:
                self.kv_manager.share_prefix(seq.seq_id, source.seq_id, common)
                num_computed = common
        return num_computed

    def _waits_for(self, beam: Sequence, num_computed: int, siblings: list[Sequence]) -> bool:
        """Whether recomputing ``beam`` leaves the next tokens to a sibling that computes them this step, to take
        them from it in a later step (`_share_computed`) instead of computing them into blocks of its own."""
        return beam.num_tokens - num_computed > 1 and any(
            self._common_blocks(beam, sibling.token_ids) > num_computed for sibling in siblings)

    def _common_blocks(self, seq: Sequence, tokens: list[int]) -> int:
        """The tokens of the whole blocks that ``seq`` has in common with ``tokens``, leaving at least its last token
        to compute (its logits are needed)."""
        mine = seq.token_ids[: seq.num_tokens - 1]
        common = next((i for i, (a, b) in enumerate(zip(tokens, mine)) if a != b), min(len(tokens), len(mine)))
        return common - common % self.kv_manager.block_size

    def _admit(self, out: SchedulerOutput, seq: Sequence, num_cached: int, n: int, copies: list[BlockCopy]) -> None:
        seq.num_computed_tokens = num_cached
        seq.status = SequenceStatus.RUNNING
        self._run(seq)
        out.prefix_matches.append((seq.num_tokens, num_cached))
        if seq.index == 0 and not seq.request.admitted:
            seq.request.num_cached_tokens, seq.request.admitted = num_cached, True
            out.first_admitted.append(seq.request)
        out.admitted.append(seq)
        if n:  # a beam admitted with its siblings past the step's budget computes in a later step
            self._take(out, seq, n, copies)

    def _take(self, out: SchedulerOutput, seq: Sequence, n: int, copies: list[BlockCopy]) -> None:
        """Put ``n`` tokens of ``seq`` in the step, and index the blocks they fill for prefix reuse now, so a later
        sequence of the same step can share them (`rollback` unindexes them if the step fails)."""
        out.seqs.append(seq)
        out.num_tokens.append(n)
        out.block_copies += copies
        if seq.request.scores_prompt:
            first = max(seq.num_computed_tokens, len(seq.request.prompt_logprobs) - 1)
            end = min(seq.num_computed_tokens + n, seq.request.num_prompt_tokens - 1)
            if end > first:
                out.prompt_logprob_spans.append((seq, first, end - first))
        self.kv_manager.cache_blocks(seq.seq_id, seq.token_ids, min(seq.num_computed_tokens + n, seq.num_tokens),
                                     seq.request.cache_salt)

    @staticmethod
    def _plan_draws(out: SchedulerOutput) -> None:
        row = 0
        for i, seq in enumerate(out.seqs):
            if out.samples(i):
                for k in range(seq.num_draws):
                    out.draws.append((seq, k))
                    out.draw_rows.append(row)
                row += 1 + len(out.spec_token_ids.get(seq.seq_id, ()))

    def _owed_blocks(self, seq: Sequence) -> int:
        """Blocks that running ``seq`` will still take for the prompt tokens that later steps compute."""
        return max(0, self.kv_manager.blocks_for(seq.num_tokens) - len(self.kv_manager.block_table(seq.seq_id)))

    def _headroom(self) -> int:
        """Blocks kept free when admitting a new sequence, so running ones can grow without being preempted."""
        return len(self.running) // 2 + self.kv_manager.pool.num_blocks // 100

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and requeue it to be recomputed; a beam goes with all its siblings, in order."""
        beams = seq.request.beams
        for victim in reversed([s for s in self.running if s.request is seq.request] if beams else [seq]):
            self._requeue(victim)
        if beams is not None:
            beams.pending.clear()  # each beam draws its candidates again once recomputed
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._wait(seq, first=True)

    # --------------------------------------------------------------------------------------------------- update
    def update(self, out: SchedulerOutput, sampled: SamplerOutput | None) -> list[Request]:
        """Apply a step's result: advance the computed tokens, fork ``n > 1`` prompts, append each sampled token,
        and finish (and free) the sequences that stop; step the beam searches whose beams all have candidates.
        Returns the requests that changed, in step order.

        A token that cannot be appended (the detokenizer raised, say) fails its own request, not the step.
        """
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens += n
        for num_tokens, num_cached in out.prefix_matches:  # counted once the step stands (`rollback` repeats them)
            self.kv_manager.record_prefix_match(num_tokens, num_cached)
        for seq, num_computed, held in out.caught_up:  # hits among the tokens its admission queried
            if seq.status is SequenceStatus.RUNNING:
                self.kv_manager.record_prefix_match(0, held - num_computed)
                seq.request.num_cached_tokens += (held - num_computed) * (seq.index == 0)
        self.num_partial_prefills += out.num_partial_prefills
        changed: dict[str, Request] = {}
        if sampled is not None and sampled.prompt_logprobs is not None:
            self._add_prompt_logprobs(out, sampled)
        now = time.monotonic()
        seqs = [seq if k == 0 else self._fork(seq, k) for seq, k in out.draws]  # before any sample has a token
        searches: dict[str, Request] = {}
        for row, seq in enumerate(seqs):
            request = seq.request
            changed[request.request_id] = request
            if seq.is_finished:
                continue  # its request failed on an earlier row of this step
            if request.beams is not None:
                request.beams.pending[seq.seq_id] = sampled.beams[row]
                searches[request.request_id] = request
                continue
            tokens = sampled.new_tokens(row)
            if tokens[-1] == NO_TOKEN:
                self.fail(request, *_nothing_allowed(request.params, seq.num_output_tokens))
                continue
            try:
                for token in tokens:
                    if not seq.is_finished:
                        self._append(seq, token, row, sampled, now)
                self._settle_guesses(seq, out)
            except InvalidParameter as err:  # the request's constraint cannot go on (GrammarTooSlow, ...)
                logger.warning("request %s failed: %s", request.request_id, err)
                self.fail(request, str(err), err.param)
            except Exception as err:  # noqa: BLE001 - any failure here is this request's alone
                logger.exception("request %s failed while appending a token", request.request_id)
                self.fail(request, f"generation failed: {type(err).__name__}: {err}")
        self._advance_searches(searches.values(), now)
        return list(changed.values())

    def _token_text(self, params: SamplingParams):
        """How a logprob's token gets its text (``decoded_token``): none where the request asked for no text, as in
        vLLM (``detokenize=False`` costs no decoding)."""
        return self.detokenizer.token_text if params.detokenize else _no_text

    def _add_prompt_logprobs(self, out: SchedulerOutput, sampled: SamplerOutput) -> None:
        for (seq, first, _), scores, ranks in zip(out.prompt_logprob_spans, sampled.prompt_logprobs,
                                                  sampled.prompt_ranks):
            tokens = seq.token_ids[first + 1 : first + 1 + len(scores)]
            text = self._token_text(seq.request.params)
            seq.request.prompt_logprobs += [ranked_logprobs(entry, token, rank, text)
                                            for entry, token, rank in zip(scores, tokens, ranks)]
            seq.request.prompt_ranks += ranks

    # ---------------------------------------------------------------------------------------------- beam search
    def _fail_search(self, out: SchedulerOutput, request: Request) -> None:
        """Fail a beam search whose beams cannot go on even with every other sequence preempted."""
        pool = self.kv_manager.pool
        self.fail(request, f"the {request.params.n} beams of this beam search need more KV cache than the engine has "
                  f"({pool.num_blocks} blocks of {pool.block_size} tokens): give the engine more (num_blocks, "
                  "kv_cache_memory), or ask for fewer beams (n) or tokens (max_tokens)", "n")
        out.failed.append(request)

    def _advance_searches(self, requests, now: float) -> None:
        """Step each beam search of ``requests`` whose live beams all have their candidates; a step that raises fails
        its own request only."""
        for request in requests:
            if request.beams.ready() and not request.is_finished:
                try:
                    self._advance_beams(request, now)
                except Exception as err:  # noqa: BLE001 - any failure here is this request's alone
                    logger.exception("request %s failed in a beam search step", request.request_id)
                    self.fail(request, f"generation failed: {type(err).__name__}: {err}")

    def _advance_beams(self, request: Request, now: float) -> None:
        """One step of ``request``'s beam search, once every live beam has its candidates (see `beam_step`)."""
        state, params = request.beams, request.params
        live = state.live
        limit = min(params.max_tokens or self.max_model_len, self.max_model_len - request.num_prompt_tokens)
        step = beam_step(state, params, [seq.cumulative_logprob for seq in live],
                         [state.pending.pop(seq.seq_id) for seq in live], live[0].num_output_tokens, limit,
                         request.stop_ids)
        state.finished = [beam if isinstance(beam, Hypothesis) else self._hypothesis(live[beam.source], beam, now)
                          for beam in step.finished]
        state.improvable, state.done = step.improvable, step.done
        if step.done:  # the live beams cannot beat the finished ones
            state.live = []
            for seq in live:
                self.finish(seq, "length", now=now)
            return
        state.live = self._rebeam(live, step.running)
        for seq, choice in zip(state.live, step.running):
            seq.token_ids.append(choice.token)
            seq.cumulative_logprob = choice.logprob
            self._new_text(seq, params)
            self._count_token(seq, now)

    def _hypothesis(self, source: Sequence, choice: Choice, now: float) -> Hypothesis:
        """The finished beam ``source`` followed by ``choice.token``."""
        params, seq = source.request.params, source.detached()
        seq.token_ids.append(choice.token)
        seq.cumulative_logprob = choice.logprob
        new_text = self._new_text(seq, params)
        self._count_token(seq, now)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        if choice.token in source.request.stop_ids:
            stop = token_stop(choice.token, seq.text, len(new_text), params, source.request.eos_token_id)
            seq.finish_reason, seq.stop_reason = stop.finish_reason, stop.stop_reason
            if stop.text_end is not None:
                seq.text = seq.text[: stop.text_end]
        return Hypothesis(seq, choice.score)

    def _rebeam(self, live: list[Sequence], choices: list[Choice]) -> list[Sequence]:
        """The sequences that carry ``choices``, before their new tokens: a beam continued once keeps its sequence; a
        further continuation takes over the state and KV blocks of a beam that none continues (or forks one, at the
        prompt); beams left over finish."""
        spare = [seq for i, seq in enumerate(live) if i not in {choice.source for choice in choices}]
        carriers, kept = [], set()
        for choice in choices:
            source = live[choice.source]
            if choice.source not in kept:
                kept.add(choice.source)
                carriers.append(source)
            elif spare:
                seq = spare.pop()
                seq.become(source)
                self.kv_manager.free(seq.seq_id)
                self.kv_manager.fork(source.seq_id, seq.seq_id)
                carriers.append(seq)
            else:
                child = source.fork(len(source.request.seqs))
                self.kv_manager.fork(source.seq_id, child.seq_id)
                self.running.insert(self.running.index(source) + 1, child)  # a search's beams stay together
                carriers.append(child)
        for seq in spare:
            self.finish(seq, "length")
        return carriers

    def _fork(self, parent: Sequence, k: int) -> Sequence:
        """Sample ``k`` of ``parent``'s request, placed after its siblings: it is as old as they are, so requests that
        came later are preempted first."""
        child = parent.fork(k)
        self.kv_manager.fork(parent.seq_id, child.seq_id)
        last = max(i for i, seq in enumerate(self.running) if seq.request is parent.request)
        self.running.insert(last + 1, child)
        return child

    def _settle_guesses(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Give back the KV of a sequence's rejected guesses: it counts as computed only up to its kept tokens, and
        blocks past them are freed (their slots are overwritten later, nothing is copied)."""
        if seq.seq_id in out.spec_token_ids and not seq.is_finished:
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            self.kv_manager.truncate(seq.seq_id, seq.num_computed_tokens)

    def _count_token(self, seq: Sequence, now: float) -> None:
        """Count a token ``seq`` just appended, and its request's first token."""
        metrics = seq.request.metrics
        self.num_generated_tokens += 1
        if metrics.first_token_time is None:
            self.num_prompt_tokens += seq.request.num_prompt_tokens
            metrics.first_token_time = now
        metrics.num_output_tokens = max(metrics.num_output_tokens, seq.num_output_tokens)

    def _new_text(self, seq: Sequence, params: SamplingParams) -> str:
        """The text ``seq``'s newest tokens add (appended to ``seq.text``); none when not detokenized."""
        return self.detokenizer.step(seq, params.skip_special_tokens) if params.detokenize else ""

    def _append(self, seq: Sequence, token: int, row: int, sampled: SamplerOutput, now: float) -> None:
        """Append ``token`` (drawn at ``row`` of ``sampled``) to ``seq``: count it, record its logprobs, decode its
        text, advance the constraint, and finish ``seq`` if it stops here."""
        params = seq.request.params
        seq.token_ids.append(token)
        self._count_token(seq, now)
        self._record_logprobs(seq, token, row, sampled)
        new_text = self._new_text(seq, params)
        stop = check_stop(token, seq.num_output_tokens, seq.num_tokens, seq.text, len(new_text), params,
                          seq.request.stop_ids, self.max_model_len, seq.request.eos_token_id)
        stop = self._advance_constraint(seq, token, new_text, stop)
        if stop is not None:
            if stop.text_end is not None:
                seq.text = seq.text[: stop.text_end]
            self.finish(seq, stop.finish_reason, stop.stop_reason, now)

    def _record_logprobs(self, seq: Sequence, token: int, row: int, sampled: SamplerOutput) -> None:
        params = seq.request.params
        if seq.logprobs is not None:
            top = dict(zip(sampled.top_ids[row][: params.logprobs], sampled.top_logprobs[row][: params.logprobs]))
            top[token] = sampled.sampled_logprobs[row]
            seq.logprobs.append(ranked_logprobs(top, token, sampled.sampled_ranks[row], self._token_text(params)))
        if seq.logprobs is not None or params.use_beam_search:
            seq.cumulative_logprob += sampled.sampled_logprobs[row]

    def _advance_constraint(self, seq: Sequence, token: int, new_text: str, stop: Stop | None) -> Stop | None:
        """Move ``seq``'s grammar (and its reasoning block) past ``token``; returns how ``seq`` stops now, which a
        completed grammar decides where the stop checks did not."""
        opener, seq.reasoning_opener = seq.reasoning_opener, None
        if token == opener:  # the first token opened a reasoning block: the grammar waits for its end
            seq.in_reasoning, seq.matcher = True, None
        ended = seq.matcher is not None and not seq.matcher.advance(token)
        if ended and (stop is None or stop.finish_reason == "length"):
            # The grammar is complete: its end token came (min_tokens cannot hold it back, and it is the reason even
            # as the last token max_tokens allows); its text goes, as EOS's.
            keep = seq.request.params.include_stop_str_in_output
            stop = Stop("stop", None, None if keep else len(seq.text) - len(new_text))
        if seq.in_reasoning and self.reasoning_end.ended(token, seq.text, len(new_text)):
            self._start_grammar(seq)
        return stop

    # ---------------------------------------------------------------------------------------- finish and undo
    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               now: float | None = None) -> None:
        """Finish ``seq`` (stopped, or aborted) and free its blocks."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif (request := self.compiling.pop(seq.request.request_id, None)) is not None:
            if all(other.grammar is not request.grammar for other in self.compiling.values()):
                request.grammar.cancel()  # a compile nobody waits for any more: dropped if it has not started
        self.kv_manager.free(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq.request.is_finished:
            seq.request.metrics.finished_time = now or time.monotonic()

    def abort(self, request: Request) -> None:
        """Finish every sequence of ``request`` that has not, with ``finish_reason="abort"``."""
        for seq in request.seqs:
            self.finish(seq, "abort")
        request.metrics.finished_time = request.metrics.finished_time or time.monotonic()

    def fail(self, request: Request, error: str, param: str | None = None) -> None:
        """Abort ``request`` because it broke; ``error`` is what its caller is told, ``param`` the request's parameter
        at fault, if the failure is its own doing."""
        request.error, request.error_param = error, param
        self.abort(request)

    def fail_all(self, out: SchedulerOutput, error: str) -> list[Request]:
        """Fail every request of the step ``out`` (one whose result was only partly applied); returns them."""
        requests = list({seq.request.request_id: seq.request for seq in out.seqs}.values())
        for request in requests:
            self.fail(request, error)
        return requests

    def rollback(self, out: SchedulerOutput) -> None:
        """Undo the scheduling of a step whose forward or sampling failed, so the next step recomputes it."""
        for seq in out.seqs:  # the blocks this step was to fill must not serve later prefix matches
            self.kv_manager.uncache_blocks(seq.seq_id, seq.num_computed_tokens)
            if seq.matcher is not None:  # its grammar work is done again for the same token
                seq.matcher.spent = 0.0
        for seq, num_computed, _ in out.caught_up:  # blocks of this step among them were never written
            if seq.status is SequenceStatus.RUNNING:  # else preempted later in the step: it holds none
                self.kv_manager.truncate(seq.seq_id, num_computed)
                seq.num_computed_tokens = num_computed
        # A sequence admitted this step may have matched blocks that another one indexed in the same step, which
        # were never written: it goes back to waiting and matches again.
        for seq in reversed(out.admitted):
            if seq.status is SequenceStatus.RUNNING:
                self._requeue(seq)
        for request in out.first_admitted:
            request.num_cached_tokens, request.admitted = 0, False


def _priority(seq: Sequence) -> tuple[int, float]:
    return seq.request.priority, seq.request.arrival_time


def _nothing_allowed(params, position: int) -> tuple[str, str]:
    """The error of a request whose constraints together excluded every token at an output position, and the
    parameter it names (the first of them that the request sets)."""
    given = [name for name, on in (("allowed_token_ids", params.allowed_token_ids is not None),
                                   ("bad_words", bool(params.bad_words)),
                                   ("structured_outputs", params.structured_outputs is not None),
                                   ("min_tokens", position < params.min_tokens and params.structured_outputs is None))
             if on]
    return (f"SamplingParams {', '.join(given)} together exclude every token at output position {position}: "
            "nothing is left to generate", (given or ["allowed_token_ids"])[0])


def _no_text(token_id: int) -> None:
    return None
