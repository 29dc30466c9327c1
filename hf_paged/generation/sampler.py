"""Batched sampling: penalties, temperature, top-k/top-p/min-p and seeded draws for all rows at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling_params import FLOAT32_MAX
from .sequence import Sequence
from .structured_outputs import allow_token, apply_bitmask, fill_bitmask

CANDIDATES = 512  # the likeliest tokens a top-k / top-p row looks for its kept ones among before sorting whole
NO_TOKEN = -1  # the token of a row whose masks and bans left it none to take (its request fails)

_MASK31 = (1 << 31) - 1


_STREAM_KEYS = (0x2545F491, 0x5BD1E995)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 31-bit integer hash (xor-shift-multiply rounds); products stay below 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK31
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK31
    return x ^ (x >> 16)


def uniform_from_counter(seeds: torch.Tensor, counters: torch.Tensor, stream: int = 0) -> torch.Tensor:
    """One uniform number in (0, 1) per row, a pure function of (seed, counter).

    A counter-based draw makes each request's samples depend only on its own seed and position, never on which
    other requests share the batch, and needs no per-request generator object or Python loop. Another ``stream``
    gives other numbers for the same (seed, counter) (speculative decoding's accept tests).
    """
    h = _mix((seeds & _MASK31) ^ _mix(((seeds >> 31) & _MASK31) ^ _mix((seeds >> 62) & 3)))  # all 64 bits
    h = _mix(h ^ (counters & _MASK31))
    # Stream 0's numbers are those of earlier versions; another stream's key differs in many bits and is mixed once
    # more, so that a position's accept test and token pick are independent.
    h = _mix(h ^ _STREAM_KEYS[0]) if stream == 0 else _mix(_mix(h ^ _STREAM_KEYS[stream]))
    return (h.double() + 0.5) / float(1 << 31)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits`` (the first of equal maxima): ``max`` returns the same index as ``argmax``
    and ran 3x faster over a 49152-token vocabulary on CPU."""
    return logits.max(dim=-1).indices


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one step, as tensors on the logits' device.

    When every row is greedy only ``all_greedy`` (and any penalties, bans or logprobs) is needed; the draw tensors stay
    None.
    """

    all_greedy: bool
    sort_rows: torch.Tensor | None = None  # [S] long: rows with top-k or top-p, which draw in sorted order
    needs_min_p: bool = False
    temperature: torch.Tensor | None = None  # [R] float, 0 = greedy
    top_k: torch.Tensor | None = None  # [R] long, 0 = off
    top_p: torch.Tensor | None = None  # [R] float
    min_p: torch.Tensor | None = None  # [R] float
    seeds: torch.Tensor | None = None  # [R] long: the request's seed, plus i for its sample i
    counters: torch.Tensor | None = None  # [R] long: the output position each row decides
    # Penalties (None when no row uses any).
    repetition_penalty: torch.Tensor | None = None  # [R]
    presence_penalty: torch.Tensor | None = None  # [R]
    frequency_penalty: torch.Tensor | None = None  # [R]
    prompt_tokens: torch.Tensor | None = None  # [R, P] padded with -1
    output_tokens: torch.Tensor | None = None  # [R, O] padded with -1
    # Tokens forbidden for a row this step (stop tokens before min_tokens, bad words): (row indices, token ids).
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids of the rows that have them: (row indices, token ids); every other token of theirs is masked.
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    # logit_bias entries of all rows: (row indices, token ids, biases).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: a bitmask of the tokens each constrained row allows next (CPU), and those rows.
    token_bitmask: tuple[torch.Tensor, list[int]] | None = None
    max_logprobs: int = 0


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # When logprobs were asked for: the sampled token's logprob and rank, and the top-k (ids, logprobs) per row.
    sampled_logprobs: list[float] | None = None
    sampled_ranks: list[int] | None = None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    # Speculative decoding: the guesses each row kept, appended before its token (see spec_decode.verify_drafts).
    accepted: list[list[int]] | None = None
    # Per `SchedulerOutput.prompt_logprob_spans` span: the next prompt token's {id: logprob} at each of its positions,
    # and that token's rank there (1: the likeliest).
    prompt_logprobs: list[list[dict[int, float]]] | None = None
    prompt_ranks: list[list[int]] | None = None
    # Per row, a beam search's candidates (`beam_search.beam_candidates`); None for other rows.
    beams: list | None = None

    def new_tokens(self, row: int) -> list[int]:
        """A draw's new tokens: the speculative guesses it kept, then its sampled token."""
        return (self.accepted[row] if self.accepted else []) + [self.token_ids[row]]


def build_sampling_batch(draws: list[tuple[Sequence, int]], device: torch.device,
                         offsets: list[int] | None = None) -> SamplingBatch:
    """The sampling tensors of one step: one row per draw ``(sequence, k)``, the ``k``-th sample drawn from that
    sequence's logits (a request with ``n > 1`` draws its ``n`` first tokens from its prompt's logits).
    ``offsets[row]``: the row decides the output token that many positions after the sequence's next one
    (speculative decoding verifies several positions of a sequence in one step)."""
    params = [seq.request.params for seq, _ in draws]
    sampling = [p for p in params if not p.greedy]
    batch = SamplingBatch(all_greedy=not sampling)
    if sampling:
        _add_draw_tensors(batch, draws, device, offsets or [0] * len(draws))
    if any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params):
        _add_penalty_tensors(batch, draws, device)
    rows = [row for row, (seq, _) in enumerate(draws) if seq.matcher is not None]
    if rows:  # every draw of a sequence (n > 1 at its prompt) has its state: one bitmask row per draw
        batch.token_bitmask = (fill_bitmask([draws[row][0].matcher for row in rows], rows, len(draws)), rows)
        for row in rows:  # a first token that may open a reasoning block, the grammar's after it
            if (opener := draws[row][0].reasoning_opener) is not None:
                allow_token(batch.token_bitmask[0], row, opener)
    banned = [(row, ids) for row, (seq, _) in enumerate(draws) if (ids := _banned_ids(seq)) is not None]
    if banned:
        rows, ids = zip(*banned)
        batch.banned = (_rows_of(rows, ids, device), torch.cat(ids).to(device))
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if rows:
        ids = [draws[row][0].request.allowed_ids_tensor for row in rows]
        batch.allowed = (_rows_of(rows, ids, device), torch.cat(ids).to(device))
    rows = [row for row, p in enumerate(params) if p.logit_bias]
    if rows:
        tokens, values = zip(*(draws[row][0].request.logit_bias_tensors for row in rows))
        batch.logit_bias = (_rows_of(rows, tokens, device), torch.cat(tokens).to(device), torch.cat(values).to(device))
    # A search of one beam decodes greedily and reports its cumulative logprob, as a wider one does.
    wanted = [p.logprobs or 0 for p in params if p.logprobs is not None or p.use_beam_search and p.n == 1]
    if wanted:
        batch.max_logprobs = max(1, *wanted)
    return batch


