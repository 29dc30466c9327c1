"""Beam search in the engine (``SamplingParams(use_beam_search=True)``, a `GenerationConfig` with ``num_beams``,
`LLM.beam_search`) against Transformers' own ``generate(num_beams=...)`` on SmolLM2, among other requests."""

import pytest
import torch
from transformers import GenerationConfig

from hf_paged import LLM, BeamSearchParams, ContinuousBatchGenerator, InvalidParameter, SamplingParams
from hf_paged.generation.beam_search import BeamState, beam_step
from hf_paged.kernels.cpu_linear import unpack_linear_layers
from reference import generate_with

QUESTIONS = ["What is 2+2? Answer with one number.", "Name a colour.", "Say hello.",
             "What is the capital of Italy? One word."]
MAX_TOKENS = 40
# (beam width, length_penalty, early_stopping): the searches end at EOS, by the heuristic, at max_tokens.
SETTINGS = [(4, 1.0, False), (3, 0.5, True), (5, 2.0, "never"), (2, -1.0, False)]


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    _, tokenizer = smollm2
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True).input_ids for q in QUESTIONS]


def transformers_beams(smollm2, ids, width, length_penalty, early_stopping, max_tokens=MAX_TOKENS, **options):
    """`generate`'s ``width`` beams of one prompt (sdpa, plain linear layers), best first, each up to its EOS."""
    model, tokenizer = smollm2
    unpack_linear_layers(model)  # a generator may have packed them
    eos = tokenizer.eos_token_id
    out = generate_with(model, "sdpa", input_ids=torch.tensor([ids]), num_beams=width, num_return_sequences=width,
                        do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
                        early_stopping=early_stopping, eos_token_id=eos, pad_token_id=eos, **options)
    beams = [row[len(ids) :].tolist() for row in out]
    return [beam[: beam.index(eos) + 1] if eos in beam else beam for beam in beams]


@pytest.fixture(scope="module")
def references(smollm2, prompt_ids):
    return {setting: [transformers_beams(smollm2, ids, *setting) for ids in prompt_ids] for setting in SETTINGS}


def beam_params(width, length_penalty, early_stopping, **changes):
    return SamplingParams(n=width, use_beam_search=True, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                          early_stopping=early_stopping, **changes)


@pytest.mark.parametrize("options", [dict(), dict(num_blocks=40, block_size=8),
                                     dict(num_blocks=40, block_size=8, long_prefill_token_threshold=5),
                                     dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})],
                         ids=["default", "preemption", "preemption-chunked", "ngram-speculation"])
def test_beams_are_transformers_beams_among_other_requests(smollm2, prompt_ids, references, options):
    """Every setting's searches run together, beside greedy and sampled requests, in one batch."""
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, **{"num_blocks": 512, **options})
    searches = [(setting, ids) for setting in SETTINGS for ids in prompt_ids]
    others = [SamplingParams(temperature=0, max_tokens=24), SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24)]
    outputs = gen.run([ids for _, ids in searches] + prompt_ids[:2],
                      [beam_params(*setting) for setting, _ in searches] + others, use_tqdm=False)
    got = [[beam.token_ids for beam in output.outputs] for output in outputs[: len(searches)]]
    assert got == [beams for setting in SETTINGS for beams in references[setting]]
    for output, (setting, _) in zip(outputs, searches):
        assert [beam.index for beam in output.outputs] == list(range(setting[0]))
        reasons = ["stop" if beam.token_ids[-1] == tokenizer.eos_token_id else "length" for beam in output.outputs]
        assert [beam.finish_reason for beam in output.outputs] == reasons
        assert all(beam.text == tokenizer.decode(beam.token_ids, skip_special_tokens=True)
                   for beam in output.outputs)
    assert {reason for output in outputs[: len(searches)] for reason in
            (beam.finish_reason for beam in output.outputs)} == {"stop", "length"}
    assert len(outputs[-1].outputs) == 2 and all(output.error is None for output in outputs)
    if "num_blocks" in options:
        assert gen.stats().num_preemptions > 0
    assert not gen.has_unfinished_requests() and gen.kv_manager.pool.num_used_blocks == 0


