"""Structured outputs in the engine: every sampled output follows its JSON schema, regex, choice or grammar."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future

import jsonschema
import pytest
from structured_schemas import AGE, SCHEMAS
from test_scheduler import assert_no_leak, make_request, make_scheduler, run_to_end, step

from hf_paged import ContinuousBatchGenerator, SamplingParams, StructuredOutputsParams
from hf_paged.generation.structured_outputs import GrammarCompiler, GrammarMatcher, fill_bitmask

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)
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
    lark = compiler.compile(StructuredOutputsParams(grammar='start: "a::=b"')).result()  # Lark, "::=" in a string
    assert GrammarMatcher.of(lark).accept(tokenizer("a", add_special_tokens=False).input_ids[0])
    compiler.shutdown()


def test_a_constraint_that_compiles_too_long_is_refused_and_the_next_compiles(smollm2):
    """Some regexes of a few hundred characters take minutes to compile, holding the compiles behind them: past its
    compile_timeout a constraint is refused (the compile process is killed: a thread cannot be stopped), and the next
    one compiles in a new process."""
    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], compile_timeout=1)
    compiler.compile(StructuredOutputsParams(regex="x")).result()  # the process is up
    slow = "".join(f"[^{chr(0x4E00 + i)}]{{2000}}" for i in range(40))
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"structured_outputs\.regex did not compile within 1 s"):
        compiler.compile(StructuredOutputsParams(regex=slow)).result()
    assert time.monotonic() - started < 30
    # The new process's start and its reading of the vocabulary do not count against a compile's time.
    quick = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], compile_timeout=0.1)
    grammar = quick.compile(StructuredOutputsParams(regex="ab+")).result()
    assert GrammarMatcher.of(grammar).accept(tokenizer("a", add_special_tokens=False).input_ids[0])
    compiler.shutdown()
    quick.shutdown()


def test_the_compile_process_survives_many_descriptors_and_its_own_death(smollm2):
    """A busy server holds more than 1024 descriptors (the most select() takes): the compile process starts past them.
    A process killed mid-compile (for memory, say) fails that compile by name, not as the constraint's fault, and the
    same constraint compiles again in a new process."""
    import os
    import signal

    from hf_paged.generation.grammar_worker import compile_process

    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id], compile_timeout=3)
    compile_process().close()
    held = [open(os.devnull) for _ in range(1100)]
    try:
        compiler.compile(StructuredOutputsParams(regex="x")).result()
        assert compile_process()._process.stdout.fileno() > 1024
    finally:
        for file in held:
            file.close()
    slow = StructuredOutputsParams(regex="".join(f"[^{chr(0x4E00 + i)}]{{2000}}" for i in range(40)))
    future = compiler.compile(slow)
    time.sleep(1)
    os.kill(compile_process()._process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="the grammar compile process ended"):
        future.result()
    with pytest.raises(ValueError, match="did not compile within 3 s"):  # tried again, in a new process
        compiler.compile(slow).result()
    grammar = compiler.compile(StructuredOutputsParams(regex="ab+")).result()
    assert GrammarMatcher.of(grammar).accept(tokenizer("a", add_special_tokens=False).input_ids[0])
    compiler.shutdown()


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 1}}, "contains"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf other than an integer's"),
    ({"type": "object", "properties": {"s": {"not": {"const": "x"}}}}, "not"),
    ({"type": "object", "properties": {"a": {}}, "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "minLength/maxLength beside a pattern"),
    ({"type": "string", "format": "credit-card"}, "format 'credit-card'"),
    ({"type": "string", "format": {"x": 1}}, "format {'x': 1}"),
    ({"type": "object", "properties": {"a": {}}, "required": [["a"]]}, "required properties it does not declare"),
    ({"allOf": [{"minimum": 5}, {"maximum": 3}]}, "allOf of several"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, "required properties it does not declare"),
    ({"$defs": {"x": {"type": "array", "uniqueItems": True}}, "$ref": "#/$defs/x"}, "uniqueItems"),
    ({"type": "integer", "enum": ["x"]}, "enum or const values that its type does not allow"),
    ({"type": "string", "const": "abcdef", "maxLength": 2}, "keywords beside an enum or const"),
    ({"$defs": {"s": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/s", "maxLength": 2}}},
     "keywords beside a $ref"),
    ({"type": "string", "pattern": "^(?!x)x$"}, "lookaround in a pattern"),
    ({"$ref": "https://example.com/schema.json"}, "$ref outside the schema"),
    ({"type": "object", "properties": {"age": {"minimum": 18}}},
     "string or number keywords in a schema without a type"),
    ({"type": ["string", "null"], "format": "color"}, "format 'color'"),
    ({"type": "object", "properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
     "oneOf whose branches may overlap"),
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "object"}]},
     "oneOf whose branches may overlap"),
    ({"oneOf": [{"const": 1}, {"enum": [1.0, 2]}]}, "oneOf whose branches may overlap"),
    ({"type": "string", "maxLength": 3, "anyOf": [{"type": "string"}, {"type": "null"}]}, "keywords beside anyOf"),
    ({"type": "string", "allOf": [{"type": "string", "maxLength": 2}]}, "keywords beside allOf"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
     "keywords beside anyOf"),
])
def test_schema_keywords_the_grammar_would_ignore_are_refused(smollm2, schema, keyword):
    """xgrammar compiles these but does not enforce the keyword: outputs would break the schema and end "stop"."""
    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=rf"structured_outputs\.json uses .*{re.escape(keyword)}.*cannot enforce"):
        compiler.compile(StructuredOutputsParams(json=schema)).result()
    ok = {"type": "object", "properties": {"not": {"type": "string", "format": "email"}, "if": {"enum": [1]},
                                           "n": {"type": "integer", "multipleOf": 3, "format": "int64"}},
          "required": ["not"]}  # keywords as property names, what it enforces, a format on a number (OpenAPI's)
    compiler.compile(StructuredOutputsParams(json=ok)).result()
    pydantic_like = {"$defs": {"Color": {"enum": ["red", "blue"], "title": "Color", "type": "string"}},
                     "$ref": "#/$defs/M", "title": "M",
                     "properties": {"c": {"$ref": "#/$defs/Color", "description": "a color"},
                                    "k": {"const": 2, "type": "integer"}, "f": {"enum": [1, 2.0], "type": "number"}}}
    pydantic_like["$defs"]["M"] = {"type": "object", "properties": pydantic_like.pop("properties")}
    compiler.compile(StructuredOutputsParams(json=pydantic_like)).result()
    extensions = {"type": "object", "properties": {  # what constrains nothing beside a $ref or an enum is no reason
        "c": {"$ref": "#/$defs/Color", "x-foo": 1, "nullable": False, "type": "string"},
        "d": {"enum": ["a", "b"], "type": "string", "x-foo": 1}}, "$defs": pydantic_like["$defs"]}
    compiler.compile(StructuredOutputsParams(json=extensions)).result()
    cat = {"kind": {"const": "cat"}, "lives": {"type": "integer"}}
    tagged = {"$defs": {"Cat": {"type": "object", "properties": cat, "required": ["kind", "lives"]},
                        "Dog": {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}},
              "type": "object", "properties": {  # oneOf that cannot overlap: by type, by value, by a tag property
                  "pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                          "discriminator": {"propertyName": "kind"}},
                  "id": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
                  "size": {"oneOf": [{"const": "S"}, {"enum": ["M", "L"]}]},
                  "note": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}], "default": None},
                  "code": {"type": ["string", "null"], "format": "uuid"}}}
    compiler.compile(StructuredOutputsParams(json=tagged)).result()
    compiler.shutdown()


def test_the_text_of_the_end_token_a_grammar_ends_with_is_cut(generator):
    """With skip_special_tokens=False, as for EOS and stop tokens: also when min_tokens or ignore_eos kept the stop
    check from seeing it, and when it is the last token max_tokens allows."""
    params = constrained(0, max_tokens=10, choice=["yes", "no"]).replace(temperature=0, skip_special_tokens=False)
    for extra in ({}, {"min_tokens": 3}, {"ignore_eos": True}, {"ignore_eos": True, "max_tokens": None}):
        if extra.get("max_tokens", 0) is None:  # exactly the answer's tokens and the end token
            extra["max_tokens"] = len(out.outputs[0].token_ids)
        (out,) = generator.run([PROMPT], params.replace(**extra), use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no") and out.outputs[0].finish_reason == "stop", extra
    kept = params.replace(include_stop_str_in_output=True, ignore_eos=True)  # the grammar, not EOS, ends it
    (out,) = generator.run([PROMPT], kept, use_tqdm=False)
    end = generator.tokenizer.decode([out.outputs[0].token_ids[-1]], skip_special_tokens=False)
    assert out.outputs[0].text in ("yes" + end, "no" + end) and end  # kept, as a stop string's would be


def test_json_schemas_regexes_choices_and_grammars_always_hold(generator):
    """Temperature 1, several seeds, every constraint kind in one `run`: 100% of outputs valid, none cut short."""
    assert len(SCHEMAS) >= 30
    cases = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    params = [constrained(seed, json=schema) for schema, seed in cases]
    params += [constrained(seed, regex=regex) for regex in REGEXES for seed in SEEDS]
    params += [constrained(seed, choice=choice) for choice in CHOICES for seed in SEEDS]
    params += [constrained(seed, grammar=EBNF) for seed in SEEDS]
    params += [constrained(0, json_object=True).replace(temperature=0)]
    # Any JSON object is unbounded: a prompt that asks for a short one, greedily.
    prompts = [PROMPT] * (len(params) - 1) + [[{"role": "user", "content": OBJECT_QUESTION}]]
    outputs = generator.run(prompts, params, use_tqdm=False)
    assert all(o.error is None for o in outputs)
    texts = [o.outputs[0].text for o in outputs]
    cut = [(p.structured_outputs.key, t) for p, o, t in zip(params, outputs, texts)
           if o.outputs[0].finish_reason != "stop"]
    assert not cut
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
    schema = {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2}
    params = [constrained(seed, max_tokens=200, json=schema) for seed in range(3)]
    expected = generator.run([PROMPT] * 3, params, use_tqdm=False)
    small = ContinuousBatchGenerator(model, tokenizer, num_blocks=10)
    outputs = small.run([PROMPT] * 3, params, use_tqdm=False)
    assert small.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_a_schema_the_grammar_would_not_enforce_is_refused_when_added(generator):
    with pytest.raises(ValueError, match=r"structured_outputs\.json uses uniqueItems"):
        generator.add_request(PROMPT, constrained(0, json={"type": "array", "uniqueItems": True}))
    assert not generator.has_unfinished_requests()


AMBIGUOUS = "((a{0,60}){0,60}){0,60}"  # its grammar work per token grows several-fold with every "a"
NO_END = {0: -100.0, 1: -100.0, 2: -100.0}  # SmolLM2's special tokens: the output keeps growing


def test_a_grammar_too_slow_for_one_token_fails_its_request_alone(generator, monkeypatch):
    """An ambiguous constraint took seconds, then minutes, per token on the engine thread, stalling every request;
    past `GrammarMatcher.max_seconds_per_token` it fails, and the others go on."""
    monkeypatch.setattr(GrammarMatcher, "max_seconds_per_token", 0.02)
    hostile = constrained(0, max_tokens=30, regex=AMBIGUOUS).replace(temperature=0, logit_bias=NO_END)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    bad, good = generator.run([PROMPT, PROMPT], [hostile, free], use_tqdm=False)
    assert bad.error.startswith("SamplingParams.structured_outputs took") and "grammar work" in bad.error
    assert 0 < len(bad.outputs[0].token_ids) < 30 and bad.outputs[0].finish_reason == "abort"
    assert good.error is None and len(good.outputs[0].token_ids) == 20
    assert_no_leak(generator.scheduler)


def test_the_grammar_time_limit_counts_the_engine_threads_own_work_only(smollm2, monkeypatch):
    """Waiting is not work: a large response's ``json.dumps`` on another thread held the interpreter lock for a third
    of a second and a trivial grammar's token, timed by the wall clock, was failed. Here each bitmask fill waits
    0.1 s (a sleep, as a wait for the lock or a core) against a limit of 0.05 s."""
    monkeypatch.setattr(GrammarMatcher, "max_seconds_per_token", 0.05)
    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputsParams(json_object=True)).result()

    class Waiting:
        def __init__(self, matcher):
            self.matcher = matcher

        def fill_next_token_bitmask(self, *args):
            time.sleep(0.1)
            return self.matcher.fill_next_token_bitmask(*args)

        def __getattr__(self, name):
            return getattr(self.matcher, name)

    matcher = GrammarMatcher.of(grammar)
    matcher._matcher = Waiting(matcher._matcher)
    for token in tokenizer('{"a": [1, 2]}', add_special_tokens=False).input_ids:
        fill_bitmask([matcher], [0], 1)
        assert matcher.advance(token)  # raised GrammarTooSlow when the wait counted
    compiler.shutdown()


def test_the_draws_of_one_matcher_fill_its_row_once(smollm2):
    """A prompt's ``n`` draws share its matcher: filled n times, its time counted n times toward the limit."""
    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, 49152, [tokenizer.eos_token_id])
    matcher = GrammarMatcher.of(compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).result())
    fills, fill = [], matcher._matcher.fill_next_token_bitmask
    matcher._matcher = type("Counting", (), {"fill_next_token_bitmask": lambda self, *a: fills.append(fill(*a))})()
    bitmask = fill_bitmask([matcher, matcher, matcher], [0, 2, 3], 4)
    assert len(fills) == 1 and (bitmask[0] == bitmask[2]).all() and (bitmask[0] == bitmask[3]).all()
    assert (bitmask[1] == -1).all() and not (bitmask[0] == -1).all()  # row 1 free, row 0 constrained
    compiler.shutdown()


