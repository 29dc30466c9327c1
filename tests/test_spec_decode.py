"""Speculative decoding (prompt lookup): the proposer, acceptance, the scheduler's KV bookkeeping without a model, and
the engine on the real SmolLM2, where greedy outputs must be token-identical to decoding without speculation."""

import argparse
import json

import pytest
import torch
from prometheus_client import generate_latest

from hf_paged import ContinuousBatchGenerator, RequestOutputKind, SamplingParams, StructuredOutputsParams
from hf_paged.generation import EngineConfig
from hf_paged.generation.config import SpeculativeConfig
from hf_paged.generation.sampler import SamplerOutput, SamplingBatch, sample
from hf_paged.generation.spec_decode import (Speculator, _rejection_draws, accepted_greedy, accepted_sampled,
                                             next_window, propose_ngram)
from hf_paged.server.metrics import ServerMetrics
from test_scheduler import make_request, make_scheduler

TEXT = ("The lighthouse on the northern cape was built in the spring of a wet year, when the fishing boats had lost "
        "three crews to the rocks below the cliff. The builders carried every stone up the narrow path by hand, and "
        "the keeper who came after them kept a careful journal of the weather and the passing ships.")
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n")


# ------------------------------------------------------------------------------------------------- pure parts
def test_prompt_lookup_takes_the_longest_suffix_match_and_its_latest_occurrence():
    tokens = [1, 2, 3, 9, 9, 4, 2, 3, 7, 8, 5, 1, 2, 3]
    # The 3-gram [1, 2, 3] occurred at 0 (followed by 9, 9, 4); the 2-gram [2, 3] last at 6 (followed by 7, 8).
    assert propose_ngram(tokens, k=3, min_n=2, max_n=3) == [9, 9, 4]
    assert propose_ngram(tokens, k=3, min_n=2, max_n=2) == [7, 8, 5]
    assert propose_ngram(tokens, k=1, min_n=2, max_n=2) == [7]
    assert propose_ngram([5, 6, 7, 8], k=3, min_n=1, max_n=3) == []  # nothing repeats
    assert propose_ngram([4, 4], k=3, min_n=1, max_n=3) == [4]  # what follows the match may be short
    assert propose_ngram([1, 2, 1], k=2, min_n=2, max_n=4) == []  # shorter than prompt_lookup_min


def test_greedy_keeps_guesses_while_they_equal_the_model_and_adds_its_token():
    assert accepted_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert accepted_greedy([5, 6, 7], [5, 9, 1, 2]) == [5, 9]
    assert accepted_greedy([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accepted_greedy([], [3]) == [3]
    assert accepted_sampled([5, 6], [True, False], [0, 11, 12]) == [5, 11]
    assert accepted_sampled([5, 6], [True, True], [0, 11, 12]) == [5, 6, 12]


def test_the_heuristic_schedule_grows_by_two_on_full_acceptance_and_shrinks_by_one():
    assert next_window(1, guessed=1, kept=1, most=8) == 3
    assert next_window(7, guessed=7, kept=7, most=8) == 8  # never above num_speculative_tokens
    assert next_window(5, guessed=3, kept=3, most=8) == 7  # a short proposal kept whole counts as all kept
    assert next_window(5, guessed=5, kept=4, most=8) == 4
    assert next_window(1, guessed=1, kept=0, most=8) == 1  # never below one


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_rejection_sampling_keeps_the_model_distribution(top_p):
    """With a one-hot proposal, keep guess d with probability p(d), else draw from p without d: the first token is
    distributed as p whatever the guess, and the second (after a kept guess) as the next position's p. With top-p, p
    is the truncated distribution, which the sampler keeps in sorted order and unnormalised."""
    vocab, draws = 5, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, -0.5]])
    p = logits.softmax(dim=-1).double()
    top, order = p.sort(dim=-1, descending=True)
    top[(top.cumsum(dim=-1) - top) > top_p] = 0
    p = torch.zeros_like(p).scatter(1, order, top / top.sum(dim=-1, keepdim=True))
    rows = logits.repeat(draws, 1)  # draw i: rows 2i (its guess, token 1) and 2i + 1 (after the guess)
    n = rows.shape[0]
    batch = SamplingBatch(all_greedy=False, temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long),
                          top_p=torch.full((n,), top_p), min_p=torch.zeros(n),
                          sort_rows=torch.arange(n) if top_p < 1 else None,
                          seeds=torch.arange(n, dtype=torch.long) // 2, counters=torch.arange(n) % 2)
    accept, picks = _rejection_draws(rows, batch, [(2 * i, [1]) for i in range(draws)])
    plain = sample(rows, batch).token_ids  # what the row after the last guess takes
    first = torch.tensor([1 if accept[2 * i] else picks[2 * i] for i in range(draws)])
    second = torch.tensor([plain[2 * i + 1] for i in range(draws) if accept[2 * i]])
    freq1 = torch.bincount(first, minlength=vocab).double() / draws
    freq2 = torch.bincount(second, minlength=vocab).double() / len(second)
    assert abs(len(second) / draws - p[0, 1]) < 0.015  # the guess is kept with probability p(guess)
    torch.testing.assert_close(freq1, p[0], atol=0.015, rtol=0)
    torch.testing.assert_close(freq2, p[1], atol=0.02, rtol=0)