def test_a_generation_config_with_num_beams_searches_as_generate(smollm2, prompt_ids, references):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=256)
    config = GenerationConfig(num_beams=4, max_new_tokens=MAX_TOKENS, do_sample=False)
    outputs = gen.run(prompt_ids, config, use_tqdm=False)
    # All four beams come back, best first; generate's own answer (num_return_sequences=1) is the first.
    assert [[beam.token_ids for beam in output.outputs] for output in outputs] == references[(4, 1.0, False)]
    # generate's beam search applies a repetition penalty to the beams' log-probabilities; so does the engine's
    penalized = GenerationConfig(num_beams=3, max_new_tokens=MAX_TOKENS, do_sample=False, repetition_penalty=1.3)
    expected = [transformers_beams(smollm2, ids, 3, 1.0, False, repetition_penalty=1.3) for ids in prompt_ids[:2]]
    assert expected != references[(3, 0.5, True)][:2]
    got = gen.run(prompt_ids[:2], penalized, use_tqdm=False)
    assert [[beam.token_ids for beam in output.outputs] for output in got] == expected
    params = SamplingParams.from_generation_config(GenerationConfig(num_beams=3, length_penalty=0.5,
                                                                    early_stopping="never", max_new_tokens=8))
    assert (params.n, params.use_beam_search, params.length_penalty, params.early_stopping) == (3, True, 0.5, "never")
    with pytest.raises(ValueError, match="beam sampling"):
        SamplingParams.from_generation_config(GenerationConfig(num_beams=3, do_sample=True, max_new_tokens=8))


def test_one_beam_is_greedy_decoding_as_in_generate(smollm2, prompt_ids):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=256)
    one_beam = SamplingParams(n=1, use_beam_search=True, max_tokens=15, length_penalty=2.0, early_stopping="never")
    greedy = SamplingParams(temperature=0, max_tokens=15)
    beams, plain = (gen.run(prompt_ids, params, use_tqdm=False) for params in (one_beam, greedy))
    assert [o.outputs[0].token_ids for o in beams] == [o.outputs[0].token_ids for o in plain]
    assert any(o.outputs[0].finish_reason == "stop" for o in beams)
    # Its score, as a wider search reports each beam's: the sum of its tokens' logprobs.
    scored = gen.run(prompt_ids, greedy.replace(logprobs=0), use_tqdm=False)
    assert [o.outputs[0].cumulative_logprob for o in beams] == pytest.approx(
        [sum(step[token] for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)) for o in scored])


def test_an_extreme_length_penalty_ranks_beams_without_failing(smollm2, prompt_ids):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=64)
    params = [SamplingParams(n=2, use_beam_search=True, max_tokens=6, length_penalty=p) for p in (3e38, -3e38)]
    outputs = gen.run(prompt_ids[:1] * 2, params, use_tqdm=False)  # length ** 3e38 is past a float's range
    assert all(output.error is None and len(output.outputs) == 2 for output in outputs)


def test_llm_beam_search_returns_vllm_beams(smollm2_path, smollm2, prompt_ids, references):
    """vLLM's beams: the prompt's tokens and text included; a beam that ended at EOS has it as its stop_reason, and
    in its tokens only with include_stop_str_in_output; vLLM's argument order."""
    import inspect

    llm = LLM(smollm2_path, dtype="float32", num_blocks=256)
    tokenizer, eos = llm.get_tokenizer(), llm.get_tokenizer().eos_token_id
    assert list(inspect.signature(llm.beam_search).parameters)[:4] == ["prompts", "params", "lora_request", "use_tqdm"]
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids[:2]]
    for kept in (False, True):
        results = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS,
                                                            include_stop_str_in_output=kept))
        for ids, result, expected in zip(prompt_ids, results, references[(4, 1.0, False)]):
            assert [beam.tokens for beam in result.sequences] == \
                [ids + (beam if kept or beam[-1] != eos else beam[:-1]) for beam in expected]
            assert [beam.stop_reason for beam in result.sequences] == [eos if beam[-1] == eos else None
                                                                       for beam in expected]
            assert all(beam.text == tokenizer.decode(beam.tokens, skip_special_tokens=True)
                       for beam in result.sequences)
            scores = [got.cum_logprob / len(beam) for beam, got in zip(expected, result.sequences)]
            assert [beam.cum_logprob for beam in result.sequences] and scores == sorted(scores, reverse=True)
        assert any(beam[-1] == eos for beams in references[(4, 1.0, False)][:2] for beam in beams)
    one = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=1, max_tokens=8))[0].sequences
    assert len(one) == 1 and isinstance(one[0].cum_logprob, float) and one[0].cum_logprob < 0
    with pytest.raises(InvalidParameter, match="temperature must be 0"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))