def test_a_rolled_back_step_forgets_its_grammar_time(generator, monkeypatch):
    """The retried step fills the same bitmask again: the failed step's work must not count toward the limit."""
    from hf_paged.generation import model_runner as runner_module

    def failing_sample(*args):
        raise RuntimeError("injected after the bitmask was filled")

    generator.add_request(PROMPT, constrained(0, json=PERSON), request_id="timed")
    generator.step()
    seq = generator.requests["timed"].seqs[0]
    while seq.num_output_tokens == 0:
        generator.step()  # its grammar compiles, then its prompt runs: it has a matcher
    monkeypatch.setattr(runner_module, "sample", failing_sample)
    with pytest.raises(RuntimeError, match="injected"):
        generator.step()
    assert seq.matcher.spent == 0.0
    monkeypatch.undo()
    while generator.has_unfinished_requests():
        generator.step()


def test_a_grammar_that_does_not_compile_fails_only_its_request(generator):
    good, bad = generator.run([PROMPT, PROMPT], [constrained(0, json=PERSON), constrained(0, regex="(unclosed")],
                              use_tqdm=False)
    assert good.error is None and good.outputs[0].finish_reason == "stop"
    assert bad.finished and "structured_outputs.regex is invalid" in bad.error
    assert not generator.has_unfinished_requests() and generator.kv_manager.pool.num_used_blocks == 0


