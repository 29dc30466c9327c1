"""Speculative decoding with a draft model (``speculative_config={"model": ...}``): the target's greedy tokens whatever
the draft guesses, the draft's own KV following the target's blocks (prefix sharing, preemption, forks), and loading
a draft from a directory or the command line. Tiny random Llamas with SmolLM2's tokenizer keep it fast."""

import argparse
import json

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2Config, LlamaConfig

from hf_paged import ContinuousBatchGenerator, SamplingParams
from hf_paged.generation import EngineConfig
from hf_paged.generation.config import SpeculativeConfig
from hf_paged.kernels.cpu_linear import PrepackedLinear

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [40, 41, 42], [5, 6, 7, 8, 9, 10, 11, 12, 99, 98, 97, 96, 95]]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def llama(tokenizer, seed: int, layers: int = 2, vocab: int | None = None):
    config = LlamaConfig(vocab_size=vocab or len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
                         max_position_embeddings=1024, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="paged", dtype=torch.float32).eval()


def run(target, tokenizer, draft=None, params=None, prompts=PROMPTS, schedule="constant", **options):
    spec = None if draft is None else {"model": draft, "num_speculative_tokens": 4, "disable_by_batch_size": 8,
                                       "num_speculative_tokens_schedule": schedule}
    gen = ContinuousBatchGenerator(target, tokenizer, num_blocks=options.pop("num_blocks", 128), block_size=4,
                                   speculative_config=spec, **options)
    params = params or SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outputs = gen.run(prompts, params, use_tqdm=False)
    assert gen.kv_manager.pool.num_used_blocks == 0 and all(count == 0 for count in gen.kv_manager.pool.ref_counts)
    return [[o.token_ids for o in out.outputs] for out in outputs], gen


def test_greedy_tokens_are_the_targets_whatever_the_draft(tokenizer):
    target = llama(tokenizer, seed=0)
    plain, _ = run(target, tokenizer)
    other, gen = run(target, tokenizer, draft=llama(tokenizer, seed=1, layers=1))
    assert other == plain
    stats = gen.stats()
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_drafts
    draft = gen.speculator.draft
    assert draft.runner.native is not None  # the draft's own steps run natively too
    # over its own copy of the weights: the layers are left unpacked by oneDNN (a third copy)
    assert not any(isinstance(m, PrepackedLinear) for m in draft.model.modules())


def test_a_draft_that_is_the_target_has_every_guess_kept(tokenizer):
    """The same weights compute the same next token from the draft's KV as the target from its own, so every guess
    is kept and each verifying step gains five tokens (fewer only at the end of an output)."""
    target = llama(tokenizer, seed=0)
    plain, _ = run(target, tokenizer)
    same, gen = run(target, tokenizer, draft=target)
    stats = gen.stats()
    assert same == plain
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_mean_accepted_length > 4


def test_the_heuristic_schedule_gives_a_draft_that_is_always_right_its_most_guesses(tokenizer, monkeypatch):
    """Guesses start at one and grow by two while all are kept (1, 3, then the limit of 4), the draft's own KV keeping
    up with guesses of every length; only an output's end asks for fewer."""
    from hf_paged.generation.spec_decode import Speculator

    guesses: dict[int, list[int]] = {}
    record = Speculator.record

    def recording(self, seq, drafts, kept):
        if drafts:
            guesses.setdefault(seq.seq_id, []).append(len(drafts))
        record(self, seq, drafts, kept)

    monkeypatch.setattr(Speculator, "record", recording)
    target = llama(tokenizer, seed=0)
    plain, _ = run(target, tokenizer)
    same, gen = run(target, tokenizer, draft=target, schedule="heuristic")
    stats = gen.stats()
    assert same == plain
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    assert len(guesses) == len(PROMPTS)
    for counts in guesses.values():
        assert counts[:3] == [1, 3, 4] and set(counts[3:-1]) == {4}


def test_the_draft_follows_preemption_and_shared_prefixes(tokenizer):
    """8 blocks of 4 tokens for three sequences of up to 53: the newest is preempted and recomputed, and the two
    prompts that share their first 8 tokens share blocks (the draft's keys and values live in the same blocks)."""
    target = llama(tokenizer, seed=0)
    plain, _ = run(target, tokenizer, num_blocks=16)
    fast, gen = run(target, tokenizer, draft=target, num_blocks=16)
    assert fast == plain
    stats = gen.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0


