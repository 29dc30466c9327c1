"""Structured outputs in the engine: every sampled output follows its JSON schema, regex, choice or grammar."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_schemas import SCHEMAS

from hf_paged import ContinuousBatchGenerator, SamplingParams, StructuredOutputsParams
from hf_paged.generation.structured_outputs import GrammarCompiler

pytestmark = pytest.mark.slow

SEEDS = (0, 1)
PROMPT = [{"role": "user", "content": "Reply with a JSON example."}]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s?", r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", r"-?[1-9][0-9]{0,2}",
           r"(true|false)"]
CHOICES = [["yes", "no"], ["Paris", "London", "Rome", "New York"], ["a \"quoted\" one", "back\\slash", "é"]]
OBJECT_QUESTION = 'Write {"name": ..., "age": ...} for Ada Lovelace as JSON.'
EBNF = 'root ::= "(" expr ")"\nexpr ::= num (("+" | "*") num)*\nnum ::= [1-9] [0-9]?'


@pytest.fixture(scope="module")
def generator(smollm2):
    model, tokenizer = smollm2
    return ContinuousBatchGenerator(model, tokenizer, num_blocks=1024)


def constrained(seed: int, max_tokens: int = 160, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_params_are_validated_and_keyed():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    text = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    same = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    reordered = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert text.key == same.key and text == same and hash(text) == hash(same)
    assert text.key != reordered.key  # property order is the order the output writes them in


def test_compile_errors_name_the_field_and_the_cache_reuses_grammars(smollm2):
    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], cache_size=2)
    for spec, field in [({"json": {"type": "nonsense"}}, "json"), ({"regex": "[a-"}, "regex"),
                        ({"grammar": "root ::= undefined_rule"}, "grammar")]:
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field} is invalid: \S"):
            compiler.compile(StructuredOutputsParams(**spec)).result()
    first = compiler.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert compiler.compile(StructuredOutputsParams(json='{"type": "integer"}')) is first
    compiler.compile(StructuredOutputsParams(regex="a"))
    compiler.compile(StructuredOutputsParams(regex="b"))  # cache_size=2: the schema is the least recently used
    assert compiler.compile(StructuredOutputsParams(json={"type": "integer"})) is not first
    compiler.shutdown()


def test_json_schemas_regexes_choices_and_grammars_always_hold(generator):
    """Temperature 1, several seeds, every constraint kind in one `run`: 100% of outputs valid, none cut short."""
    assert len(SCHEMAS) >= 30
    cases = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    params = [constrained(seed, json=schema) for schema, seed in cases]
    params += [constrained(seed, regex=regex) for regex in REGEXES for seed in SEEDS]
    params += [constrained(seed, choice=choice) for choice in CHOICES for seed in SEEDS]
    params += [constrained(seed, grammar=EBNF) for seed in SEEDS] + [constrained(0, json_object=True).replace(temperature=0)]
    # Any JSON object is unbounded: a prompt that asks for a short one, greedily.
    prompts = [PROMPT] * (len(params) - 1) + [[{"role": "user", "content": OBJECT_QUESTION}]]
    outputs = generator.run(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outputs)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), [
        (p.structured_outputs.key, t) for p, o, t in zip(params, outputs, texts) if o.outputs[0].finish_reason != "stop"]
    for (schema, _), text in zip(cases, texts):
        jsonschema.validate(json.loads(text), schema)
    rest = iter(texts[len(cases):])
    for regex in REGEXES:
        for _ in SEEDS:
            assert re.fullmatch(regex, next(rest))
    for choice in CHOICES:
        for _ in SEEDS:
            assert next(rest) in choice
    for _ in SEEDS:
        assert re.fullmatch(r"\(([1-9][0-9]?[+*])*[1-9][0-9]?\)", next(rest))
    assert isinstance(json.loads(next(rest)), dict)
    assert len({t for t, (s, _) in zip(texts, cases) if s is SCHEMAS[0]}) == len(SEEDS)  # seeds do sample


PERSON = SCHEMAS[0]


def test_constrained_and_free_requests_share_a_batch(generator):
    """A free request's tokens do not change when constrained ones run beside it (greedy, exact)."""
    free = SamplingParams(temperature=0, max_tokens=24)
    questions = [[{"role": "user", "content": q}] for q in ("Name three rivers.", "What is 2+2?")]
    alone = generator.run(questions, free, use_tqdm=False)
    mixed = generator.run(questions + [PROMPT] * 3,
                          [free, free] + [constrained(seed, json=PERSON) for seed in range(3)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    for output in mixed[2:]:
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_n_samples_each_follow_the_schema(generator):
    [output] = generator.run([PROMPT], constrained(3, json=PERSON).replace(n=4), use_tqdm=False)
    texts = [c.text for c in output.outputs]
    assert len(texts) == 4 and len(set(texts)) > 1
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)


def test_a_preempted_constrained_request_recomputes_the_same_tokens(smollm2, generator):
    """Preemption keeps the tokens, so the matcher stays valid: outputs equal those of an engine that never preempts."""
    model, tokenizer = smollm2
    schema = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
    params = [constrained(seed, max_tokens=200, json=schema) for seed in range(4)]
    expected = generator.run([PROMPT] * 4, params, use_tqdm=False)
    small = ContinuousBatchGenerator(model, tokenizer, num_blocks=14, prepack_weights=False)
    outputs = small.run([PROMPT] * 4, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_a_grammar_that_does_not_compile_fails_only_its_request(generator):
    good, bad = generator.run([PROMPT, PROMPT], [constrained(0, json=PERSON), constrained(0, regex="(unclosed")],
                              use_tqdm=False)
    assert good.error is None and good.outputs[0].finish_reason == "stop"
    assert bad.finished and "structured_outputs.regex is invalid" in bad.error
    assert not generator.has_unfinished_requests() and generator.kv.pool.num_used_blocks == 0