def test_a_failed_step_leaves_the_matchers_as_they_were(generator, monkeypatch):
    """Matchers advance only in `Scheduler.update`, after the step can no longer fail: a step that raises and is
    rolled back leaves them untouched, and the retried run samples the same tokens as one that never failed."""
    params = [constrained(seed, json=PERSON) for seed in range(3)]
    expected = generator.run([PROMPT] * 3, params, use_tqdm=False)
    execute, calls = generator.runner.execute, []

    def fail_the_fifth_step(out):
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected failure")
        return execute(out)

    monkeypatch.setattr(generator.runner, "execute", fail_the_fifth_step)
    for request_id, p in zip("abc", params):
        generator.add_request(PROMPT, p, request_id=request_id)
    with pytest.raises(RuntimeError, match="injected"):
        while generator.has_unfinished_requests():
            generator.step()
    outputs = {}
    while generator.has_unfinished_requests():
        for output in generator.step():
            outputs[output.request_id] = output.outputs[0].token_ids  # cumulative outputs: the last is all
    assert len(calls) > 5
    assert [outputs[r] for r in "abc"] == [o.outputs[0].token_ids for o in expected]


def test_a_request_waits_for_its_grammar_without_stalling_the_batch(generator, monkeypatch):
    release = threading.Event()
    compile_grammar = generator.grammars._compile
    monkeypatch.setattr(generator.grammars, "_compile", lambda spec: release.wait(30) and compile_grammar(spec))
    slow = generator.add_request(PROMPT, constrained(0, json={"type": "object", "properties": {"slow": AGE},
                                                               "required": ["slow"]}))
    free = generator.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    finished = []
    while free not in finished:
        finished += [o.request_id for o in generator.step() if o.finished]
    assert slow not in finished and generator.scheduler.compiling  # the free request ran to its end meanwhile
    assert (generator.stats().num_waiting, generator.stats().num_running) == (1, 0)  # it waits, for its grammar
    release.set()
    while slow not in finished:
        for output in generator.step():
            text = output.outputs[0].text  # cumulative outputs: the last is all
            finished += [output.request_id] if output.finished else []
    assert 0 <= json.loads(text)["slow"] <= 120


