"""Reasoning blocks: a thinking model's reasoning, between ``<think>`` and ``</think>``, before its answer's content.

With a reasoning parser (``EngineConfig.reasoning_parser``, vLLM's ``--reasoning-parser``) the server answers the
reasoning apart from the content (`ReasoningParser`), and the engine starts a request's structured output after the
block (`ReasoningEnd`), so a thinking model thinks freely and then answers in the constrained form.

Whether an answer starts inside the reasoning is read from the end of its prompt: templates that open the block
themselves (DeepSeek-R1's, Qwen3's newer ones) end the prompt with ``<think>``; Qwen3's with ``enable_thinking=False``
end it with an empty, closed block, and others with no tag. Under ``qwen3`` an answer to another prompt that opens
with ``<think>`` (after blank space) reasons until ``</think>``, and one that does not is content; under
``deepseek_r1``, as vLLM's, an answer reasons until ``</think>`` unless its prompt closed the block (DeepSeek-R1 may
leave its ``<think>`` out). A message continued (``continue_final_message``) is inside a block it opened and did not
close. An answer's own leading ``<think>`` is no part of its reasoning; one that never closes its block is all
reasoning. Qwen3.5 may call a tool without closing its block: a ``<tool_call>`` that opens Qwen3-Coder's XML
(``<function=``) ends the reasoning too, as in vLLM, and the call is content.
"""

from __future__ import annotations

import re

from .chat_template import OPEN_TAG as _CALL

OPEN, CLOSE = "<think>", "</think>"
_FUNCTION = "<function="  # how Qwen3-Coder's XML call begins
_CALL_SPACE = 16  # at most this much whitespace between the two (Qwen3.5 writes one newline): what is held is bounded
_CALL_ENDS_REASONING = re.compile(re.escape(_CALL) + r"\s{0,%d}" % _CALL_SPACE + re.escape(_FUNCTION))
PARSERS = ("deepseek_r1", "qwen3")


def opens_reasoning(prompt: str, parser: str = "qwen3", continued: str | None = None) -> bool:
    """Whether an answer to ``prompt`` starts inside a reasoning block: the prompt ends by opening one (not a tag
    that a message quotes), or under ``deepseek_r1`` does not end by closing one; ``continued`` (the final message's
    text, which the answer continues) decides where it has a tag."""
    if continued is not None and (OPEN in continued or CLOSE in continued):
        return continued.rfind(OPEN) > continued.rfind(CLOSE)
    end = prompt.rstrip()
    return not end.endswith(CLOSE) if parser == "deepseek_r1" else end.endswith(OPEN)


class ReasoningEnd:
    """The engine's side: where a constrained request's grammar starts when a reasoning parser is set.

    A prompt that opens the block (ends with ``<think>``) reasons first: the grammar starts once the output holds
    ``</think>`` (its token, where it is one, even when special tokens are left out of the text; else its text),
    after the token that completes it, from any text that token carries after the tag. A prompt that closed one
    (thinking turned off) is constrained from its first token. Any other prompt leaves the model free to open the
    block with its first token (Qwen3's hybrid templates let the model decide): that token is allowed beside the
    grammar's, and taking it makes the request reason first. That needs ``<think>`` to be one token, as in Qwen3's
    and DeepSeek-R1's tokenizers; elsewhere such a prompt is constrained from its first token.
    """

    def __init__(self, tokenizer, parser: str = "qwen3"):
        self.tokenizer, self.parser = tokenizer, parser
        self.open_id, self.close_id = _one_token(tokenizer, OPEN), _one_token(tokenizer, CLOSE)

    def start(self, prompt_token_ids: list[int]) -> str:
        """``"inside"`` (the prompt opens the block, or under ``deepseek_r1`` did not close one), ``"may_open"`` (the
        first token may open one) or ``"after"`` (constrained from the first token)."""
        end = self.tokenizer.decode(prompt_token_ids[-16:]).rstrip()
        if opens_reasoning(end, self.parser):
            return "inside"
        return "after" if end.endswith(CLOSE) or self.open_id is None else "may_open"

    def ended(self, token: int, text: str, num_new_chars: int) -> bool:
        """Whether ``token``, whose text is the newest ``num_new_chars`` of an output's ``text``, ends the block."""
        return token == self.close_id or CLOSE in text[max(0, len(text) - num_new_chars - len(CLOSE) + 1):]

    @staticmethod
    def after(text: str) -> str:
        """The text of an output after the tag that ended its block (what the token that ended it carried)."""
        end = text.rfind(CLOSE)
        return text[end + len(CLOSE):] if end >= 0 else ""


def _one_token(tokenizer, tag: str) -> int | None:
    """The token that spells ``tag``, where one does."""
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _partial_call(text: str) -> int:
    """Length of the end of ``text`` that may yet become a call that ends the reasoning (`_CALL_ENDS_REASONING`)."""
    start = text.rfind(_CALL, max(0, len(text) - len(_CALL) - _CALL_SPACE - len(_FUNCTION)))
    after = text[start + len(_CALL):] if start >= 0 else ""
    if start >= 0 and len(after) - len(after.lstrip()) <= _CALL_SPACE and _FUNCTION.startswith(after.lstrip()):
        return len(text) - start
    return partial_tag(text, _CALL)


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``: held back from a stream until it is decided."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """Splits the answers to one prompt; `split` reads a whole answer, `stream` one that comes in pieces."""

    def __init__(self, prompt: str, parser: str = "qwen3", continued: str | None = None):
        self.starts_inside = opens_reasoning(prompt, parser, continued)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)``; None for a part the answer does not have."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        rest_reasoning, rest_content = stream.finish()
        reasoning, content = reasoning + rest_reasoning, content + rest_content
        if not stream.reasoned:
            return None, content
        return reasoning, content or None

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.starts_inside)


class ReasoningStream:
    """One answer's pieces as they come: each `feed` returns the reasoning and content it can tell apart so far,
    holding back what might be the start of a tag; `finish` returns what is held."""

    def __init__(self, inside: bool):
        self.inside = inside  # the answer starts inside the block: a leading tag of its own is dropped
        self.state = "start"
        self.reasoned = inside  # whether the answer has a reasoning part
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        if self.state == "start":
            opening = text.lstrip()
            if OPEN.startswith(opening):  # blank, or perhaps the start of the tag: wait for more
                self.held = text
                return "", ""
            if opening.startswith(OPEN):
                self.state, self.reasoned, text = "reasoning", True, opening[len(OPEN):]
            elif self.inside:
                self.state = "reasoning"
            else:
                self.state = "content"
                return "", text
        if self.state == "content":
            return "", text
        end, call = text.find(CLOSE), _CALL_ENDS_REASONING.search(text)
        if call is not None and (end < 0 or call.start() < end):
            self.state = "content"
            return text[:call.start()], text[call.start():]
        if end >= 0:
            self.state = "content"
            return text[:end], text[end + len(CLOSE):]
        keep = max(partial_tag(text, CLOSE), _partial_call(text))
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "start" and held.lstrip() == OPEN:  # the block opened, then the answer was cut
            self.state, self.reasoned = "reasoning", True
            return "", ""
        return (held, "") if self.state == "reasoning" or self.state == "start" and self.inside else ("", held)