def test_config_is_validated_and_parsed():
    config = EngineConfig(speculative_config='{"num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)
    assert EngineConfig(speculative_config={"method": "ngram"}).speculative_config == SpeculativeConfig()
    defaults, alone = SpeculativeConfig(), SpeculativeConfig(prompt_lookup_max=1)  # one bound alone is both, as in vLLM
    assert (defaults.prompt_lookup_min, defaults.prompt_lookup_max, alone.prompt_lookup_min) == (2, 4, 1)
    assert SpeculativeConfig(prompt_lookup_min=6).prompt_lookup_max == 6
    assert EngineConfig().speculative_config is None
    for bad, field in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
                       ({"num_tokens": 2}, "unknown fields"), ("{not json", "not valid JSON"),
                       ({"disable_by_batch_size": True}, "disable_by_batch_size"),
                       ({"num_speculative_tokens_schedule": "dynamic"}, "num_speculative_tokens_schedule")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(speculative_config=bad)
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps({"num_speculative_tokens": 2})])
    assert EngineConfig.from_cli_args(args).speculative_config.num_speculative_tokens == 2
    assert "--speculative-config" in parser.format_help()


# ------------------------------------------------------------------------------------ scheduler, no model
def test_rejected_guesses_give_back_their_kv_and_are_never_indexed():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=20)
    scheduler.add(request)
    seq = request.seqs[0]
    out = scheduler.schedule()
    scheduler.update(out, SamplerOutput([8]))  # prompt computed, token 8 pending: 8 tokens, 7 computed
    out = scheduler.schedule({seq.seq_id: [9, 10, 11, 12, 13]})  # block 1, three slots of block 2, one of block 3
    assert out.num_tokens == [6] and out.spec_token_ids == {seq.seq_id: [9, 10, 11, 12, 13]}
    assert len(scheduler.kv_manager.block_table(seq.seq_id)) == 4 and out.draws == [(seq, 0)] and out.draw_rows == [0]
    assert len(scheduler.kv_manager._hashes[seq.seq_id]) == 2  # only blocks of real tokens are indexed, not guesses
    # The model kept guess 9 and chose 20 where 10 was guessed.
    scheduler.update(out, SamplerOutput([20], accepted=[[9]]))
    assert seq.token_ids[7:] == [8, 9, 20] and seq.num_computed_tokens == 9
    assert len(scheduler.kv_manager.block_table(seq.seq_id)) == 3  # the block that held only guesses is freed
    out = scheduler.schedule()
    assert out.num_tokens == [1] and not out.spec_token_ids
    scheduler.update(out, SamplerOutput([21]))
    assert seq.num_computed_tokens == 10 and len(scheduler.kv_manager._hashes[seq.seq_id]) == 2


def test_guesses_are_dropped_before_anyone_is_preempted():
    scheduler = make_scheduler(num_blocks=5, block_size=4)
    a, b = make_request("a", [1, 2, 3, 4, 5, 6, 7], max_tokens=20), make_request("b", [11] * 8, max_tokens=20)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    scheduler.update(out, SamplerOutput([8] * len(out.draws)))  # a: 8 tokens in 2 blocks, b: 9 tokens in 2 of 3
    out = scheduler.schedule({a.seqs[0].seq_id: [9, 10]})  # would take the last free block, which b needs next
    assert scheduler.num_preemptions == 0 and out.seqs == [a.seqs[0], b.seqs[0]] and out.num_tokens == [1, 1]
    assert not out.spec_token_ids
    assert [len(scheduler.kv_manager.block_table(s.seq_id)) for s in out.seqs] == [2, 3]