def _banned_ids(seq: Sequence) -> torch.Tensor | None:
    """The tokens ``seq`` may not take next: its stop tokens until min_tokens are out (not under a grammar, which
    says when it may end: banning its end token could leave nothing allowed), and the last token of each bad word
    whose other tokens end the output."""
    request = seq.request
    ids = []
    if seq.num_output_tokens < request.params.min_tokens and seq.matcher is None:
        ids.append(request.stop_ids_tensor)
    if request.bad_words_token_ids:
        reach = min(max(map(len, request.bad_words_token_ids)) - 1, seq.num_output_tokens)  # the output's end only
        tail = seq.token_ids[len(seq.token_ids) - reach :] if reach else []
        ids.append(torch.tensor(completing_tokens(tail, request.bad_words_token_ids), dtype=torch.long))
    return torch.cat(ids) if ids else None


def completing_tokens(output_token_ids: list[int], words: list[list[int]]) -> list[int]:
    """The last token of each of ``words`` (token sequences) whose other tokens end ``output_token_ids``."""
    return [word[-1] for word in words
            if len(word) <= len(output_token_ids) + 1 and output_token_ids[len(output_token_ids) - len(word) + 1:]
            == word[:-1]]


def _rows_of(rows: list[int], per_row: list[torch.Tensor], device) -> torch.Tensor:
    """Each row index repeated once per entry of its tensor."""
    counts = torch.tensor([t.numel() for t in per_row])
    return torch.tensor(rows, dtype=torch.long).repeat_interleave(counts).to(device)


def _add_draw_tensors(batch: SamplingBatch, draws: list[tuple[Sequence, int]], device, offsets: list[int]) -> None:
    params = [seq.request.params for seq, _ in draws]

    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    # Chosen per row, never per batch: the same uniform number picks another token in sorted order.
    sort_rows = [row for row, p in enumerate(params) if not p.greedy and (p.top_k > 0 or p.top_p < 1)]
    batch.sort_rows = column(sort_rows, torch.long) if sort_rows else None
    batch.needs_min_p = any(p.min_p > 0 for p in params if not p.greedy)
    batch.temperature = column([0.0 if p.greedy else p.temperature for p in params], torch.float32)
    batch.top_k = column([p.top_k for p in params], torch.long)
    batch.top_p = column([p.top_p for p in params], torch.float32)
    batch.min_p = column([p.min_p for p in params], torch.float32)
    # Sample i of n draws as a request of seed + i would (vLLM's rule), at its output position.
    batch.seeds = column([_wrap64(seq.request.seed + seq.index + k) for seq, k in draws], torch.long)
    batch.counters = column([seq.num_output_tokens + j for (seq, _), j in zip(draws, offsets)], torch.long)