def test_a_forked_matcher_goes_its_own_way(generator):
    grammar = generator.grammars.compile(StructuredOutputsParams(choice=["yes", "no"])).result()
    matcher = GrammarMatcher.of(grammar)
    tokenizer = generator.tokenizer
    [y, *rest] = tokenizer("yes", add_special_tokens=False).input_ids
    no = tokenizer("no", add_special_tokens=False).input_ids[0]
    twin = matcher.fork()
    assert matcher.accept(y) and not matcher.accept(no)
    assert twin.accept(no)  # still at the start
    assert all(matcher.accept(t) for t in rest) and matcher.advance(tokenizer.eos_token_id) is False
    assert matcher.is_terminated() and not twin.is_terminated()


def test_the_scheduler_keeps_compiling_requests_out_of_the_batch():
    """Model-free: a request whose grammar compiles is never scheduled, one whose grammar failed fails alone, and one
    aborted while compiling leaves no trace."""
    scheduler = make_scheduler()
    compiling, broken = Future(), Future()
    pending, bad, free = make_request("p", [5, 6, 7]), make_request("b", [5, 6]), make_request("f", [8, 9, 10])
    pending.grammar, bad.grammar = compiling, broken
    for request in (pending, bad, free):
        scheduler.add(request)
    assert scheduler.admit_compiled() == []
    out, _ = step(scheduler)
    assert [seq.request for seq in out.seqs] == [free]
    broken.set_exception(ValueError("SamplingParams.structured_outputs.regex is invalid: unclosed"))
    assert scheduler.admit_compiled() == [bad]
    assert "regex is invalid" in bad.error and bad.seqs[0].finish_reason == "abort"
    scheduler.abort(pending)
    assert not scheduler.compiling
    run_to_end(scheduler, [])
    assert free.is_finished and not pending.seqs[0].num_computed_tokens
    assert_no_leak(scheduler)