def test_a_stop_inside_the_kept_guesses_ends_the_sequence_there():
    scheduler = make_scheduler(block_size=4)
    request = make_request("a", [1, 2, 3], max_tokens=20, stop_token_ids=[50])
    scheduler.add(request)
    scheduler.update(scheduler.schedule(), SamplerOutput([8]))
    seq = request.seqs[0]
    out = scheduler.schedule({seq.seq_id: [50, 51, 52]})
    scheduler.update(out, SamplerOutput([53], accepted=[[50, 51, 52]]))
    assert seq.output_token_ids == [8, 50] and seq.finish_reason == "stop" and seq.stop_reason == 50
    assert not scheduler.has_work() and scheduler.kv_manager.pool.num_used_blocks == 0


# ------------------------------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def grounded_prompts(smollm2):
    _, tokenizer = smollm2
    asks = [f"Repeat this text exactly:\n\n{TEXT}", f"Copy this code without changes:\n\n{CODE}"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
            for a in asks]


def generate(smollm2, prompts, params, one_at_a_time=False, **options):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=256, **options)
    if one_at_a_time:
        outputs = [gen.run([prompt], [p], use_tqdm=False)[0] for prompt, p in zip(prompts, params)]
    else:
        outputs = gen.run(prompts, params, use_tqdm=False)
    assert gen.kv_manager.pool.num_used_blocks == 0 and all(count == 0 for count in gen.kv_manager.pool.ref_counts)
    return [o.outputs[0].token_ids for o in outputs], gen.stats()


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["one-at-a-time", "batched"])
def test_greedy_is_token_identical_to_no_speculation(smollm2, chat_prompts, grounded_prompts, one_at_a_time):
    prompts = grounded_prompts + chat_prompts[:4]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (48, 40, 24, 16, 20, 12)]
    # Batched, speculating sequences share steps with decodes and prefill chunks.
    options = dict(max_num_batched_tokens=64, one_at_a_time=one_at_a_time)
    plain, _ = generate(smollm2, prompts, params, **options)
    fast, stats = generate(smollm2, prompts, params, speculative_config=dict(disable_by_batch_size=8), **options)
    assert fast == plain
    assert stats.spec_decode_num_drafts > 0 and 0 < stats.spec_decode_acceptance_rate <= 1
    assert stats.spec_decode_mean_accepted_length > 1.5  # the copied text is mostly guessed right


def test_the_heuristic_schedule_follows_each_sequence_and_keeps_greedy_tokens(smollm2, grounded_prompts, chat_prompts,
                                                                             monkeypatch):
    """Each sequence's guesses start at one, grow by two while all are kept and shrink by one after a rejection,
    up to num_speculative_tokens, and the greedy tokens stay those of decoding without speculation."""
    prompts = grounded_prompts + chat_prompts[:1]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (64, 48, 24)]
    plain, _ = generate(smollm2, prompts, params)
    seen: dict[int, list[tuple[int, int, int]]] = {}  # seq_id: (window, guessed, kept) of each verification
    record = Speculator.record

    def recording(self, seq, drafts, kept):
        if drafts:  # a sequence's rows in a verifying step, without guesses of its own, leave its window
            seen.setdefault(seq.seq_id, []).append((self.windows.get(seq, 1), len(drafts), len(kept) - 1))
        record(self, seq, drafts, kept)

    monkeypatch.setattr(Speculator, "record", recording)
    spec = dict(num_speculative_tokens=9, num_speculative_tokens_schedule="heuristic", disable_by_batch_size=8)
    fast, stats = generate(smollm2, prompts, params, speculative_config=spec)
    assert fast == plain and len(seen) == len(prompts)
    for steps in seen.values():
        assert steps[0][0] == 1
        for (window, guessed, kept), (after, _, _) in zip(steps, steps[1:]):
            assert guessed <= window and after == next_window(window, guessed, kept, 9)
    windows = [w for steps in seen.values() for w, _, _ in steps]
    assert max(windows) == 9  # the copied text is guessed whole, up to the limit
    assert any(g > 0 and k < g for steps in seen.values() for _, g, k in steps)  # and rejections shrink it
    assert stats.spec_decode_mean_accepted_length > 2


