"""ContinuousBatchGenerator on the real SmolLM2: exactness against `generate`, caching, preemption, sampling, errors."""

import copy
import math
import pickle
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import (ContinuousBatchGenerator, EngineConfig, InvalidParameter, RequestOutputKind, SamplingParams,
                      StructuredOutputsParams)
from hf_paged.cache import KVCacheSpec
from hf_paged.generation.model_runner import ModelRunner
from hf_paged.generation.sequence import SequenceStatus
from hf_paged.kernels import native
from hf_paged.kernels.cpu_linear import PrepackedLinear, available, unpack_linear_layers
from reference import generate_with

MAX_TOKENS = [8, 24, 16, 32, 12, 20, 28, 10, 18, 26, 14, 30, 9, 22, 17, 25]


@pytest.fixture(scope="module")
def prompt_ids(smollm2, chat_prompts):
    _, tokenizer = smollm2
    return [tokenizer(p).input_ids for p in chat_prompts]


@pytest.fixture(scope="module")
def reference(smollm2, prompt_ids):
    """Transformers' own `generate` (sdpa, plain linear layers), each prompt alone."""
    model, _ = smollm2
    unpack_linear_layers(model)  # an earlier generator may have packed them
    model.set_attn_implementation("sdpa")
    try:
        outs = []
        for ids, max_tokens in zip(prompt_ids, MAX_TOKENS):
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False)
            outs.append(out[0, len(ids) :].tolist())
        return outs
    finally:
        model.set_attn_implementation("paged")


def make_generator(smollm2, **kwargs):
    model, tokenizer = smollm2
    kwargs.setdefault("num_blocks", 256)
    return ContinuousBatchGenerator(model, tokenizer, **kwargs)


def assert_no_leak(gen):
    assert not gen.has_unfinished_requests()
    assert gen.kv_manager.pool.num_used_blocks == 0
    assert all(count == 0 for count in gen.kv_manager.pool.ref_counts)


def run_greedy(gen, prompt_ids):
    params = [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in gen.run(prompt_ids, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(enable_prefix_caching=False),
        dict(num_blocks=24, block_size=8),
        dict(max_num_batched_tokens=16),
        dict(max_num_batched_tokens=2048),
        dict(prepack_weights=False),
        dict(enforce_eager=True),
    ],
    ids=["default", "no-prefix-caching", "preemption", "chunked-prefill", "long-steps", "plain-linear",
         "transformers-forward"],
)
def test_batch_is_token_identical_to_generate_alone(smollm2, prompt_ids, reference, options):
    """Steps of up to 8 tokens run the native decoder (unless enforce_eager), longer ones the Transformers forward."""
    unpack_linear_layers(smollm2[0])  # as loaded: the layers packed below are this engine's doing
    gen = make_generator(smollm2, **options)
    native_runs = not options.get("enforce_eager", False) and native.compiler() is not None
    assert (gen.runner.native is not None) == native_runs
    # The native decoder multiplies by its own copy of the weights: where it takes steps of 512 tokens, a oneDNN copy
    # of them as well would cost memory for a few percent on longer steps (the layers it does not cover, none in this
    # model, are packed). Its steps are then of 512 tokens unless told (else of 2048).
    native_512 = native_runs and gen.runner.native.max_tokens == 512
    assert gen.config.max_num_batched_tokens == options.get("max_num_batched_tokens", 512 if native_512 else 2048)
    linears = [m for m in gen.model.modules() if isinstance(m, torch.nn.Linear)]
    packed = {isinstance(m, PrepackedLinear) for m in linears}
    assert packed == {options.get("prepack_weights", True) and available(torch.float32) and not native_512}
    if native_runs:
        assert len(gen.runner.native_linear_layers()) == (len(linears) if native_512 else 0)
    assert run_greedy(gen, prompt_ids) == reference
    stats = gen.stats()
    if "num_blocks" in options:
        assert stats.num_preemptions > 0
    if options.get("max_num_batched_tokens") == 16:
        assert stats.num_partial_prefills > 0
    assert_no_leak(gen)