def test_a_compile_nobody_waits_for_is_cancelled_and_compiled_again_when_asked(smollm2):
    """Aborting the last request that waits for a queued compile cancels it (a client sending many grammars and
    leaving would otherwise hold the compile thread); the cache then compiles that constraint afresh."""
    scheduler = make_scheduler()
    queued = Future()
    first, second = make_request("a", [5, 6]), make_request("b", [7, 8])
    first.grammar = second.grammar = queued
    scheduler.add(first)
    scheduler.add(second)
    scheduler.abort(first)
    assert not queued.cancelled()  # the other request still waits for it
    scheduler.abort(second)
    assert queued.cancelled() and not scheduler.compiling
    _, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    release = threading.Event()
    busy = compiler._pool.submit(release.wait, 30)  # the compile thread is taken
    spec = StructuredOutputsParams(choice=["yes", "no"])
    assert compiler.compile(spec).cancel()
    again = compiler.compile(spec)
    assert not again.cancelled()
    release.set()
    assert busy.result() and again.result(timeout=60) is not None
    compiler.shutdown()


def test_a_request_asking_for_a_compile_its_other_waiters_cancel_gets_it_compiled(generator):
    """B takes the queued compile A waits for; A is aborted (cancelling it) before B reaches the scheduler: B's
    compile is asked again, and B is served (it raised CancelledError out of step and was stranded)."""
    release = threading.Event()
    busy = generator.grammars._pool.submit(release.wait, 30)  # the compile thread is taken
    spec = dict(choice=["yes", "no", "maybe so"])
    first = generator.add_request(PROMPT, constrained(0, max_tokens=8, **spec))
    generator.step()
    generator.abort_request(first)
    second = generator.add_request(PROMPT, constrained(1, max_tokens=8, **spec))
    finals = {o.request_id: o for o in generator.step() if o.finished}
    release.set()
    assert busy.result(timeout=30)
    while generator.has_unfinished_requests():
        finals |= {o.request_id: o for o in generator.step() if o.finished}
    assert finals[first].outputs[0].finish_reason == "abort" and finals[second].error is None
    assert finals[second].outputs[0].text in ("yes", "no", "maybe so")
