"""Reasoning parsers (``--reasoning-parser``): a thinking model's reasoning answered apart from its content."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")  # the server extra, which the README's test command installs (.[test])

from live_server import MODEL, live_server, tiny_generator, tiny_model  # noqa: E402

from hf_paged import ContinuousBatchGenerator, SamplingParams, StructuredOutputsParams  # noqa: E402
from hf_paged.reasoning import CLOSE, OPEN, ReasoningParser  # noqa: E402
from hf_paged.server import create_app  # noqa: E402

OPENS_THE_BLOCK = "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("prompt, answer, expected", [
    (OPENS_THE_BLOCK, "plan it</think>\n\nDone.", ("plan it", "\n\nDone.")),
    (OPENS_THE_BLOCK, "<think>plan</think>Done.", ("plan", "Done.")),  # the answer's own tag is no reasoning
    (OPENS_THE_BLOCK, "still thinking", ("still thinking", None)),  # never closed: all reasoning
    (OPENS_THE_BLOCK, "plan it</think>", ("plan it", None)),
    ("<|im_start|>assistant\n", "  <think>plan</think>Done.", ("plan", "Done.")),  # the model opens it
    ("<|im_start|>assistant\n", "Done. <think>late</think>", (None, "Done. <think>late</think>")),
    ("<|im_start|>assistant\n", "", (None, "")),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Done.", (None, "Done.")),  # thinking turned off
    ("<think>old</think> then <|im_start|>assistant\n<think>", "a</think>b", ("a", "b")),
    # A message that quotes the tag does not open a block: only the prompt's end does.
    ("<|im_start|>user\nUse <think> tags<|im_end|>\n<|im_start|>assistant\n", "Sure.", (None, "Sure.")),
    ("<|im_start|>assistant\n", " <think>", ("", None)),  # opened, then cut
    # Qwen3.5 may call a tool without closing its block: the call (Qwen3-Coder's XML) ends the reasoning, as vLLM's.
    (OPENS_THE_BLOCK, "Call it.\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
     ("Call it.\n\n", "<tool_call>\n<function=f>\n</function>\n</tool_call>")),
    (OPENS_THE_BLOCK, 'a <tool_call>{"name": "f"}</tool_call></think>b', ('a <tool_call>{"name": "f"}</tool_call>', "b")),
])
def test_a_whole_answer_splits_by_its_prompt_and_tags(prompt, answer, expected):
    assert ReasoningParser(prompt).split(answer) == expected


@pytest.mark.parametrize("prompt, answer, expected", [
    ("<|im_start|>assistant\n", "Let me plan</think> The answer is 4", ("Let me plan", " The answer is 4")),
    ("<|im_start|>assistant\n", "Done.", ("Done.", None)),  # never closed: all reasoning
    ("<|im_start|>assistant\n", "  <think>plan</think>Done.", ("plan", "Done.")),
    (OPENS_THE_BLOCK, "plan</think>Done.", ("plan", "Done.")),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Done.", (None, "Done.")),  # the prompt closed it
])
def test_deepseek_r1_reasons_until_the_block_closes_as_vllms(prompt, answer, expected):
    """vLLM's deepseek_r1: DeepSeek-R1 may leave its <think> out, so an answer reasons until </think>."""
    assert ReasoningParser(prompt, "deepseek_r1").split(answer) == expected


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_a_continued_message_is_inside_the_block_it_opened(parser):
    prompt = "<|im_start|>assistant\n<think>\nI will"
    assert ReasoningParser(prompt, parser, continued="<think>\nI will").split(" plan it</think> The answer is 4") \
        == (" plan it", " The answer is 4")
    assert ReasoningParser(prompt + "</think>ok", parser, continued="<think>\nI will</think>ok").split(" then") == \
        (None, " then")


PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", "ink>", "a", " ", "\n", "Done.", "<tool_call>",
          "<tool", "_call>", "<function=", "<func", "tion="]