def _wrap64(value: int) -> int:
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def _add_penalty_tensors(batch: SamplingBatch, draws: list[tuple[Sequence, int]], device) -> None:
    params = [seq.request.params for seq, _ in draws]
    batch.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=device)
    batch.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=device)
    batch.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=device)
    pad = torch.nn.utils.rnn.pad_sequence
    batch.prompt_tokens = pad([seq.request.prompt_tensor for seq, _ in draws], batch_first=True,
                              padding_value=-1).to(device)
    outputs = [torch.tensor(seq.output_token_ids, dtype=torch.long) for seq, _ in draws]
    batch.output_tokens = pad(outputs, batch_first=True, padding_value=-1).to(device)


def _token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.float32, device=tokens.device)
    index = torch.where(tokens < 0, vocab_size, tokens)
    counts.scatter_add_(1, index, torch.ones_like(index, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    vocab = logits.shape[1]
    output_counts = _token_counts(batch.output_tokens, vocab)
    seen = (output_counts > 0) | (_token_counts(batch.prompt_tokens, vocab) > 0)
    rep = batch.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep).clamp_(max=FLOAT32_MAX)  # rep near 0
    logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * output_counts
    return logits - batch.presence_penalty.unsqueeze(1) * (output_counts > 0).float()


def _adjusted(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after the grammar's bitmask, biases, bans and penalties (vLLM's order): what greedy rows take the
    argmax of."""
    if batch.token_bitmask is not None:  # first: penalties, temperature and top-k/p only see allowed tokens
        logits = logits.clone() if batch.max_logprobs else logits  # logprobs are the model's own distribution
        apply_bitmask(logits, *batch.token_bitmask)
    if batch.allowed is not None:
        rows, ids = batch.allowed
        kept = logits[rows, ids]
        logits = logits.index_fill(0, rows.unique(), float("-inf")).index_put((rows, ids), kept)
    if batch.logit_bias is not None:
        rows, ids, bias = batch.logit_bias
        logits = logits.index_put((rows, ids), bias, accumulate=True)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.repetition_penalty is not None:
        logits = apply_penalties(logits, batch)
    return logits


def _draw_probs(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The distribution each sampled row draws from: temperature, then min-p, then top-k/top-p (vLLM's order). Rows
    in ``batch.sort_rows`` come in descending order, ``order`` (also returned) mapping them back to token ids."""
    temperature = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    scaled = (logits / temperature.unsqueeze(1)).clamp_(max=FLOAT32_MAX)  # a small temperature overflows
    probs = scaled.softmax(dim=-1)
    if batch.needs_min_p:
        below = probs < batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        scaled, probs = scaled.masked_fill(below, float("-inf")), probs.masked_fill(below, 0.0)
    rows, order = batch.sort_rows, None
    if rows is not None:  # these rows' probabilities are replaced by their top-k / top-p ones, in sorted order
        top, order = _sorted_top(scaled[rows], batch.top_k[rows], batch.top_p[rows].unsqueeze(1))
        probs = probs.index_copy(0, rows, top)
    return probs, order


def _top_k_top_p(probs: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Descending probabilities ``probs``, past each row's top ``k`` and once those before a token reach ``top_p``
    (as vLLM) zero."""
    positions = torch.arange(probs.shape[1], device=probs.device)
    probs = probs.masked_fill(positions >= k.unsqueeze(1), 0.0)
    before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill((before >= top_p) & (top_p < 1), 0.0)


def _sorted_top(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' top-k / top-p probabilities in descending order with the token ids of that order, both ``[R, vocab]``.
    A row's kept tokens are looked for among its `CANDIDATES` likeliest (a partial sort, ~20x cheaper than sorting a
    49k vocabulary): a row keeping more is sorted whole. Past a row's candidates its probabilities are 0 (ids 0)."""
    vocab = scaled.shape[1]
    k = torch.where(k > 0, k, torch.full_like(k, vocab))
    width = min(CANDIDATES, vocab)
    values, ids = scaled.topk(width, dim=-1)
    whole = k == vocab  # normalised over the whole row, else over its top k (held by the candidates if k <= width)
    normalizer = torch.where(whole, scaled.logsumexp(dim=-1), values.masked_fill(
        torch.arange(width, device=k.device) >= k.unsqueeze(1), float("-inf")).logsumexp(dim=-1)).unsqueeze(1)
    mass = (values - normalizer).exp()
    probs = _top_k_top_p(mass, k, top_p)
    p = top_p.squeeze(1)
    held = (k <= width) | (whole & (p < 1) & (mass.sum(dim=-1) >= p))  # the first token past them would be dropped
    top = torch.zeros_like(scaled)
    order = torch.zeros(scaled.shape, dtype=torch.long, device=scaled.device)
    top[:, :width], order[:, :width] = probs, ids
    rest = (~held).nonzero().squeeze(1)
    if rest.numel():
        values, ids = scaled[rest].sort(dim=-1, descending=True)
        masked = values.masked_fill(torch.arange(vocab, device=k.device) >= k[rest].unsqueeze(1), float("-inf"))
        top[rest] = _top_k_top_p((values - masked.logsumexp(dim=-1, keepdim=True)).exp(), k[rest], top_p[rest])
        order[rest] = ids
    return top, order


def _blocked_rows(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
    """Rows whose every token is masked (allowed_token_ids, bans and a grammar can exclude one another's tokens),
    or None when there are none; only rows with a mask or a ban are looked at."""
    rows = [*(() if batch.allowed is None else batch.allowed[0].unique().tolist()),
            *(() if batch.banned is None else batch.banned[0].unique().tolist()),
            *(() if batch.token_bitmask is None else batch.token_bitmask[1])]
    if not rows:
        return None
    rows = torch.tensor(sorted(set(rows)), device=logits.device)
    blocked = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    blocked[rows] = torch.isneginf(logits[rows]).all(dim=-1)
    return blocked if bool(blocked.any()) else None


def target_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``[R, vocab]``: the distribution each sampled row draws from, in token order and summing to 1 (for a batch
    that samples; top-p and min-p leave `_draw_probs` unnormalised, which `sample` does not need)."""
    probs, order = _draw_probs(_adjusted(logits.float(), batch), batch)
    if order is not None:
        rows = batch.sort_rows
        placed = torch.zeros_like(order, dtype=probs.dtype).scatter_add(1, order, probs[rows])  # padding adds 0s
        probs = probs.index_copy(0, rows, placed)
    return probs / probs.sum(dim=-1, keepdim=True)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Pick one token per row of ``logits [R, vocab]``."""
    raw = logits = logits.float()
    logits = _adjusted(logits, batch)
    blocked = _blocked_rows(logits, batch)
    greedy = greedy_tokens(logits)
    if batch.all_greedy:
        tokens = greedy
    else:
        probs, order = _draw_probs(logits, batch)
        cdf = probs.double().cumsum(dim=-1)
        threshold = uniform_from_counter(batch.seeds, batch.counters) * cdf[:, -1]
        picked = torch.searchsorted(cdf, threshold.unsqueeze(1)).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        rows = batch.sort_rows
        if rows is not None:
            picked[rows] = order.gather(1, picked[rows].unsqueeze(1)).squeeze(1)
        tokens = torch.where(batch.temperature > 0, picked, greedy)
    token_list = tokens.tolist() if blocked is None else tokens.masked_fill(blocked, NO_TOKEN).tolist()
    if not batch.max_logprobs:
        return SamplerOutput(token_list)
    logprobs = raw.log_softmax(dim=-1)
    sampled = logprobs.gather(1, tokens.unsqueeze(1))
    ranks = (logprobs > sampled).sum(dim=-1) + 1
    top = logprobs.topk(batch.max_logprobs, dim=-1)
    return SamplerOutput(token_list, sampled.squeeze(1).tolist(), ranks.tolist(), top.indices.tolist(),
                         top.values.tolist())


def prompt_logprobs(logits: torch.Tensor,
                    spans: list[tuple[Sequence, int, int]]) -> tuple[list[list[dict[int, float]]], list[list[int]]]:
    """Per span ``(sequence, first position, count)`` of ``logits`` rows (in span order): at each position, the
    logprob of the prompt token after it and of the ``prompt_logprobs`` most likely tokens, from the model's own
    distribution; and the prompt token's rank (1 + the tokens more likely than it)."""
    logprobs = logits.float().log_softmax(dim=-1)
    scores, ranks, row = [], [], 0
    for seq, first, count in spans:
        rows = logprobs[row : row + count]
        targets = torch.tensor(seq.token_ids[first + 1 : first + 1 + count], device=rows.device)
        chosen = rows.gather(1, targets.unsqueeze(1))
        ranks.append(((rows > chosen).sum(dim=1) + 1).tolist())
        chosen = chosen.squeeze(1).tolist()
        k = seq.request.params.prompt_logprobs
        top = rows.topk(k, dim=-1) if k else None
        span = []
        for i, token in enumerate(targets.tolist()):
            entry = dict(zip(top.indices[i].tolist(), top.values[i].tolist())) if top is not None else {}
            entry[token] = chosen[i]
            span.append(entry)
        scores.append(span)
        row += count
    return scores, ranks