def test_prefix_caching_hits_on_a_shared_system_prompt(smollm2):
    model, tokenizer = smollm2
    system = ("You are a helpful assistant for a small bakery. Answer briefly, politely and only about bread, cakes, "
              "opening hours (eight to six) and prices, which you can look up in the price list.")
    questions = ["Do you sell rye bread?", "When do you open?", "How much is a croissant?", "Do you bake cakes?"]
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=12)
    cold = make_generator(smollm2, enable_prefix_caching=False).run(prompts, params, use_tqdm=False)
    gen = make_generator(smollm2)
    gen.run(prompts[:1], params, use_tqdm=False)
    warm = gen.run(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    stats = gen.stats()
    assert stats.prefix_cache_hits > 0 and stats.prefix_cache_queries > stats.prefix_cache_hits
    assert all(o.num_cached_tokens >= 32 for o in warm)
    assert_no_leak(gen)


def test_prompts_sharing_a_system_prompt_compute_it_once_in_capped_chunks(smollm2):
    """Admitted together under a small long-prefill cap, prompts sharing a system prompt each compute a different
    chunk of it, then take each other's blocks (`Scheduler._catch_up`): its whole blocks are computed once, and the
    tokens are those of cold runs."""
    _, tokenizer = smollm2
    system = " ".join(["You answer for a small bakery, briefly and politely, about bread, cakes and prices."] * 4)
    questions = ["Do you sell rye bread?", "When do you open?", "How much is a croissant?", "Do you bake cakes?"]
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    cold = make_generator(smollm2, enable_prefix_caching=False, long_prefill_token_threshold=0).run(
        prompts, params, use_tqdm=False)
    gen = make_generator(smollm2, long_prefill_token_threshold=16, block_size=16)
    computed, schedule = [], gen.scheduler.schedule
    gen.scheduler.schedule = lambda *a, **k: computed.append(schedule(*a, **k)) or computed[-1]
    warm = gen.run(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    ids = [o.prompt_token_ids for o in warm]
    common = next(i for i, column in enumerate(zip(*ids)) if len(set(column)) > 1) // 16 * 16
    assert common >= 64  # several chunks of the cap
    assert sum(sum(out.num_tokens) for out in computed) == common + sum(len(p) - common for p in ids) + 4 * 5
    assert_no_leak(gen)


def test_a_cache_salt_shares_prefix_blocks_only_with_the_same_salt(smollm2, chat_prompts):
    """vLLM's ``cache_salt`` in a prompt dict: a prompt computed under one salt is a hit for the same salt only (not
    for another, nor for no salt); an empty or non-string salt is refused by name."""
    gen = make_generator(smollm2)
    ids = gen.tokenizer(chat_prompts[3]).input_ids
    params = SamplingParams(temperature=0, max_tokens=4)

    def cached(prompt) -> tuple[int, list[int]]:
        (out,) = gen.run([prompt], params, use_tqdm=False)
        return out.num_cached_tokens, out.outputs[0].token_ids

    cold, tokens = cached({"prompt_token_ids": ids, "cache_salt": "alice"})
    assert cold == 0
    assert cached({"prompt_token_ids": ids, "cache_salt": "bob"}) == (0, tokens)
    assert cached(ids) == (0, tokens)
    assert cached({"prompt_token_ids": ids, "cache_salt": "alice"}) == ((len(ids) - 1) // 16 * 16, tokens)
    assert cached(ids)[0] > 0  # the unsalted prompt's own blocks, from its run above
    for bad in ("", 7):
        with pytest.raises(InvalidParameter, match="cache_salt must be a non-empty string") as refused:
            gen.add_request({"prompt_token_ids": ids, "cache_salt": bad}, params)
        assert refused.value.param == "cache_salt"
    assert_no_leak(gen)


def test_prefix_is_shared_within_one_step(smollm2, chat_prompts):
    """Requests admitted in the same step share the prefix blocks the first of them is filling in that step."""
    prompts = [chat_prompts[3]] * 3 + [chat_prompts[5]]
    params = SamplingParams(temperature=0, max_tokens=10)
    cold = make_generator(smollm2, enable_prefix_caching=False).run(prompts, params, use_tqdm=False)
    gen = make_generator(smollm2)
    ids = [gen.add_request(prompt, params) for prompt in prompts]
    gen.step()  # one step prefills all four prompts
    assert all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in gen.scheduler.running)
    outputs = {}
    while gen.has_unfinished_requests():
        outputs.update({o.request_id: o for o in gen.step()})
    warm = [outputs[i] for i in ids]
    assert [o.outputs[0].token_ids for o in warm] == [o.outputs[0].token_ids for o in cold]
    prompt_len = len(warm[0].prompt_token_ids)
    assert warm[0].num_cached_tokens == 0
    assert warm[1].num_cached_tokens == warm[2].num_cached_tokens == (prompt_len - 1) // 16 * 16
    assert_no_leak(gen)


def test_failed_step_leaves_no_prefix_behind(smollm2, chat_prompts, monkeypatch):
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=0, max_tokens=4)
    gen.add_request(chat_prompts[3], params)
    original = gen.runner.execute
    monkeypatch.setattr(gen.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        gen.step()
    assert gen.kv_manager.pool.num_cached_blocks == 0
    monkeypatch.setattr(gen.runner, "execute", original)
    for request_id in list(gen.requests):
        gen.abort_request(request_id)
    out = gen.run([chat_prompts[3]], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.error is None
    assert [o.outputs[0].finish_reason for o in gen.step()] == ["abort"]  # the aborted request's, held by run
    assert_no_leak(gen)


def test_a_failed_step_takes_back_its_admissions(smollm2, chat_prompts, monkeypatch):
    """B matched the prompt blocks A committed in the same step; the step failed and A left, so B must recompute
    them rather than attend to blocks that were never written."""
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = make_generator(smollm2).run([chat_prompts[6]], params, use_tqdm=False)[0].outputs[0].token_ids
    gen = make_generator(smollm2)
    a, b = gen.add_request(chat_prompts[6], params), gen.add_request(chat_prompts[6], params)
    original = gen.runner.execute
    monkeypatch.setattr(gen.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        gen.step()
    monkeypatch.setattr(gen.runner, "execute", original)
    waiting = list(gen.scheduler.waiting)
    assert len(waiting) == 2 and not gen.scheduler.running
    assert all(seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0 for seq in waiting)
    assert gen.kv_manager.pool.num_used_blocks == 0
    gen.abort_request(a)
    outputs = {}
    while gen.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in gen.step())
    assert outputs[b].outputs[0].token_ids == expected
    assert_no_leak(gen)


def test_an_engine_seed_makes_unseeded_requests_repeat(smollm2, chat_prompts):
    """vLLM's engine seed: requests without a seed of their own draw the same when they come in the same order."""
    params = SamplingParams(temperature=1.0, max_tokens=16)

    def texts(**options) -> list[str]:
        outputs = make_generator(smollm2, **options).run(chat_prompts[:3], params, use_tqdm=False)
        return [output.outputs[0].text for output in outputs]

    assert texts(seed=7) == texts(seed=7) != texts(seed=8)
    assert texts() != texts()  # no seed: different every run
    with pytest.raises(ValueError, match="seed must be an integer"):
        make_generator(smollm2, seed="7")
    assert EngineConfig(kv_cache_memory="64MiB").kv_cache_memory == 64 << 20  # the command line's sizes, in Python


def test_seeded_sampling_is_independent_of_the_batch(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16)
    alone = gen.run([chat_prompts[1]], params, use_tqdm=False)[0].outputs[0].text
    others = [SamplingParams(temperature=1.0, seed=i, max_tokens=8 + i) for i in range(15)]
    batch = gen.run([chat_prompts[1]] + chat_prompts[:15], [params] + others, use_tqdm=False)
    assert batch[0].outputs[0].text == alone
    assert len({o.outputs[0].text for o in batch}) > 5
    # A request without top-k/top-p beside one with them (which draws from sorted probabilities).
    plain = SamplingParams(temperature=1.0, seed=42, max_tokens=16)
    alone = gen.run([chat_prompts[1]], plain, use_tqdm=False)[0].outputs[0].text
    beside = gen.run([chat_prompts[1], chat_prompts[2]], [plain, params], use_tqdm=False)[0].outputs[0].text
    assert beside == alone
    assert_no_leak(gen)


def test_logit_bias(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    free = gen.run([chat_prompts[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    forced = gen.run([chat_prompts[0], chat_prompts[0]], [greedy.replace(logit_bias={42: 100}), greedy],
                     use_tqdm=False)
    assert forced[0].outputs[0].token_ids == [42] * 6 and forced[1].outputs[0].token_ids == free
    banned = gen.run([chat_prompts[0]], greedy.replace(logit_bias={free[0]: -100}), use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != free[0]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={42: 101})
    with pytest.raises(ValueError, match="logit_bias must name token ids in the vocabulary"):
        gen.add_request(chat_prompts[0], SamplingParams(logit_bias={10**7: 1}))
    assert_no_leak(gen)


def test_bad_words_and_allowed_token_ids_match_generate(smollm2, chat_prompts):
    """vLLM's ``bad_words`` and ``allowed_token_ids``, greedy, against `generate` with the same bans
    (``bad_words_ids``) and restriction (``prefix_allowed_tokens_fn``), beside an unconstrained request."""
    model, tokenizer = smollm2
    gen = make_generator(smollm2)
    prompt = tokenizer(chat_prompts[0]).input_ids
    greedy = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)  # as generate's min_new_tokens
    free = gen.run([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    text = tokenizer.decode(free[4:6])  # a word of two tokens the free output completes, and one of one
    words = [text, tokenizer.decode(free[1])]
    banned = greedy.replace(bad_words=words)
    ids = banned.bad_words_token_ids(tokenizer)
    assert free[4:6] in ids and any(len(w) == 1 for w in ids)
    allowed = sorted(set(free) | set(range(100, 400)))
    restricted = greedy.replace(allowed_token_ids=allowed)
    outs = gen.run([prompt] * 3, [banned, restricted, greedy], use_tqdm=False)
    assert outs[2].outputs[0].token_ids == free
    args = dict(input_ids=torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    expected = generate_with(model, "sdpa", bad_words_ids=ids, **args)[0, len(prompt):].tolist()
    assert outs[0].outputs[0].token_ids == expected != free
    assert all(expected[i + 1 - len(w):i + 1] != w for w in ids for i in range(len(expected)))
    expected = generate_with(model, "sdpa", prefix_allowed_tokens_fn=lambda *_: allowed, **args)[0, len(prompt):]
    assert outs[1].outputs[0].token_ids == expected.tolist()
    sampled = gen.run([prompt] * 4, [restricted.replace(temperature=1.0, seed=s) for s in range(4)],
                      use_tqdm=False)
    assert {t for o in sampled for t in o.outputs[0].token_ids} <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids must be in the vocabulary"):
        gen.add_request(prompt, SamplingParams(allowed_token_ids=[10**7]))
    assert_no_leak(gen)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_constraints_that_exclude_every_token_fail_their_request_alone(smollm2, chat_prompts, temperature):
    """allowed_token_ids against bad words, the stop tokens min_tokens bans, or a grammar: a request that leaves
    itself no token fails naming its parameters (it got token 0, or one outside its allowed set), others go on."""
    _, tokenizer = smollm2
    gen = make_generator(smollm2, speculative_config=dict())
    base = SamplingParams(temperature=temperature, seed=1, max_tokens=6)
    paris = tokenizer(" Paris", add_special_tokens=False).input_ids
    conflicts = [
        base.replace(allowed_token_ids=paris, bad_words=["Paris"]),
        base.replace(allowed_token_ids=[tokenizer.eos_token_id], min_tokens=2),
        base.replace(allowed_token_ids=paris, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
    ]
    free = base.replace(max_tokens=4)
    outputs = gen.run([chat_prompts[0]] * 4, [*conflicts, free], use_tqdm=False)
    for output, names in zip(outputs, ["allowed_token_ids, bad_words", "allowed_token_ids, min_tokens",
                                       "allowed_token_ids, structured_outputs"]):
        assert f"SamplingParams {names} together exclude every token at output position 0" in output.error
        assert output.error_param == "allowed_token_ids"
    assert outputs[3].error is None and len(outputs[3].outputs[0].token_ids) == 4
    later = base.replace(allowed_token_ids=paris, bad_words=["Paris Paris"])  # " Paris", then nothing
    [output] = gen.run([chat_prompts[0]], later, use_tqdm=False)
    assert "allowed_token_ids, bad_words together exclude every token at output position 1" in output.error
    assert_no_leak(gen)


def test_tiny_temperatures_are_greedy_and_huge_values_refused(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    greedy = gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    tiny = gen.run([chat_prompts[1]], SamplingParams(temperature=1e-30, seed=3, max_tokens=12), use_tqdm=False)[0]
    assert tiny.outputs[0].token_ids == greedy.outputs[0].token_ids
    for name in ("temperature", "repetition_penalty"):
        with pytest.raises(ValueError, match=f"{name} must be a finite float32 number"):
            SamplingParams(**{name: 1e39})
    assert_no_leak(gen)


def test_a_stop_string_is_matched_only_where_it_ends_in_new_text():
    from hf_paged.generation.stopping import Stop, find_stop_string

    # "th" ended in text checked earlier (or skipped under min_tokens); a long second stop must not widen its window.
    text = "The waves of the sea"
    assert find_stop_string(text, len(" sea"), ["th", "Q" * 40], include_stop=False) is None
    assert find_stop_string(text, len("e sea"), ["he s"], include_stop=False) == Stop("stop", "he s", len("The waves of t"))
    assert find_stop_string(text, len("e sea"), ["he s"], include_stop=True).text_end == len("The waves of the s")


def test_stop_strings_cut_exactly(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    free = gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[10:14]
    assert stop.strip() and text.find(stop) == 10
    cut = gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=30, stop=[stop]), use_tqdm=False)[0]
    assert cut.outputs[0].text == text[:10]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    kept = gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=30, stop=[stop],
                                                     include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.outputs[0].text == text[:14]
    assert_no_leak(gen)


def test_a_stop_tokens_text_is_cut_and_its_id_kept(smollm2, chat_prompts):
    """As in vLLM: the text of the token that stopped a sequence (a stop_token_id, or EOS with special tokens shown)
    is not in the output unless include_stop_str_in_output; its id is."""
    gen = make_generator(smollm2)
    tokenizer = smollm2[1]
    free = gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    stop_at = next(i for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i]
                   and tokenizer.decode([t]).strip())
    stop_id = free.token_ids[stop_at]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                include_stop_str_in_output=include)
        out = gen.run([chat_prompts[1]], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == free.token_ids[: stop_at + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_id
        assert out.text == tokenizer.decode(free.token_ids[: stop_at + include])
    shown = SamplingParams(temperature=0, max_tokens=200, skip_special_tokens=False)
    out = gen.run([chat_prompts[0]], shown, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token not in out.text and out.text == tokenizer.decode(out.token_ids[:-1])
    assert_no_leak(gen)


def test_a_stream_given_up_aborts_its_requests(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for _ in gen.stream(chat_prompts[:2], long):
        break  # the generator is closed here, as a caller that stops reading closes it
    short = gen.run([chat_prompts[3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert short[0].outputs[0].finish_reason == "length" and gen.stats().generation_tokens < 20
    assert_no_leak(gen)


def test_run_hands_other_requests_outputs_to_the_next_step(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    other = gen.add_request(chat_prompts[0], SamplingParams(temperature=0, max_tokens=3))
    [mine] = gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert mine.finished and len(mine.outputs[0].token_ids) == 12
    held = []
    while gen.has_unfinished_requests():  # the usual loop: held outputs count as unfinished work
        held += gen.step()
    assert [o.request_id for o in held if o.finished] == [other]
    assert len(held[-1].outputs[0].token_ids) == 3
    assert_no_leak(gen)


def test_run_holds_one_output_per_other_request(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    long = dict(temperature=0, max_tokens=20, ignore_eos=True)
    cumulative = gen.add_request(chat_prompts[0], SamplingParams(**long))
    delta = gen.add_request(chat_prompts[0], SamplingParams(**long, output_kind=RequestOutputKind.DELTA))
    gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    first = gen.step()  # what `run` held (one output each, not one per step), then this step's
    assert sorted(o.request_id for o in first) == sorted([cumulative, delta] * 2)
    outputs = list(first)
    while gen.has_unfinished_requests():
        outputs += gen.step()
    deltas = [o for o in outputs if o.request_id == delta]
    merged = deltas[0]
    for output in deltas[1:]:
        merged.add(output)
    finals = {o.request_id: o for o in outputs}
    assert merged.finished and merged.outputs[0].token_ids == finals[cumulative].outputs[0].token_ids
    assert len(merged.outputs[0].token_ids) == 20
    assert_no_leak(gen)


def test_a_stream_closed_while_another_is_read_keeps_the_others_outputs(smollm2, chat_prompts, monkeypatch):
    gen = make_generator(smollm2)
    step, steps = gen._step, []

    def bounded_step(only):  # losing the short request's last output would leave its stream stepping forever
        steps.append(1)
        assert len(steps) < 100, "the short stream never saw its request finish"
        return step(only)

    monkeypatch.setattr(gen, "_step", bounded_step)
    short = gen.stream([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=3))
    next(short)
    long = gen.stream([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(6):  # steps taken for the long stream finish the short one's request
        next(long)
    long.close()
    rest = list(short)
    assert rest and rest[-1].finished and len(rest[-1].outputs[0].token_ids) == 3
    assert_no_leak(gen)


def test_a_stream_given_up_at_a_refused_prompt_aborts_the_others(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    stream = gen.stream(["", chat_prompts[0]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    assert "prompt is empty" in next(stream).error
    stream.close()
    while gen.has_unfinished_requests():
        assert gen.step() == []  # the withdrawn request's outputs are nobody's
    assert gen.stats().generation_tokens < 5
    assert_no_leak(gen)


def test_prompt_tokens_count_the_prompts_computed(smollm2):
    """`prompt_tokens` (and /metrics' prompt_tokens_total) counts a prompt once its first token comes, as vLLM counts
    the prefill tokens processed: a request aborted while queued counted 300 prompt tokens it never computed; a
    preempted one recomputed is not counted again."""
    gen = make_generator(smollm2, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = gen.add_request([5] * 100, params)
    queued = gen.add_request([6] * 300, params)
    gen.step()
    gen.abort_request(queued)
    while gen.has_unfinished_requests():
        gen.step()
    assert first and gen.stats().prompt_tokens == 100
    gen = make_generator(smollm2, num_blocks=10, block_size=4)
    gen.run([[5] * 12, [6] * 12], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True), use_tqdm=False)
    assert gen.stats().num_preemptions > 0 and gen.stats().prompt_tokens == 24


def test_stop_tokens_are_banned_for_exactly_min_tokens(smollm2):
    model, tokenizer = smollm2
    gen = make_generator(smollm2)
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=10, logit_bias={eos: 100})
    [out] = gen.run([[5, 6, 7]], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 3 and eos not in tokens[:2] and tokens[2] == eos and out.outputs[0].finish_reason == "stop"


def test_a_prompt_that_raises_withdraws_the_prompts_before_it(smollm2, chat_prompts, monkeypatch):
    gen = make_generator(smollm2)
    add = gen.add_request
    calls = []

    def failing_second(prompt, params=None, request_id=None, lora_request=None, priority=0):
        calls.append(prompt)
        if len(calls) == 2:
            raise RuntimeError("tokenizer crashed")
        return add(prompt, params, request_id, lora_request, priority)

    monkeypatch.setattr(gen, "add_request", failing_second)
    with pytest.raises(RuntimeError, match="tokenizer crashed"):
        gen.run(chat_prompts[:3], SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)
    assert gen.step() == [] and gen.stats().generation_tokens == 0
    assert_no_leak(gen)


def test_n_samples_share_prompt_blocks(smollm2, chat_prompts):
    gen = make_generator(smollm2, block_size=8)
    rid = gen.add_request(chat_prompts[6], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12))
    while rid not in gen.requests or len(gen.requests[rid].seqs) < 4:
        gen.step()
    seqs = gen.requests[rid].seqs
    tables = [gen.kv_manager.block_table(s.seq_id) for s in seqs]
    prompt_blocks = len(seqs[0].request.prompt_token_ids) // 8
    assert prompt_blocks >= 2
    assert all(t[:prompt_blocks] == tables[0][:prompt_blocks] for t in tables)
    assert all(gen.kv_manager.pool.ref_counts[b] == 4 for b in tables[0][:prompt_blocks])
    final = None
    while gen.has_unfinished_requests():
        for out in gen.step():
            final = out
    assert len(final.outputs) == 4 and [o.index for o in final.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1
    assert_no_leak(gen)


def test_n_samples_count_against_max_num_seqs(smollm2, chat_prompts):
    gen = make_generator(smollm2, max_num_seqs=4)
    params = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6), SamplingParams(n=3, seed=2, max_tokens=6),
              SamplingParams(temperature=0, max_tokens=6)]
    ids = [gen.add_request(prompt, p) for prompt, p in zip(chat_prompts[:3], params)]
    finals, most = {}, 0
    while gen.has_unfinished_requests():
        finals.update((o.request_id, o) for o in gen.step() if o.finished)
        most = max(most, len(gen.scheduler.running))
    assert most == 4
    assert [len(finals[i].outputs) for i in ids] == [3, 3, 1]
    assert_no_leak(gen)


def test_n_samples_start_from_the_prompt(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = gen.run([chat_prompts[2]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    three = gen.run([chat_prompts[2]], greedy.replace(n=3), use_tqdm=False)[0]
    assert [o.token_ids for o in three.outputs] == [alone] * 3
    # Samples that finish on their first token (here max_tokens=1) still all come back.
    first = gen.run([chat_prompts[2]], greedy.replace(n=2, max_tokens=1), use_tqdm=False)[0]
    assert first.error is None and [o.token_ids for o in first.outputs] == [alone[:1]] * 2
    assert_no_leak(gen)


def test_a_step_that_fails_after_the_forward_changes_nothing(smollm2, chat_prompts, monkeypatch):
    import hf_paged.generation.model_runner as runner_module

    params = SamplingParams(temperature=0, max_tokens=6)
    gen = make_generator(smollm2)
    expected = gen.run(chat_prompts[:3], params, use_tqdm=False)
    ids = [gen.add_request(p, params) for p in chat_prompts[:3]]
    gen.step()
    real_sample = runner_module.sample

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(runner_module, "sample", real_sample)
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(runner_module, "sample", fail_once)
    with pytest.raises(RuntimeError, match="sampling failed"):
        gen.step()
    outputs = {}
    while gen.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in gen.step())
    assert [outputs[i].outputs[0].token_ids for i in ids] == [o.outputs[0].token_ids for o in expected]
    assert_no_leak(gen)


def test_prefix_lookups_count_once_per_admission(smollm2, chat_prompts):
    # Room for only some of the prompts at a time: the others wait, and their lookups are repeated every step.
    gen = make_generator(smollm2, num_blocks=6)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for prompt in chat_prompts[:4]:
        gen.add_request(prompt, params)
    outputs, deferred = {}, 0
    while gen.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in gen.step())
        deferred += bool(gen.scheduler.waiting)
    outputs = list(outputs.values())
    stats = gen.stats()
    assert deferred and stats.num_preemptions == 0
    assert stats.prefix_cache_queries == sum(len(o.prompt_token_ids) for o in outputs)
    assert_no_leak(gen)


def test_abort_frees_the_request_blocks(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    keep = gen.add_request(chat_prompts[0], SamplingParams(temperature=0, max_tokens=6))
    drop = gen.add_request(chat_prompts[6], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        gen.step()
    used_with_both = gen.kv_manager.pool.num_used_blocks
    gen.abort_request(drop)
    outputs = {o.request_id: o for o in gen.step()}
    assert outputs[drop].finished and outputs[drop].outputs[0].finish_reason == "abort"
    assert gen.kv_manager.pool.num_used_blocks < used_with_both
    while gen.has_unfinished_requests():
        for out in gen.step():
            outputs[out.request_id] = out
    assert outputs[keep].outputs[0].finish_reason in ("stop", "length")
    assert_no_leak(gen)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(params=lambda: SamplingParams(temperature=-1)), "temperature"),
        (dict(params=lambda: SamplingParams(top_p=0)), "top_p"),
        (dict(params=lambda: SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(params=lambda: SamplingParams(seed=2**63)), "seed"),
        (dict(params=lambda: SamplingParams(n=2.5)), "n must be an integer"),
        (dict(params=lambda: SamplingParams(temperature=float("nan"))), "temperature"),
        (dict(prompt="word " * 3000), "max_model_len"),
        (dict(engine_params=SamplingParams(stop_token_ids=[10**6], min_tokens=2)), "stop_token_ids"),
        (dict(engine_params=SamplingParams(logprobs=10**6)), "logprobs"),
        (dict(engine_params=SamplingParams(n=1000)), "max_num_seqs"),
        (dict(params=lambda: SamplingParams(stop_token_ids=5)), "stop_token_ids must be a list of integers"),
        (dict(params=lambda: SamplingParams(logit_bias=[1, 2])), "logit_bias must be a map"),
        (dict(params=lambda: SamplingParams(ignore_eos="false")), "ignore_eos must be True or False"),
        (dict(params=lambda: SamplingParams(allowed_token_ids=[])), "allowed_token_ids must be a non-empty list"),
        (dict(params=lambda: SamplingParams(allowed_token_ids=[1.0])), "allowed_token_ids must be a non-empty list"),
        (dict(params=lambda: SamplingParams(bad_words="bad")), "bad_words must be a list of non-empty strings"),
        (dict(params=lambda: SamplingParams(bad_words=[" "])), "bad_words must be a list of non-empty strings"),
        (dict(params=lambda: SamplingParams(bad_words=["\ud800"])), r"strings \(that UTF-8 can hold\)"),
        (dict(params=lambda: StructuredOutputsParams(json={"enum": {1, 2}})), "json is not valid JSON"),
        (dict(prompt=[{"role": "user"}]), "cannot be rendered by the tokenizer's chat template"),
        (dict(prompt=[{"role": "user", "content": 5}]), "cannot be rendered by the tokenizer's chat template"),
        (dict(engine_params={"temperature": 0}), "sampling_params must be SamplingParams or GenerationConfig"),
    ],
    ids=["empty", "temperature", "top_p", "max_tokens", "seed", "n-float", "nan", "too-long", "stop-token-id",
         "logprobs", "n-too-many", "stop-token-ids-int", "logit-bias-list", "bool-string", "allowed-empty",
         "allowed-float", "bad-words-string", "bad-words-blank", "bad-words-surrogate", "schema-not-json",
         "chat-no-content",
         "chat-int-content", "params-dict"],
)
def test_bad_input_fails_alone(smollm2, chat_prompts, bad, message):
    gen = make_generator(smollm2, max_model_len=2048)
    if "params" in bad:
        with pytest.raises(ValueError, match=message):
            bad["params"]()
        return
    good = SamplingParams(temperature=0, max_tokens=8)
    prompt, params = bad.get("prompt", chat_prompts[1]), bad.get("engine_params", good)
    outputs = gen.run([chat_prompts[0], prompt, chat_prompts[3]], [good, params, good], use_tqdm=False)
    assert message in outputs[1].error and outputs[1].finished and not outputs[1].outputs
    assert outputs[0].error is None and "Paris" in outputs[0].outputs[0].text
    assert outputs[2].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        gen.add_request(prompt, params)
    assert_no_leak(gen)


@pytest.mark.parametrize("option", [dict(max_num_seqs=0), dict(max_num_batched_tokens=0), dict(num_blocks=0),
                                    dict(block_size=0), dict(max_model_len=0), dict(max_model_len=-5),
                                    dict(long_prefill_token_threshold=-1), dict(long_prefill_token_threshold=1.5)])
def test_engine_sizes_must_be_positive(smollm2, option):
    name = next(iter(option))
    with pytest.raises(ValueError, match=name):
        make_generator(smollm2, **option)


def test_the_long_prefill_threshold_defaults_to_a_share_of_the_step_and_keeps_the_tokens(smollm2, prompt_ids,
                                                                                           reference):
    """Prompts computed in chunks of at most the threshold (a long one's chunks beside others' decodes) give
    `generate`'s tokens, as whole prompts do."""
    for budget, threshold in ((2048, 512), (4096, 1024), (1200, 512), (700, 350), (512, 256), (64, 32)):
        assert make_generator(smollm2, max_num_batched_tokens=budget).config.long_prefill_token_threshold == threshold
    default = make_generator(smollm2).config  # 512-token steps where the native decoder runs, else 2048
    assert default.long_prefill_token_threshold == {512: 256, 2048: 512}[default.max_num_batched_tokens]
    gen = make_generator(smollm2, long_prefill_token_threshold=5)
    assert run_greedy(gen, prompt_ids) == reference
    assert gen.stats().num_partial_prefills >= sum(len(ids) // 5 for ids in prompt_ids) // 2
    assert_no_leak(gen)


def test_a_max_model_len_beyond_the_context_or_the_cache_is_refused(smollm2):
    """As vLLM: an explicit limit is not lowered in silence (the default is the smaller of the two)."""
    model, _ = smollm2
    context = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_model_len \({context + 1}\) is longer than the model's context"):
        make_generator(smollm2, num_blocks=(context + 16) // 16 + 1, max_model_len=context + 1)
    with pytest.raises(ValueError, match=r"max_model_len \(1025\) is more than the KV cache holds \(1024 tokens\)"):
        make_generator(smollm2, num_blocks=64, max_model_len=1025)
    assert make_generator(smollm2, num_blocks=64, max_model_len=1024).max_model_len == 1024
    assert make_generator(smollm2, num_blocks=64).max_model_len == 1024


def test_prompt_tokens_beyond_the_model_vocabulary_are_refused(smollm2, monkeypatch):
    """A tokenizer may know more tokens than the model embeds: text prompts are checked as token ids are."""
    gen = make_generator(smollm2)
    monkeypatch.setattr(gen.inputs, "vocab_size", 1000)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        gen.add_request("Photosynthesis", SamplingParams(max_tokens=2))
    assert not gen.has_unfinished_requests()


def test_logprobs_and_timings(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    out = gen.run([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    steps = out.outputs[0].logprobs
    assert len(steps) == len(out.outputs[0].token_ids)
    for token, top in zip(out.outputs[0].token_ids, steps):
        assert token in top and top[token] == max(top.values()) and len(top) == 3
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_stream_yields_growing_text(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    texts = [o.outputs[0].text for o in gen.stream([chat_prompts[2]], SamplingParams(temperature=0, max_tokens=12))]
    assert len(texts) == 12 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert_no_leak(gen)


def test_multibyte_characters_detokenize_whole(smollm2):
    _, tokenizer = smollm2
    gen = make_generator(smollm2)
    text = "Café 東京 🍣 naïve"
    ids = tokenizer(text).input_ids
    # Feed the tokens one at a time through the detokenizer as if they were being generated.
    from hf_paged.generation.detokenizer import Detokenizer
    from hf_paged.generation.sequence import Request

    request = Request("x", None, ids[:1], SamplingParams(), seed=0)
    seq = request.seqs[0]
    pieces = []
    for token in ids[1:]:
        seq.token_ids.append(token)
        pieces.append(Detokenizer(tokenizer).step(seq, True))
    assert all("\ufffd" not in p for p in pieces)
    assert tokenizer.decode(ids[:1]) + "".join(pieces) == text
    assert seq.status is SequenceStatus.WAITING and gen.kv_manager.pool.num_used_blocks == 0


def test_a_skipped_special_token_inside_a_character_keeps_its_bytes(smollm2):
    """The two byte tokens of "é" with a special token between them: its first byte was not released yet."""
    _, tokenizer = smollm2
    from hf_paged.generation.detokenizer import Detokenizer
    from hf_paged.generation.sequence import Request

    first, second = tokenizer.convert_tokens_to_ids("Ã"), tokenizer.convert_tokens_to_ids("©")
    x = tokenizer("x").input_ids[0]
    tokens = [first, tokenizer.eos_token_id, second, x, x]
    seq = Request("x", None, tokenizer("Hello").input_ids, SamplingParams(), seed=0).seqs[0]
    detokenizer = Detokenizer(tokenizer)
    for token in tokens:
        seq.token_ids.append(token)
        detokenizer.step(seq, True)
    assert seq.text == tokenizer.decode(tokens, skip_special_tokens=True) == "éxx"


def test_a_skipped_special_token_keeps_the_next_tokens_space():
    """A SentencePiece-style decoder drops the leading space of the first token it decodes, so the token after a
    skipped special token must still be decoded with the tokens before it as context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_paged.generation.detokenizer import Detokenizer
    from hf_paged.generation.sequence import Request

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<x>": 3, "\u2581hello": 4, "\u2581world": 5, "\u2581again": 6}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    backend.decoder = decoders.Metaspace(prepend_scheme="always")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>", additional_special_tokens=["<x>"])
    assert tokenizer.decode([5]) == "world"  # the space goes when a token is decoded alone
    seq = Request("x", None, [1], SamplingParams(), seed=0).seqs[0]
    detokenizer = Detokenizer(tokenizer)
    for token in [4, 3, 5, 6]:
        seq.token_ids.append(token)
        detokenizer.step(seq, True)
    assert seq.text == "hello world again"
    assert [detokenizer.token_text(t) for t in (3, 5)] == ["<x>", " world"]  # a logprob's token keeps its space


def test_a_failed_forward_ends_a_tensor_parallel_group(smollm2, chat_prompts, monkeypatch):
    """Its collectives may have failed, or run on some ranks only: the group cannot go on as after a failed step."""
    from hf_paged.distributed import DistributedError

    class GroupOfOne:  # a lockstep whose broadcast hands back what rank 0 sent
        rank, broken = 0, None

        def exchange(self, actions):
            return actions

    def broken(out):
        raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer")

    gen = make_generator(smollm2)
    gen.add_request(chat_prompts[0], SamplingParams(max_tokens=4))
    monkeypatch.setattr(gen, "lockstep", GroupOfOne())
    monkeypatch.setattr(gen.runner, "execute", broken)
    with pytest.raises(DistributedError, match="a tensor-parallel forward failed on this rank: RuntimeError"):
        gen.step()
    assert gen.lockstep.broken.startswith("a forward failed on rank 0")  # nothing more is sent to the others
    with pytest.raises(NotImplementedError, match="reset_prefix_cache is not supported on a tensor-parallel"):
        gen.reset_prefix_cache()  # the ranks would forget blocks at different steps and leave lockstep


def test_generation_config_is_mapped_or_refused(smollm2, chat_prompts):
    from transformers import GenerationConfig

    params = SamplingParams.from_generation_config(GenerationConfig(max_new_tokens=7, do_sample=False))
    assert params.greedy and params.max_tokens == 7
    with pytest.raises(ValueError, match="num_beams"):  # beam sampling (beam search: tests/test_beam_search.py)
        SamplingParams.from_generation_config(GenerationConfig(num_beams=4, do_sample=True))
    gen = make_generator(smollm2)
    out = gen.run([chat_prompts[0]], GenerationConfig(max_new_tokens=5, do_sample=False), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    # The model's own config, and defaults written out, are no options; an unset top_k is generate's 50.
    model, tokenizer = smollm2
    own = SamplingParams.from_generation_config(model.generation_config)
    assert own.max_tokens == 20 and own.n == 1  # generate makes 20 new tokens when nothing says how many
    written = GenerationConfig(num_beams=1, output_scores=False, output_attentions=False, do_sample=True)
    assert SamplingParams.from_generation_config(written).top_k == 50
    with pytest.raises(ValueError, match="output_attentions"):
        SamplingParams.from_generation_config(GenerationConfig(output_attentions=True))
    # A config's end tokens replace the model's, as in generate: this one runs past the model's EOS.
    replaced = GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=[tokenizer.encode("zebra")[0]])
    ids = tokenizer(chat_prompts[0], return_tensors="pt").input_ids
    expected = model.generate(ids, attention_mask=torch.ones_like(ids),
                              generation_config=replaced)[0, ids.shape[1]:].tolist()
    [out] = gen.run([chat_prompts[0]], replaced, use_tqdm=False)
    assert out.outputs[0].token_ids == expected and tokenizer.eos_token_id in expected[:-1]
    with pytest.raises(ValueError, match="output_logits"):  # it returned nothing
        SamplingParams.from_generation_config(GenerationConfig(output_logits=True, return_dict_in_generate=True))
    # stop_strings end generate's text with the string, as include_stop_str_in_output does.
    tokenizer = gen.tokenizer
    stopping = GenerationConfig(max_new_tokens=40, do_sample=False, stop_strings=["."])
    inputs = tokenizer("The capital of France is", return_tensors="pt")
    expected = model.generate(**inputs, generation_config=stopping, tokenizer=tokenizer)[0, inputs.input_ids.shape[1]:]
    [out] = gen.run([inputs.input_ids[0].tolist()], stopping, use_tqdm=False)
    assert out.outputs[0].token_ids == expected.tolist()
    assert out.outputs[0].text == tokenizer.decode(expected) and out.outputs[0].text.endswith(".")


def test_the_models_generation_config_fills_what_parameters_leave_out(smollm2, chat_prompts):
    """As `generate` (a GenerationConfig's unset sampling fields) and vLLM (no parameters at all)."""
    from transformers import GenerationConfig

    model, tokenizer = smollm2
    own = model.generation_config
    model.generation_config = custom = copy.deepcopy(own)
    custom.do_sample, custom.top_k, custom.repetition_penalty = True, 1, 1.5
    try:
        gen = make_generator(smollm2)
        ids = tokenizer(chat_prompts[0], return_tensors="pt").input_ids
        expected = model.generate(ids, generation_config=GenerationConfig(max_new_tokens=16))[0, ids.shape[1]:]
        assert expected.tolist() != gen.run([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=16),
                                            use_tqdm=False)[0].outputs[0].token_ids  # the penalty shows
        merged = gen.run([chat_prompts[0]], GenerationConfig(max_new_tokens=16), use_tqdm=False)[0]
        bare = gen.run([chat_prompts[0]], use_tqdm=False)[0]  # vLLM's default max_tokens, 16
        assert merged.outputs[0].token_ids == bare.outputs[0].token_ids == expected.tolist()
    finally:
        model.generation_config = own


def test_vllm_prompt_dicts_aborts_of_lists_and_seed_minus_one(smollm2, chat_prompts):
    _, tokenizer = smollm2
    gen = make_generator(smollm2)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    ids = tokenizer(chat_prompts[0]).input_ids
    [plain] = gen.run([chat_prompts[0]], greedy, use_tqdm=False)
    alone = gen.run({"prompt_token_ids": ids}, greedy, use_tqdm=False)  # one prompt, not its keys
    listed = gen.run([{"prompt": chat_prompts[0]}, {"prompt_token_ids": ids}], (greedy, greedy), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone + listed] == [plain.outputs[0].token_ids] * 3
    assert listed[0].prompt == chat_prompts[0] and listed[1].prompt_token_ids == ids
    [bad] = gen.run([{"prompt": "hi", "multi_modal_data": {}}], greedy, use_tqdm=False)
    assert "multi_modal_data" in bad.error
    with pytest.raises(ValueError, match="prompt_token_ids must be a list of integers"):
        gen.add_request({"prompt_token_ids": "12"}, greedy)
    with pytest.raises(TypeError, match="a request id is a string"):
        gen.abort_request([["r1"]])
    rid = gen.add_request(chat_prompts[0], greedy.replace(max_tokens=50), request_id=b"bytes-id")
    gen.abort_request(rid)  # one id, not its bytes
    assert [o.outputs[0].finish_reason for o in gen.step() if o.finished] == ["abort"]
    rids = [gen.add_request(chat_prompts[i], greedy.replace(max_tokens=50)) for i in range(2)]
    gen.abort_request(rids)
    finals = {o.request_id: o.outputs[0].finish_reason for o in gen.step() if o.finished}
    assert finals == dict.fromkeys(rids, "abort")
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, seed=-1)
    assert unseeded.seed is None
    texts = {o.outputs[0].text for o in gen.run([chat_prompts[1]] * 4, unseeded, use_tqdm=False)}
    assert len(texts) > 1
    assert_no_leak(gen)


def test_logprobs_are_floats_with_vllms_logprob_fields(smollm2, chat_prompts):
    """vLLM's ``Logprob`` (``.logprob``, ``.rank``, ``.decoded_token``), each still the float it was."""
    _, tokenizer = smollm2
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=8, logprobs=2, prompt_logprobs=1)
    [out] = gen.run([chat_prompts[4]], params, use_tqdm=False)
    choice = out.outputs[0]
    for token, entry in zip(choice.token_ids, choice.logprobs):
        top = sorted(entry.values(), reverse=True)[:2]  # the likeliest two; the sampled token may come third
        assert [v.rank for v in top] == [1, 2] and all(v.logprob == float(v) for v in entry.values())
        assert entry[token].rank == 1 + sum(v > entry[token] for v in top) or entry[token].rank > 2 == len(entry) - 1
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in entry.items())
    assert any(entry[token].rank > 1 for token, entry in zip(choice.token_ids, choice.logprobs))  # sampled
    prompt = out.prompt_token_ids
    assert [e[t].rank for t, e in zip(prompt[1:], out.prompt_logprobs[1:])] == out.prompt_ranks[1:]
    again = pickle.loads(pickle.dumps(choice.logprobs))
    assert [{t: (v, v.rank, v.decoded_token) for t, v in e.items()} for e in again] == \
        [{t: (v, v.rank, v.decoded_token) for t, v in e.items()} for e in choice.logprobs]


def test_vllms_other_sampling_fields(smollm2):
    """logprobs=-1 is the whole vocabulary's; detokenize=False gives the token ids and no text; extra_args is carried;
    per-request logits processors are refused (as in vLLM V1)."""
    gen = make_generator(smollm2)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    [whole] = gen.run(["Hi there"], greedy.replace(logprobs=-1, prompt_logprobs=-1), use_tqdm=False)
    entries = whole.outputs[0].logprobs + whole.prompt_logprobs[1:]
    assert [len(entry) for entry in entries] == [gen.vocab_size] * (2 + len(whole.prompt_token_ids) - 1)
    assert sum(math.exp(v) for v in entries[0].values()) == pytest.approx(1, abs=1e-3)
    [plain] = gen.run(["Hi there"], greedy, use_tqdm=False)
    [ids_only] = gen.run(["Hi there"], greedy.replace(detokenize=False, extra_args={"k": 1}, logprobs=1,
                                                      prompt_logprobs=1), use_tqdm=False)
    assert ids_only.outputs[0].token_ids == plain.outputs[0].token_ids == whole.outputs[0].token_ids
    assert ids_only.outputs[0].text == "" != plain.outputs[0].text
    untexted = ids_only.outputs[0].logprobs + ids_only.prompt_logprobs[1:]  # as vLLM's: no decoding asked, none done
    assert untexted and all(lp.decoded_token is None for entry in untexted for lp in entry.values())
    for fields, words in (({"logits_processors": [lambda ids, logits: logits]}, "logits processors are not"),
                          ({"detokenize": False, "stop": ["x"]}, "empty when detokenize is False"),
                          ({"extra_args": [1]}, "extra_args must be a dict"), ({"logprobs": -2}, "or -1")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**fields)
    assert_no_leak(gen)


def test_truncate_prompt_tokens_keeps_the_prompts_end(smollm2, chat_prompts):
    """vLLM's left truncation; -1 keeps what leaves the context room for one new token."""
    _, tokenizer = smollm2
    gen = make_generator(smollm2, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=4)
    ids = tokenizer(chat_prompts[6]).input_ids
    [cut] = gen.run([chat_prompts[6]], greedy.replace(truncate_prompt_tokens=9), use_tqdm=False)
    [alone] = gen.run([ids[-9:]], greedy, use_tqdm=False)
    assert cut.prompt_token_ids == ids[-9:] and cut.outputs[0].token_ids == alone.outputs[0].token_ids
    [long] = gen.run(["word " * 200], greedy.replace(truncate_prompt_tokens=-1), use_tqdm=False)
    assert len(long.prompt_token_ids) == 63 and long.outputs[0].finish_reason == "length"
    [kept] = gen.run([[10**7] + ids[-9:]], greedy.replace(truncate_prompt_tokens=9), use_tqdm=False)
    assert kept.error is None  # the id outside the vocabulary is cut off before the prompt is checked
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1, or -1"):
        SamplingParams(truncate_prompt_tokens=0)
    assert_no_leak(gen)


def test_sample_i_of_n_draws_as_a_request_seeded_seed_plus_i(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    (together,) = gen.run([chat_prompts[2]], params.replace(n=3, seed=100), use_tqdm=False)
    alone = gen.run([chat_prompts[2]] * 3, [params.replace(seed=100 + i) for i in range(3)], use_tqdm=False)
    assert [o.token_ids for o in together.outputs] == [out.outputs[0].token_ids for out in alone]
    assert len({tuple(o.token_ids) for o in together.outputs}) == 3


def test_a_refused_model_is_left_unpacked(smollm2, monkeypatch):
    model, tokenizer = smollm2
    unpack_linear_layers(model)

    def broken(*args, **kwargs):
        raise TypeError("unexpected keyword argument")

    monkeypatch.setattr(ModelRunner, "execute", broken)
    with pytest.raises(ValueError, match="cannot run with the paged backend"):
        ContinuousBatchGenerator(model, tokenizer, num_blocks=16)
    assert not any(isinstance(m, PrepackedLinear) for m in model.modules())


def test_a_model_whose_cache_update_takes_no_kwargs_is_served_exactly(smollm2):
    """GPTNeoX calls `cache.update` without its attention kwargs; the engine passes its step to attention as a
    forward argument and needs no cache object, so it serves the model exactly."""
    _, tokenizer = smollm2
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, intermediate_size=64)).eval()
    ids = [tokenizer("The capital of France is").input_ids, tokenizer("Once upon a time there was").input_ids]
    expected = [model.generate(torch.tensor([i]), max_new_tokens=10, do_sample=False)[0, len(i):].tolist() for i in ids]
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=16)
    outs = gen.run(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_model_whose_forward_drops_its_kwargs_is_refused(smollm2):
    """FalconModel does not hand its forward's kwargs to its layers: its attention would run without the cache."""
    _, tokenizer = smollm2
    from transformers import FalconConfig

    model = AutoModelForCausalLM.from_config(FalconConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=2))
    with pytest.raises(ValueError, match="FalconForCausalLM's forward does not pass its keyword arguments"):
        ContinuousBatchGenerator(model, tokenizer, num_blocks=16)


def test_a_model_computing_its_own_attention_is_refused():
    from transformers import BloomConfig

    model = AutoModelForCausalLM.from_config(BloomConfig(hidden_size=32, n_layer=1, n_head=2, vocab_size=49152))
    with pytest.raises(ValueError, match="BloomForCausalLM does not run its attention through Transformers'"):
        ContinuousBatchGenerator(model, object(), num_blocks=16)


def test_request_ids_are_unique_while_live(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=0, max_tokens=2)
    gen.add_request(chat_prompts[0], params, request_id="x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        gen.add_request(chat_prompts[1], params, request_id="x")  # still in the inbox
    gen.step()
    with pytest.raises(ValueError, match="already in use"):
        gen.add_request(chat_prompts[1], params, request_id="x")  # running
    while gen.has_unfinished_requests():
        gen.step()
    assert gen.add_request(chat_prompts[1], params, request_id="x") == "x"  # finished ids can be reused
    while gen.has_unfinished_requests():
        gen.step()
    assert_no_leak(gen)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_an_id_stays_in_use_until_its_held_final_output_is_handed_out(smollm2, chat_prompts, kind):
    """A `run` that steps past another request's end holds its final output for `step`; reusing the id before that
    merged or replaced the output nobody had read."""
    gen = make_generator(smollm2)
    gen.add_request(chat_prompts[0], SamplingParams(temperature=0, max_tokens=2, output_kind=kind), request_id="x")
    gen.run([chat_prompts[1]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    with pytest.raises(ValueError, match="'x' is already in use"):
        gen.add_request(chat_prompts[2], SamplingParams(temperature=0, max_tokens=3), request_id="x")
    [held] = gen.step()
    assert held.request_id == "x" and held.finished and len(held.outputs[0].token_ids) == 2
    assert gen.add_request(chat_prompts[2], SamplingParams(temperature=0, max_tokens=3), request_id="x") == "x"
    outputs = []
    while gen.has_unfinished_requests():
        outputs += gen.step()
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
    assert_no_leak(gen)


def test_a_stream_left_after_its_request_ended_frees_the_id(smollm2, chat_prompts):
    """The held final output of a stream's request, dropped when the stream is closed unread, frees its id."""
    gen = make_generator(smollm2)
    stream = gen.stream([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=2))
    next(stream)
    gen.add_request(chat_prompts[1], SamplingParams(temperature=0, max_tokens=1), request_id="y")
    while gen.has_unfinished_requests():
        gen.step()  # the paused stream's request ends here: its last output is held for the stream
    stream.close()
    assert gen._router.is_empty
    assert_no_leak(gen)


def test_bf16_kv_cache_under_an_fp32_model(smollm2, chat_prompts):
    model, tokenizer = smollm2
    memory = 256 * KVCacheSpec.from_config(model.config).bytes_per_block(16, torch.float32)
    fp32 = make_generator(smollm2, num_blocks=None, kv_cache_memory=memory)
    bf16 = make_generator(smollm2, num_blocks=None, kv_cache_memory=memory, kv_cache_dtype="bfloat16")
    assert bf16.kv_storage.key_cache[0].dtype == torch.bfloat16 and fp32.kv_storage.key_cache[0].dtype == torch.float32
    assert bf16.kv_storage.num_blocks == 2 * fp32.kv_storage.num_blocks == 512
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = [o.outputs[0].token_ids for o in fp32.run(chat_prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in bf16.run(chat_prompts, params, use_tqdm=False)]
    assert all(len(g) == len(e) for g, e in zip(got, expected))
    # bf16 keys and values move the logits a little: most answers are unchanged, and none starts differently.
    assert sum(g == e for g, e in zip(got, expected)) >= len(expected) * 3 // 4
    assert all(g[:2] == e[:2] for g, e in zip(got, expected))
    assert "Paris" in bf16.run([chat_prompts[0]], params, use_tqdm=False)[0].outputs[0].text
    assert_no_leak(bf16)
    for bad in (torch.int8, "float8"):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of float32, bfloat16, float16"):
            make_generator(smollm2, kv_cache_dtype=bad)


def test_a_request_aborted_twice_is_reported_once(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    request_id = gen.add_request(chat_prompts[0], SamplingParams(temperature=0, max_tokens=50))
    gen.step()
    gen.abort_request(request_id)
    gen.abort_request(request_id)
    outputs = gen.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [(request_id, "abort")]
    assert gen.step() == []
    assert_no_leak(gen)


def test_step_leaves_a_paused_streams_outputs_to_it(smollm2, chat_prompts):
    """Someone else steps the engine while a stream waits to be read: the stream still gets its outputs and ends,
    and `step` returns only the requests nobody else waits for."""
    gen = make_generator(smollm2)
    stream = gen.stream([chat_prompts[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    first = next(stream)
    other = gen.add_request(chat_prompts[1], SamplingParams(temperature=0, max_tokens=3))
    stepped = []
    while gen.has_unfinished_requests():
        stepped += gen.step()
    assert {o.request_id for o in stepped} == {other} and stepped[-1].finished
    rest = list(stream)
    assert rest[-1].request_id == first.request_id and rest[-1].finished
    assert len(rest[-1].outputs[0].token_ids) == 6
    assert_no_leak(gen)


@pytest.mark.parametrize("family", ["phi3", "llama"])  # Phi-3 runs the Transformers forward, Llama the native one
def test_longrope_tokens_are_those_of_each_sequence_alone(family, smollm2):
    """LongRoPE switches to its long factors when a forward call reaches past the original length: the engine
    chooses per token as each sequence alone would, whatever shares the step, and a long prompt does not reuse the
    cached blocks of a short one it starts with (its keys are rotated differently). Llama's `generate` agrees token
    for token; Phi-3's recomputes a sequence's whole cache when it grows past the original length, which the engine
    does not: there only prompts already past it agree."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)], "original_max_position_embeddings": 16}
    shape = dict(vocab_size=256, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, rope_scaling=rope,
                 original_max_position_embeddings=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = (Phi3Config if family == "phi3" else LlamaConfig)(**shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged").eval()
    short, long_ = [8, 100, 4], list(range(3, 40))
    starts_alike = list(range(3, 15))  # the long prompt's first 12 tokens: three blocks of 4
    prompts = [short, long_, starts_alike]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def engine(prompts: list[list[int]], **options) -> list[list[int]]:
        gen = ContinuousBatchGenerator(model, smollm2[1], num_blocks=128, block_size=4, **options)
        assert (gen.runner.native is not None) == (family == "llama")
        tokens = [o.outputs[0].token_ids for o in gen.run(prompts, params, use_tqdm=False)]
        assert_no_leak(gen)
        return tokens

    alone = [engine([prompt])[0] for prompt in prompts]
    for options in (dict(), dict(max_num_batched_tokens=8)):
        assert engine(prompts, **options) == alone
        assert engine([starts_alike, long_], **options) == [alone[2], alone[1]]  # the short prompt cached first
    for prompt in prompts if family == "llama" else [long_]:
        ids = torch.tensor([prompt])
        out = generate_with(model, "eager", input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                            do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == alone[prompts.index(prompt)]


def test_prompt_logprobs_are_the_models_own_whatever_the_chunking_caching_or_preemption(smollm2, chat_prompts):
    model, tokenizer = smollm2
    prompts = [tokenizer(text).input_ids for text in chat_prompts[:3]]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            own = logprobs[torch.arange(len(ids) - 1), ids[1:]]
            expected.append((own, logprobs[:-1].topk(2).indices, (logprobs[:-1] > own[:, None]).sum(-1) + 1))
    params = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2, n=2, ignore_eos=True)
    for options in (dict(), dict(max_num_batched_tokens=7), dict(num_blocks=12, block_size=4, max_num_batched_tokens=8)):
        gen = make_generator(smollm2, **options)
        gen.run(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # its blocks are cached
        outputs = gen.run(prompts, params, use_tqdm=False)
        for output, ids, (token_logprobs, top, ranks) in zip(outputs, prompts, expected):
            scores = output.prompt_logprobs
            assert scores[0] is None and len(scores) == len(ids) and output.num_cached_tokens == 0
            assert output.prompt_ranks[0] is None and output.prompt_ranks[1:] == ranks.tolist()
            got = torch.tensor([scores[i][ids[i]] for i in range(1, len(ids))])
            assert torch.allclose(got, token_logprobs, atol=1e-4)
            assert all(set(top[i - 1].tolist()) <= set(scores[i]) for i in range(1, len(ids)))
            assert all(len(scores[i]) in (2, 3) for i in range(1, len(ids)))
        assert "num_blocks" not in options or gen.stats().num_preemptions > 0
        assert_no_leak(gen)
    deltas = list(gen.stream(prompts[:1], params.replace(output_kind=RequestOutputKind.DELTA)))
    assert [o.prompt_logprobs is not None for o in deltas] == [True] + [False] * (len(deltas) - 1)
    assert [o.prompt_ranks is not None for o in deltas] == [True] + [False] * (len(deltas) - 1)
    assert gen.run(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs is None


def test_parameters_changed_after_creation_are_checked_again(smollm2, chat_prompts):
    gen = make_generator(smollm2)
    good, changed = SamplingParams(temperature=0, max_tokens=4), SamplingParams(temperature=0, max_tokens=4)
    changed.n = 0
    outputs = gen.run(chat_prompts[:2], [good, changed], use_tqdm=False)
    assert outputs[0].error is None and "n must be an integer >= 1" in outputs[1].error
    assert outputs[1].error_param == "n"
    assert_no_leak(gen)


def test_a_model_switched_away_from_paged_attention_is_named_not_run(smollm2, chat_prompts):
    """The native decoder would run it anyway, the Transformers forward would fail on the paged arguments."""
    model, _ = smollm2
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=0, max_tokens=4)
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="switched to 'sdpa' after the engine was built"):
            gen.run(chat_prompts[:2], params, use_tqdm=False)
    finally:
        model.set_attn_implementation("paged")
    assert all(o.error is None for o in gen.run(chat_prompts[:2], params, use_tqdm=False))
    assert_no_leak(gen)


def test_run_from_two_threads_at_once_gives_each_its_own_outputs(smollm2, prompt_ids, chat_prompts, reference):
    """Steps take turns; each serves both threads' requests, and each thread gets exactly its own outputs (one
    thread's text prompts are tokenized while the other's step detokenizes)."""
    gen = make_generator(smollm2)
    halves, results, errors = [range(0, 8), range(8, 16)], {}, []

    def work(half):
        try:
            params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]) for i in half]
            prompts = [prompt_ids[i] if half.start == 0 else chat_prompts[i] for i in half]
            outputs = gen.run(prompts, params, use_tqdm=False)
            results[half.start] = [o.outputs[0].token_ids for o in outputs]
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(half,)) for half in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors and results[0] == reference[:8] and results[8] == reference[8:]
    assert_no_leak(gen)
    assert gen._router.is_empty


def test_an_interrupt_while_a_step_is_applied_fails_that_steps_requests_only(smollm2, chat_prompts, monkeypatch):
    """Ctrl+C inside `Scheduler.update` leaves its sequences half updated: they fail (reported by the next step,
    their blocks freed) instead of wedging every later step; the engine then serves new requests."""
    gen = make_generator(smollm2)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [gen.add_request(prompt, params) for prompt in chat_prompts[:3]]
    detokenize, calls = gen.scheduler.detokenizer.step, []

    def interrupted(seq, skip):
        calls.append(seq)
        if len(calls) == 8:  # the third step, on its second sequence
            raise KeyboardInterrupt
        return detokenize(seq, skip)

    monkeypatch.setattr(gen.scheduler.detokenizer, "step", interrupted)
    finals, reported, interrupts = {}, [], 0
    while gen.has_unfinished_requests():
        try:
            finished = [o for o in gen.step() if o.finished]
        except KeyboardInterrupt:
            interrupts += 1
            gen.abort_request(ids[0])  # a client leaving meanwhile: its request is still reported once
            continue
        finals |= {o.request_id: o for o in finished}
        reported += [o.request_id for o in finished]
    assert interrupts == 1 and sorted(reported) == sorted(ids)
    assert all("interrupted" in finals[i].error for i in ids)
    assert_no_leak(gen)
    [fresh] = gen.run([chat_prompts[0]], params, use_tqdm=False)
    assert fresh.error is None and len(fresh.outputs[0].token_ids) == 12