@settings(max_examples=400, deadline=None)
@given(st.booleans(), st.sampled_from(["qwen3", "deepseek_r1"]), st.lists(st.sampled_from(PIECES), max_size=8),
       st.integers(1, 9))
def test_any_answer_streams_as_its_whole_answer_splits(inside, name, pieces, step):
    parser = ReasoningParser(OPENS_THE_BLOCK if inside else "", name)
    text = "".join(pieces)
    stream, reasoning, content = parser.stream(), "", ""
    for start in range(0, len(text), step):
        more_reasoning, more_content = stream.feed(text[start:start + step])
        reasoning, content = reasoning + more_reasoning, content + more_content
    rest_reasoning, rest_content = stream.finish()
    whole_reasoning, whole_content = parser.split(text)
    assert (reasoning + rest_reasoning, content + rest_content) == (whole_reasoning or "", whole_content or "")


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def thinking_model(smollm2_path):
    """`tiny_model` with a thinking template, whose tokenizer holds <think> and </think> as tokens (as Qwen3's and
    DeepSeek-R1's do)."""
    model, tokenizer = tiny_model(smollm2_path)
    tokenizer.add_tokens([OPEN, CLOSE])
    model.resize_token_embeddings(len(tokenizer))
    tokenizer.chat_template = THINKING_TEMPLATE
    return model, tokenizer


@pytest.fixture(scope="module")
def thinking_server(smollm2_path):
    generator = ContinuousBatchGenerator(*thinking_model(smollm2_path), num_blocks=256, reasoning_parser="deepseek_r1")
    with live_server(create_app(generator, MODEL)) as live:
        live.close_id = generator.tokenizer.convert_tokens_to_ids(CLOSE)
        yield live


def _replies(client, asked: dict) -> tuple[dict, dict]:
    """The reply's reasoning and content fields, and those of the same request streamed (joined)."""
    message = client.chat.completions.create(**asked).choices[0].message
    whole = {field: getattr(message, field, None) for field in ("reasoning", "reasoning_content", "content")}
    streamed = dict.fromkeys(whole, "")
    for chunk in client.chat.completions.create(**asked, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for field in streamed:
            streamed[field] += getattr(delta, field, None) or ""
    return whole, streamed


def test_replies_carry_their_reasoning_apart_streamed_or_not(thinking_server):
    import openai

    client = openai.OpenAI(base_url=f"{thinking_server.base}/v1", api_key="none", max_retries=0, timeout=60)
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=6)
    # The random model never closes the block: all reasoning.
    whole, streamed = _replies(client, asked)
    assert whole["content"] is None and whole["reasoning"] and whole["reasoning_content"] == whole["reasoning"]
    assert streamed == {**whole, "content": ""}
    left_out, streamed = _replies(client, {**asked, "extra_body": {"include_reasoning": False}})
    assert left_out == {"reasoning": None, "reasoning_content": None, "content": None}
    assert streamed == {"reasoning": "", "reasoning_content": "", "content": ""}
    # The block closed (its token pushed first): the constraint holds from there, in the content.
    closing = {**asked, "max_tokens": 12, "logit_bias": {str(thinking_server.close_id): 100},
               "extra_body": {"structured_outputs": {"regex": "[a-z]{2,6}"}}}
    whole, streamed = _replies(client, closing)
    assert whole["reasoning"] == "" and re.fullmatch("[a-z]{2,6}", whole["content"])
    assert streamed == {**whole, "reasoning": ""}
    # Thinking turned off in the template: the block is closed in the prompt, the constraint holds from the first
    # token (which the pushed </think> is not) and the whole answer is content.
    thinking_off = {**closing["extra_body"], "chat_template_kwargs": {"enable_thinking": False}}
    off = client.chat.completions.create(**{**closing, "extra_body": thinking_off})
    assert re.fullmatch("[a-z]{2,6}", off.choices[0].message.content)
    assert getattr(off.choices[0].message, "reasoning", None) is None
    # JSON constraints too start after the reasoning: the JSON is the content, and calls are read from it.
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": tools, "tool_choice": "required"}):
        answer = client.chat.completions.create(**{**closing, "extra_body": {}, "max_tokens": 24, **extra})
        message = answer.choices[0].message
        assert message.reasoning == ""
        assert message.tool_calls if "tools" in extra else message.content.startswith("{")
    # A reply that continues an assistant message is inside a block that message opened and did not close, and
    # after one it closed.
    for text, expected in (("<think>\nI will", ("", "</think>")), ("<think>\nplan</think>The", (None, "</think>" * 2))):
        continued = {**closing, "extra_body": {"continue_final_message": True, "add_generation_prompt": False},
                     "max_tokens": 2, "messages": asked["messages"] + [{"role": "assistant", "content": text}]}
        whole, streamed = _replies(client, continued)
        assert (whole["reasoning"], whole["content"]) == expected