def test_speculation_is_off_while_the_batch_is_large(smollm2, chat_prompts, monkeypatch):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=256,
                                   speculative_config=dict(disable_by_batch_size=2))
    seen = []
    schedule = gen.scheduler.schedule

    def recording_schedule(*args):
        running = len(gen.scheduler.running)
        out = schedule(*args)
        seen.append((running, bool(out.spec_token_ids)))
        return out

    monkeypatch.setattr(gen.scheduler, "schedule", recording_schedule)
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (8, 16, 24, 40)]
    gen.run(chat_prompts[:4], params, use_tqdm=False)
    assert not any(spec for running, spec in seen if running > 2)
    assert any(spec for running, spec in seen if running <= 2)


def test_seeded_sampling_with_speculation_is_reproducible(smollm2, grounded_prompts):
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=7, ignore_eos=True),
              SamplingParams(temperature=0.5, max_tokens=40, seed=3, ignore_eos=True)]
    spec = dict(num_speculative_tokens=3)
    first, stats = generate(smollm2, grounded_prompts, params, speculative_config=spec)
    again, _ = generate(smollm2, grounded_prompts, params, speculative_config=spec)
    assert first == again and all(len(tokens) == 40 for tokens in first)
    assert stats.spec_decode_num_accepted_tokens > 0


def test_a_sequence_without_guesses_samples_as_without_speculation(smollm2, grounded_prompts, chat_prompts):
    """Its rows in a verifying step draw with the plain sampler, so its seeded tokens do not depend on others
    speculating beside it (logprobs keep it from speculating itself)."""
    params = [SamplingParams(temperature=0, max_tokens=32),
              SamplingParams(temperature=0.9, max_tokens=24, seed=11, logprobs=1)]
    prompts = [grounded_prompts[0], chat_prompts[1]]
    plain, _ = generate(smollm2, prompts, params)
    fast, stats = generate(smollm2, prompts, params, speculative_config=dict())
    assert fast == plain and stats.spec_decode_num_drafts > 0


def test_constrained_requests_do_not_speculate(smollm2, grounded_prompts):
    """Their grammar would have to follow every guess; they decode one token a step, and keep to it."""
    sentence = "The lighthouse on the northern cape was built in the spring of a wet year"
    params = SamplingParams(temperature=0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(choice=[sentence, "No."]))
    (tokens,), stats = generate(smollm2, grounded_prompts[:1], [params], speculative_config=dict())
    assert smollm2[1].decode(tokens, skip_special_tokens=True) in (sentence, "No.")
    assert stats.spec_decode_num_drafts == 0


def test_bad_words_keep_greedy_tokens_and_words_of_several_tokens_do_not_speculate(smollm2, grounded_prompts):
    """A one-token bad word is banned at every position a step verifies; a longer one depends on the tokens before
    it, so its sequence decodes one token a step."""
    tokenizer = smollm2[1]
    greedy = SamplingParams(temperature=0, max_tokens=32)
    (free,), _ = generate(smollm2, grounded_prompts[:1], [greedy])
    for words, speculates in ([tokenizer.decode(free[6])], True), ([tokenizer.decode(free[6:8])], False):
        params = greedy.replace(bad_words=words)
        (plain,), _ = generate(smollm2, grounded_prompts[:1], [params])
        (fast,), stats = generate(smollm2, grounded_prompts[:1], [params], speculative_config=dict())
        assert fast == plain != free
        assert (stats.spec_decode_num_drafts > 0) == speculates


def test_metrics_report_acceptance(smollm2, grounded_prompts):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=256, speculative_config=dict())
    metrics = ServerMetrics()
    gen.add_request(grounded_prompts[0], SamplingParams(temperature=0, max_tokens=32,
                                                        output_kind=RequestOutputKind.DELTA))
    while gen.has_unfinished_requests():
        metrics.observe_step(gen.stats(), gen.step())
    metrics.observe_step(gen.stats(), [])
    stats = gen.stats()
    text = generate_latest(metrics.registry).decode().replace('{model_name=""}', "")
    steps = float(text.split("hf_paged:num_running_per_step_count ")[1].split()[0])
    assert f"hf_paged:num_running_per_step_sum {steps}" in text  # one sequence a step, however many tokens it kept
    assert f"hf_paged:spec_decode_num_drafts_total {float(stats.spec_decode_num_drafts)}" in text
    assert f"hf_paged:spec_decode_num_accepted_tokens_total {float(stats.spec_decode_num_accepted_tokens)}" in text
    assert f"hf_paged:spec_decode_acceptance_rate {stats.spec_decode_acceptance_rate}" in text
    assert stats.spec_decode_num_drafts > 0
    # vLLM's per-position counts: each kept guess at its position; a guess is kept only after those before it.
    name = 'hf_paged:spec_decode_num_accepted_tokens_per_pos_total{model_name="",position="%d"} '
    kept = [float(text.split(name % p)[1].split()[0])
            for p in range(len(stats.spec_decode_num_accepted_tokens_per_pos))]
    assert kept == list(stats.spec_decode_num_accepted_tokens_per_pos) == sorted(kept, reverse=True)
    assert sum(kept) == stats.spec_decode_num_accepted_tokens and kept[0] > 0