def test_sampled_outputs_with_a_draft_are_seeded_and_forks_catch_up(tokenizer):
    target, draft = llama(tokenizer, seed=0), llama(tokenizer, seed=0)
    # Temperature 0.2: the random model's distributions are flat, and at 0.8 its most likely token (the draft's
    # guess) has 1-3% of the mass, so whether any guess of a run is kept came down to the seed.
    params = SamplingParams(temperature=0.2, top_p=0.9, max_tokens=30, seed=3, n=2, ignore_eos=True)
    first, gen = run(target, tokenizer, draft=draft, params=params)
    again, _ = run(target, tokenizer, draft=draft, params=params)
    assert first == again and all(len(tokens) == 30 for out in first for tokens in out)
    assert gen.stats().spec_decode_num_accepted_tokens > 0


def test_a_draft_loads_from_a_directory_given_on_the_command_line(tokenizer, tmp_path):
    llama(tokenizer, seed=0).save_pretrained(tmp_path / "draft")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    args = parser.parse_args(["--speculative-config", json.dumps({"model": str(tmp_path / "draft")})])
    config = EngineConfig.from_cli_args(args)
    assert config.speculative_config == SpeculativeConfig(method="draft_model", model=str(tmp_path / "draft"))
    target = llama(tokenizer, seed=0)
    gen = ContinuousBatchGenerator(target, tokenizer, config, num_blocks=64)
    (out,) = gen.run([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == run(target, tokenizer, prompts=[PROMPTS[0]],
                                           params=SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0][0][0]
    assert gen.stats().spec_decode_num_accepted_tokens == gen.stats().spec_decode_num_draft_tokens > 0


def test_draft_model_settings_are_checked(tokenizer):
    for bad, field in [({"method": "draft_model"}, "speculative_config.model is required"),
                       ({"method": "ngram", "model": "/x"}, "speculative_config.model is for the draft_model"),
                       ({"model": 3}, "speculative_config.model must be")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(speculative_config=bad)
    target = llama(tokenizer, seed=0)
    for vocab in (len(tokenizer) + 8, 256):  # more tokens than the target, fewer than the tokenizer
        with pytest.raises(ValueError, match="must share the target's tokenizer"):
            ContinuousBatchGenerator(target, tokenizer, num_blocks=64,
                                     speculative_config={"model": llama(tokenizer, seed=1, vocab=vocab)})
    headless = AutoModel.from_config(llama(tokenizer, seed=1).config, attn_implementation="paged")
    with pytest.raises(ValueError, match="no language-model head"):
        ContinuousBatchGenerator(target, tokenizer, num_blocks=64, speculative_config={"model": headless})


def test_guesses_take_only_the_step_budget_left_after_every_running_sequence(tokenizer):
    """With a step budget of 8 tokens and 8 guesses, the first sequence's guesses took the whole step and the second
    got no token until the first had finished; now both advance every step."""
    target = llama(tokenizer, seed=0)
    spec = {"model": target, "num_speculative_tokens": 8, "disable_by_batch_size": 8}
    gen = ContinuousBatchGenerator(target, tokenizer, num_blocks=128, block_size=4, max_num_batched_tokens=8,
                                   speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [gen.add_request(prompt, params) for prompt in ([30, 31, 32, 33], [40, 41, 42])]
    counts = []
    while gen.has_unfinished_requests():
        gen.step()
        counts.append([gen.requests[i].seqs[0].num_output_tokens if i in gen.requests else None for i in ids])
    both = [c for c in counts[1:] if None not in c]  # after the prompts' step, while both run
    steps = list(zip(both, both[1:]))
    assert steps and all(now[k] > before[k] for before, now in steps for k in (0, 1)), counts
    assert gen.stats().spec_decode_num_accepted_tokens > 0


def test_a_draft_with_a_smaller_vocabulary_reads_the_ids_past_it_as_another(tokenizer):
    """As a vocabulary padded less than the target's (Qwen2.5-0.5B's 151936 against 7B's 152064): a prompt's ids in
    the target's padding, past the draft's, do not crash the draft, and the target decides."""
    target = llama(tokenizer, seed=0, vocab=len(tokenizer) + 64)
    prompts = PROMPTS + [[5, 6, len(tokenizer) + 10, 7, len(tokenizer) + 60]]
    plain, _ = run(target, tokenizer, prompts=prompts)
    small, gen = run(target, tokenizer, draft=llama(tokenizer, seed=1), prompts=prompts)
    assert small == plain and gen.stats().spec_decode_num_drafts > 0


def test_a_draft_with_a_shorter_context_guesses_only_within_it(tokenizer):
    """GPT-2's learned positions end at 32: the draft computes and guesses up to there, the target goes on alone."""
    draft = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=64,
                                                        n_layer=1, n_head=4), attn_implementation="paged").eval()
    target = llama(tokenizer, seed=0)
    prompts = [PROMPTS[0], list(range(5, 45))]  # the second is past the draft's positions from the start
    plain, _ = run(target, tokenizer, prompts=prompts)
    fast, gen = run(target, tokenizer, draft=draft, prompts=prompts)
    assert fast == plain and gen.stats().spec_decode_num_drafts > 0


def test_a_draft_that_fails_in_a_step_with_a_block_copy_leaves_the_copy_made(tokenizer):
    """n=2 forks share the prompt's last, partly filled block; the first decode copies it. When the draft's forward
    raises in that step (a GPU out of memory, say), the step is undone, but the table already points at the copy:
    it must be filled, or the sample that moved reads garbage."""
    target, draft = llama(tokenizer, seed=0), llama(tokenizer, seed=1)
    params = SamplingParams(temperature=0, max_tokens=8, n=2, ignore_eos=True)
    [expected], _ = run(target, tokenizer, params=params, prompts=[[17, 91, 45, 200, 33, 120]])
    gen = ContinuousBatchGenerator(target, tokenizer, num_blocks=40, block_size=4,
                                   speculative_config={"model": draft, "num_speculative_tokens": 2})
    draft_run, failures = gen.speculator.draft.runner.run, []
    schedule = gen.scheduler.schedule

    def schedule_and_arm(*args):
        out = schedule(*args)
        gen.speculator.draft.runner.run = flaky if out.block_copies and not failures else draft_run
        return out

    def flaky(step):
        failures.append(step)
        raise RuntimeError("the draft ran out of memory")

    gen.scheduler.schedule = schedule_and_arm
    gen.add_request([17, 91, 45, 200, 33, 120], params, request_id="r")
    finals = []
    while gen.has_unfinished_requests():
        try:
            finals += [o for o in gen.step() if o.finished]
        except RuntimeError:
            assert len(failures) == 1
    assert failures and [o.token_ids for o in finals[0].outputs] == expected


def test_the_draft_sits_out_a_large_batch_and_catches_up_after(tokenizer):
    """A step of more than ``disable_by_batch_size`` sequences, none speculating, runs no draft forward (it computed
    every token of the batch, for guesses nobody took); once sequences speculate again their draft keys and values
    are caught up (in forwards of at most max_num_batched_tokens), so a draft that is the target has every guess kept,
    through preemption as well."""
    target = llama(tokenizer, seed=0)
    prompts = PROMPTS + [[70, 71, 72, 73, 74], [80, 81]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 36, 8, 10, 12)]
    plain, _ = run(target, tokenizer, prompts=prompts, params=params)
    gen = ContinuousBatchGenerator(target, tokenizer, num_blocks=14, block_size=4, max_num_batched_tokens=12,
                                   speculative_config={"model": target, "num_speculative_tokens": 4,
                                                       "disable_by_batch_size": 2})
    draft, steps, drafted, sizes = gen.speculator.draft.runner, [], set(), []
    draft_run, schedule = draft.run, gen.scheduler.schedule

    def scheduling(*args):
        out = schedule(*args)
        steps.append(len(out.seqs) > 2 and not out.spec_token_ids)  # a step the draft may sit out
        return out

    def counting(step):
        drafted.add(len(steps) - 1)
        sizes.append(step.num_tokens)
        return draft_run(step)

    gen.scheduler.schedule, draft.run = scheduling, counting
    outputs = gen.run(prompts, params, use_tqdm=False)
    stats = gen.stats()
    assert [[o.token_ids for o in out.outputs] for out in outputs] == plain
    idle = {i for i, large in enumerate(steps) if large}
    assert idle and drafted and not idle & drafted
    assert max(sizes) == 12  # a catch-up is cut into forwards of at most max_num_batched_tokens
    assert stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