def test_a_response_answers_the_reasoning_as_its_own_item(thinking_server):
    import openai

    client = openai.OpenAI(base_url=f"{thinking_server.base}/v1", api_key="none", max_retries=0, timeout=60)
    asked = dict(model=MODEL, input="Hi", temperature=0, max_output_tokens=6)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                          max_tokens=6).choices[0].message
    response = client.responses.create(**asked)
    [item] = response.output  # never closed: all reasoning, cut by max_output_tokens
    assert item.type == "reasoning" and item.content[0].text == chat.reasoning and item.status == "incomplete"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    events = list(client.responses.create(**asked, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == chat.reasoning
    assert [item.type for item in events[-1].response.output] == ["reasoning"]
    # Left out of the answer (vLLM's include_reasoning: false), the reasoning is still counted as the model wrote it.
    hidden = {**asked, "extra_body": {"include_reasoning": False}}
    for answer in (client.responses.create(**hidden), list(client.responses.create(**hidden, stream=True))[-1].response):
        assert answer.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens_details.reasoning_tokens
    closing = {**asked, "max_output_tokens": 12, "extra_body": {"logit_bias": {str(thinking_server.close_id): 100}},
               "text": {"format": {"type": "json_object"}}}
    [message] = client.responses.create(**closing).output  # the block closed at once: no reasoning to answer
    assert message.type == "message" and message.content[0].text.startswith("{")


def test_a_constraint_starts_when_the_reasoning_block_ends(smollm2_path):
    """A prompt that opens the block reasons first; one that closed it is constrained at once; one with neither lets
    the first token open a block (then reasons first) or follow the grammar."""
    model, tokenizer = thinking_model(smollm2_path)
    opening, closing = tokenizer.convert_tokens_to_ids([OPEN, CLOSE])
    choice = StructuredOutputsParams(choice=["yes", "no"])
    closes = SamplingParams(temperature=0, max_tokens=8, logit_bias={closing: 100}, structured_outputs=choice)
    prompts = ["<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n",
               "<|im_start|>assistant\n"]
    generator = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, reasoning_parser="qwen3")
    thinking, off, free = [output.outputs[0].text for output in generator.run(prompts, closes)]
    assert thinking in ("</think>yes", "</think>no") and off in ("yes", "no") and free in ("yes", "no")
    # The first token opens a block (pushed above the rest, and above </think> until the repetition penalty halves it).
    opens = SamplingParams(temperature=0, max_tokens=8, logit_bias={opening: 100, closing: 90}, repetition_penalty=2,
                           structured_outputs=choice)
    [free] = [output.outputs[0].text for output in generator.run(prompts[2:], opens)]
    assert free in ("<think></think>yes", "<think></think>no")
    # Under deepseek_r1 (vLLM's), a prompt that did not close the block reasons first: DeepSeek-R1 may leave <think> out.
    r1 = ContinuousBatchGenerator(model, tokenizer, num_blocks=64, reasoning_parser="deepseek_r1")
    thinking, off, plain = [output.outputs[0].text for output in r1.run(prompts, closes)]
    assert thinking in ("</think>yes", "</think>no") and off in ("yes", "no") and plain in ("</think>yes", "</think>no")
    without = ContinuousBatchGenerator(model, tokenizer, num_blocks=64)
    assert all(output.outputs[0].text in ("yes", "no") for output in without.run(prompts, closes))
    assert without.run(prompts[2:], opens)[0].outputs[0].text in ("yes", "no")


def test_an_unknown_reasoning_parser_is_refused(smollm2_path, capsys):
    from hf_paged.cli import main

    with pytest.raises(ValueError, match="reasoning_parser is one of deepseek_r1, qwen3, got 'granite'"):
        tiny_generator(smollm2_path, num_blocks=16, reasoning_parser="granite")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", smollm2_path, "--reasoning-parser", "granite", "--port", "0"])
    assert exit_info.value.code == 2 and "reasoning_parser is one of deepseek_r1, qwen3" in capsys.readouterr().err


def test_tool_calls_are_read_from_the_content_after_the_reasoning():
    from hf_paged.generation import CompletionOutput
    from hf_paged.server.protocol import ToolChatFormat
    from hf_paged.server.tool_calls import ToolCallParser

    text = 'call <tool_call> later</think><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    fmt = ToolChatFormat(None, None, ToolCallParser("auto"), ReasoningParser(OPENS_THE_BLOCK))
    choice = fmt.choice(0, CompletionOutput(0, text, [], "stop"))
    message = choice["message"]
    assert message["reasoning"] == "call <tool_call> later" and message["content"] is None
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_time"]
    assert choice["finish_reason"] == "tool_calls"
    reasoning, calls = "", []
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        sent = fmt.chunk_choice(0, piece, [], None, 0, "stop" if last else None)
        if sent is not None:
            reasoning += sent["delta"].get("reasoning", "")
            calls += sent["delta"].get("tool_calls", [])
            assert "content" not in sent["delta"]
    assert reasoning == "call <tool_call> later" and [c["function"]["name"] for c in calls] == ["get_time"]
    assert sent["finish_reason"] == "tool_calls"


def test_the_scheduler_starts_a_grammar_after_the_tokens_that_close_the_block(smollm2_path):
    """Model-free, SmolLM2's tokenizer (where </think> is three tokens): a request whose prompt opens the block is
    unconstrained until the tag's tokens come, then its grammar takes the tokens after them; one whose prompt does
    not is constrained from its first token."""
    from test_scheduler import assert_no_leak, step
    from transformers import AutoTokenizer

    from hf_paged.cache import BlockPool, KVCacheManager
    from hf_paged.generation.config import EngineConfig
    from hf_paged.generation.detokenizer import Detokenizer
    from hf_paged.generation.sampler import build_sampling_batch
    from hf_paged.generation.scheduler import Scheduler
    from hf_paged.generation.sequence import Request
    from hf_paged.generation.structured_outputs import GrammarCompiler

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    config = EngineConfig(block_size=4, max_num_batched_tokens=2048, reasoning_parser="qwen3")
    scheduler = Scheduler(config, KVCacheManager(BlockPool(64, 4), True), Detokenizer(tokenizer), 256)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputsParams(choice=["yes", "no"]))
    grammar.result(timeout=60)

    def ids(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    # The tag spelled with other tokens than its own (" </think>" is 'Ġ</', 'think', '>') closes the block too.
    answers = {"thinking": ids("plan it </think>") + ids("yes") + [tokenizer.eos_token_id],
               "direct": ids("no") + [tokenizer.eos_token_id]}
    requests = [Request(name, None, ids(prompt), SamplingParams(temperature=0, max_tokens=20), seed=0,
                        eos_token_ids=frozenset({tokenizer.eos_token_id}), grammar=grammar)
                for name, prompt in (("thinking", OPENS_THE_BLOCK), ("direct", "<|im_start|>assistant\n"))]
    for request in requests:
        scheduler.add(request)
    assert scheduler.admit_compiled() == []
    thinking, direct = (request.seqs[0] for request in requests)
    assert thinking.matcher is None and thinking.in_reasoning and direct.matcher is not None
    closed_at = len(ids("plan it </think>"))
    while scheduler.has_work():
        constrained = [seq for seq in (thinking, direct) if not seq.is_finished and seq.matcher is not None]
        draws = [(seq, 0) for seq in (thinking, direct) if not seq.is_finished]
        masked = build_sampling_batch(draws, torch.device("cpu")).token_bitmask
        assert [draws[row][0] for row in (masked[1] if masked else [])] == constrained
        assert (thinking.matcher is None) == (thinking.num_output_tokens < closed_at)
        step(scheduler, lambda seq, k: answers[seq.request.request_id][seq.num_output_tokens])
    assert thinking.text == "plan it </think>yes" and direct.text == "no"
    assert thinking.finish_reason == direct.finish_reason == "stop"
    assert_no_leak(scheduler)
    compiler.shutdown()


def _scripted(tokenizer, prompt: str, answer: list[int], choice: list[str], **params):
    """A scheduler with a reasoning parser running one constrained request whose tokens are ``answer``."""
    from test_scheduler import assert_no_leak, step

    from hf_paged.cache import BlockPool, KVCacheManager
    from hf_paged.generation.config import EngineConfig
    from hf_paged.generation.detokenizer import Detokenizer
    from hf_paged.generation.scheduler import Scheduler
    from hf_paged.generation.sequence import Request
    from hf_paged.generation.structured_outputs import GrammarCompiler

    config = EngineConfig(block_size=4, max_num_batched_tokens=2048, reasoning_parser="qwen3")
    scheduler = Scheduler(config, KVCacheManager(BlockPool(64, 4), True), Detokenizer(tokenizer), 256)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammar = compiler.compile(StructuredOutputsParams(choice=choice))
    grammar.result(timeout=60)
    request = Request("r", None, tokenizer(prompt, add_special_tokens=False).input_ids,
                      SamplingParams(temperature=0, max_tokens=20, **params), seed=0,
                      eos_token_ids=frozenset({tokenizer.eos_token_id}), grammar=grammar)
    scheduler.add(request)
    scheduler.admit_compiled()
    while scheduler.has_work():
        step(scheduler, lambda seq, k: answer[seq.num_output_tokens])
    assert_no_leak(scheduler)
    compiler.shutdown()
    return request


def test_the_block_ends_at_its_token_even_when_special_tokens_leave_the_text(smollm2_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.add_tokens([OPEN, CLOSE], special_tokens=True)  # skipped from the text by default
    answer = [*tokenizer("plan it", add_special_tokens=False).input_ids, tokenizer.convert_tokens_to_ids(CLOSE),
              *tokenizer("yes", add_special_tokens=False).input_ids, tokenizer.eos_token_id]
    request = _scripted(tokenizer, OPENS_THE_BLOCK, answer, ["yes", "no"])
    seq = request.seqs[0]
    assert request.error is None and seq.text == "plan ityes" and seq.finish_reason == "stop"
    assert not seq.in_reasoning and seq.matcher is not None and seq.matcher.is_terminated()  # "yes" was constrained


def test_text_carried_after_the_tag_by_its_last_token_is_held_to_the_constraint(smollm2_path):
    """SmolLM2 has a token '>"': closing the block with it writes a quote the grammar must allow."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)

    def ids(text):
        return tokenizer(text, add_special_tokens=False).input_ids

    answer = ids("plan it </") + ids("think") + [tokenizer.convert_tokens_to_ids('>"')] + ids('yes"') + \
        [tokenizer.eos_token_id]
    quoted = _scripted(tokenizer, OPENS_THE_BLOCK, answer, ['"yes"', '"no"'])
    assert quoted.error is None and quoted.seqs[0].text == 'plan it </think>"yes"'
    bare = _scripted(tokenizer, OPENS_THE_BLOCK, answer, ["yes", "no"])
    assert bare.error_param == "structured_outputs" and "carried '\"' after </think>" in bare.error
