"""Reasoning parsers (``hf-paged serve --reasoning-parser``, vLLM's): a thinking model's answer split into its
reasoning, between ``<think>`` and ``</think>``, and its content after them.

Whether an answer starts inside the reasoning is read from the end of its prompt: templates that open the block
themselves (DeepSeek-R1's, Qwen3's newer ones) end the prompt with ``<think>``; Qwen3's with ``enable_thinking=False``
end it with an empty, closed block, and others with no tag. Otherwise an answer that opens with ``<think>`` (after
blank space) reasons until ``</think>``. An answer that never closes its block is all reasoning. vLLM's parser names
``deepseek_r1`` and ``qwen3`` both read these tags. (An answer under a JSON constraint, which holds from its first
token, is not split: it is all content.)
"""

from __future__ import annotations

from .tool_calls import partial_tag

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


class ReasoningParser:
    """Splits the answers to one prompt; `split` reads a whole answer, `stream` one that comes in pieces."""

    def __init__(self, prompt: str):
        self.starts_inside = prompt.rstrip().endswith(OPEN)  # not a tag that a message quotes

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
        self.state = "reasoning" if inside else "start"
        self.reasoned = inside  # whether the answer has a reasoning part
        self.held = ""

    def feed(self, piece: str) -> tuple[str, str]:
        text, self.held = self.held + piece, ""
        if self.state == "start":
            opening = text.lstrip()
            if OPEN.startswith(opening):  # blank, or perhaps the start of the tag: wait for more
                self.held = text
                return "", ""
            if not opening.startswith(OPEN):
                self.state = "content"
                return "", text
            self.state, self.reasoned, text = "reasoning", True, opening[len(OPEN):]
        if self.state == "content":
            return "", text
        end = text.find(CLOSE)
        if end >= 0:
            self.state = "content"
            return text[:end], text[end + len(CLOSE):]
        keep = partial_tag(text, CLOSE)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "start" and held.lstrip() == OPEN:  # the block opened, then the answer was cut
            self.state, self.reasoned = "reasoning", True
            return "", ""
        return (held, "") if self.state == "reasoning" else ("", held)