def test_n_samples_of_a_prompt_whose_last_chunk_is_one_token_start_without_guesses(smollm2):
    """A prompt takes no guesses: with n > 1 its samples fork after the step, and each must start from the prompt."""
    from tiny_models import tiny_model

    from hf_paged import ContinuousBatchGenerator, SamplingParams

    _, tokenizer = smollm2
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # the budget of 10 leaves its last token for a step of its own
    outputs = []
    for speculative_config in (None, {"method": "ngram", "num_speculative_tokens": 4}):
        model, _ = tiny_model("llama")
        gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, max_num_batched_tokens=10,
                                       prepack_weights=False, speculative_config=speculative_config)
        (out,) = gen.run([prompt], SamplingParams(temperature=0, max_tokens=6, n=2, ignore_eos=True),
                         use_tqdm=False)
        outputs.append([o.token_ids for o in out.outputs])
        assert gen.kv_manager.pool.num_used_blocks == 0
    assert outputs[0] == outputs[1]


class _Seq:
    """Stands for a sequence where only its identity matters (the speculator's windows are kept per sequence)."""


def test_a_verification_counts_the_guesses_kept_before_the_models_own_token():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=3), max_model_len=64)
    seq = _Seq()
    speculator.record(seq, [1, 2, 3], [1, 9])  # kept the first guess, then the model's 9
    speculator.record(seq, [], [4])  # no guesses: no verification
    assert (speculator.num_drafts, speculator.num_draft_tokens, speculator.num_accepted_tokens) == (1, 3, 1)


def test_a_sequence_keeps_its_window_while_preempted_and_drops_it_with_itself():
    import gc

    config = SpeculativeConfig(num_speculative_tokens=5, num_speculative_tokens_schedule="heuristic")
    speculator, seq = Speculator(config, max_model_len=64), _Seq()
    for window in (1, 3, 5):  # every guess kept: the window grows by two, up to 5
        assert speculator.windows.get(seq, 1) == window
        speculator.record(seq, [1] * window, [1] * window + [2])
    speculator.propose([])  # a step in which it waits, preempted
    assert speculator.windows[seq] == 5
    del seq
    gc.collect()
    assert len(speculator.windows) == 0


def test_a_step_undone_after_its_verification_counts_it_once(smollm2, monkeypatch):
    """A step that fails after its guesses were verified (here in its prompt logprobs) is undone and computed again:
    its verification counts once, in the stats and in the sequence's window."""
    import hf_paged.generation.model_runner as runner_module

    model, tokenizer = smollm2  # the target drafts for itself: every guess is kept
    spec = dict(method="draft_model", model=model, num_speculative_tokens=4, disable_by_batch_size=8)
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, speculative_config=spec)
    real, failed = runner_module.prompt_logprobs, []

    def flaky(*args, **kwargs):
        if gen.speculator.num_drafts and not failed:
            failed.append(True)
            raise RuntimeError("transient")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_module, "prompt_logprobs", flaky)
    gen.add_request("The alphabet: A B C D", SamplingParams(temperature=0, max_tokens=21, ignore_eos=True))
    late = None
    while gen.has_unfinished_requests():
        if gen.speculator.num_drafts and late is None:  # a prompt asking for logprobs joins a verifying step
            late = gen.add_request("Hello there", SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
        try:
            gen.step()
        except RuntimeError:
            pass
    stats = gen.stats()
    assert failed and (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (4, 16)  # 1 + 4 x 5
    assert stats.spec_decode_num_accepted_tokens == 16 and stats.num_used_blocks == 0
