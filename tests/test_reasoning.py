"""Reasoning parsers (``--reasoning-parser``): a thinking model's reasoning answered apart from its content."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")  # the server extra, which the README's test command installs (.[test])

from live_server import MODEL, live_server, tiny_generator  # noqa: E402

from hf_paged.server import create_app  # noqa: E402
from hf_paged.server.reasoning import ReasoningParser  # noqa: E402

OPENS_THE_BLOCK = "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("prompt, answer, expected", [
    (OPENS_THE_BLOCK, "plan it</think>\n\nDone.", ("plan it", "\n\nDone.")),
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
])
def test_a_whole_answer_splits_by_its_prompt_and_tags(prompt, answer, expected):
    assert ReasoningParser(prompt).split(answer) == expected


PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", "ink>", "a", " ", "\n", "Done."]


@settings(max_examples=400, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(PIECES), max_size=8), st.integers(1, 9))
def test_any_answer_streams_as_its_whole_answer_splits(inside, pieces, step):
    parser = ReasoningParser(OPENS_THE_BLOCK if inside else "")
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


@pytest.fixture(scope="module")
def thinking_server(smollm2_path):
    generator = tiny_generator(smollm2_path)
    generator.tokenizer = copy.deepcopy(generator.tokenizer)
    generator.tokenizer.chat_template = THINKING_TEMPLATE
    generator.inputs.tokenizer = generator.tokenizer
    with live_server(create_app(generator, MODEL, reasoning_parser="deepseek_r1")) as live:
        yield live


def test_replies_carry_their_reasoning_apart_streamed_or_not(thinking_server):
    import openai

    client = openai.OpenAI(base_url=f"{thinking_server.base}/v1", api_key="none", max_retries=0, timeout=60)
    asked = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=40,
                 extra_body={"structured_outputs": {"regex": "[a-z]{3,8}</think>[a-z]{2,6}"}})
    message = client.chat.completions.create(**asked).choices[0].message
    reasoning, content = message.reasoning, message.content
    assert message.reasoning_content == reasoning and 3 <= len(reasoning) <= 8 and reasoning.isalpha()
    assert 2 <= len(content) <= 6 and content.isalpha()
    streamed = {"reasoning": "", "reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**asked, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        for field in streamed:
            streamed[field] += getattr(delta, field, None) or ""
    assert streamed == {"reasoning": reasoning, "reasoning_content": reasoning, "content": content}
    # Thinking turned off in the template: the block is closed in the prompt, the whole answer is content.
    off = client.chat.completions.create(**{**asked, "extra_body": {**asked["extra_body"],
                                                                   "chat_template_kwargs": {"enable_thinking": False}}})
    assert re.fullmatch("[a-z]{3,8}</think>[a-z]{2,6}", off.choices[0].message.content)
    assert getattr(off.choices[0].message, "reasoning", None) is None
    # Cut before the block closes: all reasoning.
    cut = client.chat.completions.create(**{**asked, "max_tokens": 2}).choices[0].message
    assert cut.content is None and cut.reasoning and reasoning.startswith(cut.reasoning)
    # A JSON constraint holds from the first token: the answer is all content, and calls are read from it.
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    for extra in ({"response_format": {"type": "json_object"}}, {"tools": tools, "tool_choice": "required"}):
        answer = client.chat.completions.create(**{**asked, "extra_body": {}, "max_tokens": 24, **extra})
        message = answer.choices[0].message
        assert getattr(message, "reasoning", None) is None
        assert message.tool_calls if "tools" in extra else message.content.startswith("{")


def test_an_unknown_reasoning_parser_is_refused(smollm2_path, capsys):
    from hf_paged.cli import main

    with pytest.raises(ValueError, match="reasoning_parser"):
        create_app(tiny_generator(smollm2_path, num_blocks=16), MODEL, reasoning_parser="granite")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", smollm2_path, "--reasoning-parser", "granite", "--port", "0"])
    assert exit_info.value.code == 2 and "--reasoning-parser: one of deepseek_r1, qwen3" in capsys.readouterr().err


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
