"""Incremental detokenization: each sequence's newest tokens as text."""

from __future__ import annotations

from functools import lru_cache

from .sequence import Sequence


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, as logprobs name it. A SentencePiece word's first piece keeps the space its "\u2581" stands
    for, which decoding it alone drops (as vLLM restores it)."""
    text = tokenizer.decode([token_id])
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece.startswith("\u2581"):
        missing = (len(piece) - len(piece.lstrip("\u2581"))) - (len(text) - len(text.lstrip(" ")))
        text = " " * max(missing, 0) + text
    return text


class Detokenizer:
    """Turns each sequence's newest tokens into text, one step at a time."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = set(tokenizer.all_special_ids)
        self.token_text = lru_cache(maxsize=1 << 16)(lambda token_id: token_text(tokenizer, token_id))
        """One token's text (logprobs name their tokens), cached."""

    def step(self, seq: Sequence, skip_special_tokens: bool) -> str:
        """Append the text of ``seq``'s newest tokens to ``seq.text`` and return what was added.

        Tokens are decoded with a few tokens of left context, and text is released only once it no longer ends in
        an incomplete UTF-8 character (U+FFFD), so multi-byte characters split over several tokens come out whole.
        """
        tokens = seq.token_ids
        if skip_special_tokens and tokens[-1] in self.special_ids:
            # The left context stays: decoded alone, the next token could lose its leading space (SentencePiece).
            # Bytes of a character not yet released stay in the window, to join the bytes after the special token.
            if seq.read_offset == len(tokens) - 1:
                seq.read_offset = len(tokens)
            return ""
        decode = self.tokenizer.decode
        prefix = decode(tokens[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip_special_tokens)
        full = decode(tokens[seq.prefix_offset :], skip_special_tokens=skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new_text = full[len(prefix) :]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(tokens)
        seq.text += new_text
        return new_text