@pytest.mark.parametrize("change, param", [(dict(logprobs=2), "logprobs"), (dict(stop=["."]), "stop"),
                                           (dict(presence_penalty=0.5), "presence_penalty"),
                                           (dict(min_tokens=2), "min_tokens"),
                                           (dict(logit_bias={5: 1.0}), "logit_bias"),
                                           (dict(early_stopping="soon"), "early_stopping")])
def test_what_beam_search_cannot_honour_is_refused_by_name(change, param):
    with pytest.raises(InvalidParameter, match=param) as err:
        SamplingParams(n=2, use_beam_search=True, max_tokens=MAX_TOKENS, **change)
    assert err.value.param == param


def test_a_refused_search_leaves_the_engine_serving(smollm2, prompt_ids):
    model, tokenizer = smollm2
    gen = ContinuousBatchGenerator(model, tokenizer, num_blocks=128)
    params = beam_params(2, 1.0, False)
    params.logprobs = 1  # changed after creation: the engine validates again
    with pytest.raises(InvalidParameter, match="logprobs"):
        gen.add_request(prompt_ids[0], params, request_id="bad")
    outputs = gen.run(prompt_ids[:1], beam_params(2, 1.0, False), use_tqdm=False)
    assert len(outputs[0].outputs) == 2 and outputs[0].error is None


def test_beam_step_follows_transformers_rules():
    """The pure step: of 2 x width candidates the best non-ending ones go on; ending ones among the first width are
    finished, scored with the length penalty; the heuristic ends the search."""
    state = BeamState(width=2, keep=4, live=[object(), object()])
    params = SamplingParams(n=2, use_beam_search=True, length_penalty=1.0)
    rows = [([7, 2, 8, 9], [-0.1, -0.2, -2.0, -3.0]), ([2, 5, 6, 4], [-0.05, -1.0, -1.5, -4.0])]
    step = beam_step(state, params, [-1.0, -1.2], rows, generated=3, limit=10, stop_ids=frozenset({2}))
    # the best four: (0, 7) -1.1, (0, EOS) -1.2, (1, EOS) -1.25, (1, 5) -2.2
    assert [(c.source, c.token) for c in step.running] == [(0, 7), (1, 5)]
    assert [(c.source, c.token, c.score) for c in step.finished] == [(0, 2, pytest.approx(-1.2 / 4))]  # not (1, EOS)
    assert step.improvable and not step.done
    rows = [([2, 7, 8, 9], [-0.1, -0.2, -2.0, -3.0]), ([2, 5, 6, 4], [-0.15, -1.0, -1.5, -4.0])]
    step = beam_step(state, params, [-1.0, -1.0], rows, generated=3, limit=10, stop_ids=frozenset({2}))
    assert [(c.source, c.token) for c in step.finished] == [(0, 2), (1, 2)]
    # the best live beam, -1.2 over 4 tokens, cannot beat the worst finished one's -1.15 over 4
    assert [(c.source, c.token) for c in step.running] == [(0, 7), (1, 5)] and not step.improvable and step.done
    last = beam_step(BeamState(width=2, keep=4, live=[object()]), params, [0.0], [([3, 4, 5, 6], [-1, -2, -3, -4])],
                     generated=9, limit=10, stop_ids=frozenset({2}))
    assert last.done and not last.running and [c.token for c in last.finished] == [3, 4]  # max_tokens ends them all
