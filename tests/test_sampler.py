"""The batched sampler: filters, penalties and seeded draws."""

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from hf_paged.generation.sampler import NO_TOKEN, SamplingBatch, completing_tokens, sample, uniform_from_counter


def batch_for(rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, counters=None, **extra):
    full = lambda v, dtype: torch.full((rows,), v, dtype=dtype)  # noqa: E731
    return SamplingBatch(
        temperature=full(temperature, torch.float32), top_k=full(top_k, torch.long), top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        seeds=torch.tensor(seeds if seeds is not None else list(range(rows))),
        counters=torch.tensor(counters if counters is not None else [0] * rows),
        all_greedy=temperature == 0, sort_rows=torch.arange(rows) if top_k > 0 or top_p < 1 else None,
        needs_min_p=min_p > 0, **extra,
    )


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    assert sample(logits, batch_for(32, top_k=1)).token_ids == logits.argmax(-1).tolist()
    assert sample(logits, batch_for(32, top_p=1e-6)).token_ids == logits.argmax(-1).tolist()


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    tokens = torch.tensor(sample(logits, batch_for(20000, seeds=list(range(20000)))).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 20000
    assert torch.allclose(freq, probs, atol=0.015)


def test_top_p_and_min_p_remove_the_tail():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    top_p = set(sample(logits, batch_for(4000, top_p=0.7, seeds=list(range(4000)))).token_ids)
    assert top_p == {0, 1}
    min_p = set(sample(logits, batch_for(4000, min_p=0.2, seeds=list(range(4000)))).token_ids)
    assert min_p == {0, 1, 2}


def test_uniform_is_a_function_of_seed_and_counter():
    seeds, counters = torch.tensor([1, 2, 1, 1]), torch.tensor([0, 0, 0, 1])
    u = uniform_from_counter(seeds, counters)
    assert u[0] == u[2] and u[0] != u[1] and u[0] != u[3]
    many = uniform_from_counter(torch.full((50000,), 42), torch.arange(50000))
    assert 0 < many.min() and many.max() < 1 and abs(many.mean().item() - 0.5) < 0.01


def test_repetition_penalty_matches_transformers():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor([[3, 4, -1], [7, 8, 9]])
    output = torch.tensor([[5, -1], [9, 10]])
    batch = batch_for(2, temperature=0, repetition_penalty=torch.tensor([1.3, 1.3]),
                      presence_penalty=torch.zeros(2), frequency_penalty=torch.zeros(2), prompt_tokens=prompt,
                      output_tokens=output)
    from hf_paged.generation.sampler import apply_penalties

    seen = torch.tensor([[3, 4, 5, 5], [7, 8, 9, 10]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    torch.testing.assert_close(apply_penalties(logits, batch), expected)


def test_frequency_and_presence_penalties():
    logits = torch.zeros(1, 10)
    batch = batch_for(1, temperature=0, repetition_penalty=torch.ones(1), presence_penalty=torch.tensor([0.5]),
                      frequency_penalty=torch.tensor([0.25]), prompt_tokens=torch.tensor([[1]]),
                      output_tokens=torch.tensor([[2, 2, 3]]))
    from hf_paged.generation.sampler import apply_penalties

    out = apply_penalties(logits, batch)
    assert out[0, 2].item() == -1.0 and out[0, 3].item() == -0.75 and out[0, 1].item() == 0.0


def test_banned_tokens_are_never_drawn():
    logits = torch.tensor([[10.0, 0.0, 0.0]]).expand(100, 3)
    banned = (torch.arange(100), torch.zeros(100, dtype=torch.long))
    assert 0 not in sample(logits, batch_for(100, banned=banned)).token_ids


def test_a_bad_word_bans_its_last_token_once_its_other_tokens_end_the_output():
    words = [[7], [1, 2], [3, 1, 2, 9]]
    assert completing_tokens([], words) == [7]
    assert completing_tokens([5, 1], words) == [7, 2]
    assert completing_tokens([1, 2], words) == [7]
    assert completing_tokens([3, 1, 2], words) == [7, 9]
    assert completing_tokens([1, 2, 1], words) == [7, 2]


def test_allowed_tokens_are_the_only_ones_drawn_in_their_rows():
    logits = torch.tensor([[10.0, 0.0, 1.0, 2.0]]).expand(200, 4)
    rows = torch.arange(100).repeat_interleave(2)  # the first 100 rows allow tokens 1 and 2
    allowed = (rows, torch.tensor([1, 2]).repeat(100))
    drawn = sample(logits, batch_for(200, allowed=allowed)).token_ids
    assert set(drawn[:100]) == {1, 2} and 0 in drawn[100:]
    assert sample(logits[:2], batch_for(2, temperature=0, allowed=(rows[:2], allowed[1][:2]))).token_ids == [2, 0]


def test_a_row_whose_masks_leave_no_token_gets_none():
    logits = torch.tensor([[1.0, 2.0, 3.0]]).expand(4, 3)
    allowed = (torch.tensor([0, 1, 2, 3]), torch.tensor([1, 1, 2, 2]))
    banned = (torch.tensor([0, 2]), torch.tensor([1, 1]))  # row 0 allows only the token it bans
    for temperature in (0.0, 1.0):
        batch = batch_for(4, temperature=temperature, allowed=allowed, banned=banned, max_logprobs=0)
        assert sample(logits, batch).token_ids == [NO_TOKEN, 1, 2, 2]
    everything = (torch.zeros(3, dtype=torch.long), torch.arange(3))  # a row whose bans alone cover the vocabulary
    assert sample(logits[:2], batch_for(2, temperature=0, banned=everything)).token_ids == [NO_TOKEN, 2]


def test_extreme_values_draw_real_tokens():
    """A repetition penalty near 0 makes a seen token's logit overflow float32, a small temperature makes them all
    overflow; neither may turn the row into NaN (which would always draw the last token id)."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]]).expand(50, 4)
    penalties = dict(repetition_penalty=torch.full((50,), 1e-39), presence_penalty=torch.zeros(50),
                     frequency_penalty=torch.zeros(50), prompt_tokens=torch.zeros(50, 1, dtype=torch.long),
                     output_tokens=torch.full((50, 1), -1))
    assert set(sample(logits, batch_for(50, **penalties)).token_ids) == {0}
    assert set(sample(logits, batch_for(50, temperature=1e-39)).token_ids) <= {0, 1, 3}


def test_sorted_draws_are_chosen_per_row():
    """Rows without top-k/top-p draw the same token whether or not another row of the batch sorts."""
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(2))
    alone = sample(logits, batch_for(8)).token_ids
    mixed = batch_for(8)
    mixed.top_k = torch.tensor([0] * 7 + [5])
    mixed.sort_rows = torch.tensor([7])
    assert sample(logits, mixed).token_ids[:7] == alone[:7]


def test_logit_bias_adds_to_its_rows_only():
    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    bias = (torch.tensor([0, 0]), torch.tensor([0, 2]), torch.tensor([-100.0, 100.0]))
    assert sample(logits, batch_for(2, temperature=0, logit_bias=bias)).token_ids == [2, 0]
    draws = sample(logits[:1].expand(200, 3), batch_for(200, logit_bias=(torch.zeros(1, dtype=torch.long),
                                                                      torch.tensor([0]), torch.tensor([-100.0]))))
    assert draws.token_ids[0] != 0 and 0 in draws.token_ids[1:]


def test_every_bit_of_the_seed_counts():
    seeds = torch.tensor([5, 5 + 2**62, 5 - 2**63, -1, 2**63 - 1, 2**62 - 1])
    u = uniform_from_counter(seeds, torch.zeros(6, dtype=torch.long))
    assert len(set(u.tolist())) == 6


def test_top_p_drops_a_token_once_those_before_it_reach_top_p():
    logits = torch.tensor([0.5, 0.5]).log().expand(400, 2)
    assert set(sample(logits, batch_for(400, top_p=0.5, seeds=list(range(400)))).token_ids) == {0}  # as vLLM


def test_min_p_filters_before_top_p_and_bias_comes_before_penalties():
    """vLLM's order: [.3, .3, .3, .1] with min_p .5 keeps three tokens, then top_p .65 two of them (the other order
    would keep all three). A +3 bias on a seen token with logit -2 and repetition penalty 2 scores (-2 + 3) / 2."""
    logits = torch.tensor([0.3, 0.3, 0.3, 0.1]).log().expand(2000, 4)
    drawn = set(sample(logits, batch_for(2000, top_p=0.65, min_p=0.5, seeds=list(range(2000)))).token_ids)
    assert len(drawn) == 2 and drawn < {0, 1, 2}  # which two of the tied three: the partial sort's order
    logits = torch.tensor([[0.0, 0.0, 0.0, -2.0, 0.0, 0.1]])
    batch = batch_for(1, temperature=0.0, repetition_penalty=torch.tensor([2.0]), presence_penalty=torch.tensor([0.0]),
                      frequency_penalty=torch.tensor([0.0]), prompt_tokens=torch.tensor([[3]]),
                      output_tokens=torch.tensor([[-1]]),
                      logit_bias=(torch.tensor([0]), torch.tensor([3]), torch.tensor([3.0])))
    assert sample(logits, batch).token_ids == [3]


def test_top_k_and_top_p_find_their_tokens_among_the_candidates_or_by_sorting_whole():
    """A row whose kept tokens lie among its `CANDIDATES` likeliest takes them from a partial sort (a whole sort of a
    49k vocabulary cost 111 ms a step at 64 rows, the partial one 20); a flat row, or a top-k past the candidates,
    sorts whole. Either way the distribution is the sorted definition's, and each row's draw is its own."""
    from hf_paged.generation.sampler import CANDIDATES, target_probs

    vocab = CANDIDATES * 4
    gen = torch.Generator().manual_seed(0)
    peaked, flat = torch.randn(vocab, generator=gen) * 8, torch.randn(vocab, generator=gen) * 0.1
    rows = [(peaked, 0, 0.9), (flat, 0, 0.9), (peaked, 10, 1.0), (flat, CANDIDATES + 100, 1.0), (flat, 20, 0.5),
            (peaked, CANDIDATES * 2, 0.95)]
    logits = torch.stack([row[0] for row in rows])
    top_k, top_p = torch.tensor([row[1] for row in rows]), torch.tensor([row[2] for row in rows])
    batch = batch_for(len(rows), top_k=1, top_p=0.5)
    batch.top_k, batch.top_p = top_k, top_p

    expected = []
    for scores, k, p in rows:  # the definition: sort, keep the top k, drop a token once those before it reach top_p
        values, ids = scores.sort(descending=True)
        kept = values[: k or vocab].softmax(-1)
        kept = kept.masked_fill((kept.cumsum(-1) - kept >= p) & (p < 1), 0)
        expected.append(torch.zeros(vocab).index_put((ids[: k or vocab],), kept / kept.sum()))
    assert torch.allclose(target_probs(logits, batch), torch.stack(expected), atol=1e-6)
    assert (target_probs(logits, batch)[1] > 0).sum() > CANDIDATES  # the flat row needed the whole sort
    alone = [sample(logits[i : i + 1], _row(batch, i)).token_ids[0] for i in range(len(rows))]
    assert sample(logits, batch).token_ids == alone


def _row(batch: SamplingBatch, i: int) -> SamplingBatch:
    one = batch_for(1, top_k=1, top_p=0.5, seeds=[int(batch.seeds[i])])
    one.top_k, one.top_p = batch.top_k[i : i + 1], batch.top_p[i : i + 1]
    return one


def test_greedy_rows_take_the_argmax_beside_sampled_ones_and_min_p_1_keeps_it():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    logits[:, 0] = -10  # the argmax is never token 0
    batch = batch_for(64, seeds=list(range(64)))
    batch.temperature = torch.tensor([0.0, 1.0] * 32)
    tokens = sample(logits, batch).token_ids
    assert tokens[::2] == logits[::2].argmax(-1).tolist() and tokens[1::2] != logits[1::2].argmax(-1).tolist()
    assert sample(logits, batch_for(64, min_p=1.0)).token_ids == logits.argmax(-1).tolist()

