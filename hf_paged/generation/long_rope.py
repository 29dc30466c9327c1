"""`LongRope`: LongRoPE's frequencies chosen per token in a packed step.

Transformers' LongRoPE (Phi-3 and Phi-3.5 long-context models) rotates every token of a forward call by its short
factors while the call's highest position is within ``original_max_position_embeddings``, and by its long factors
past it. A sequence run alone through `generate` thus computes its prompt with the long factors when the prompt
reaches past that length, and its later tokens with the long factors from that position on. The engine packs many
sequences into one call, so it chooses per token as each sequence alone would have: long when the token's position,
or its sequence's prompt, reaches past the original length. The keys of a long prompt then differ from those of a
short one with the same first tokens, so their prefix-cache blocks are kept apart (`cache_salt`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn

LONG_PROMPT_SALT = b"longrope:long"  # 13 bytes: no salted chain can hash the bytes an unsalted one does


class LongRope:
    """Per-token LongRoPE for the engine's packed steps over ``rotary`` (the model's rotary embedding)."""

    def __init__(self, rotary: nn.Module, original_max_positions: int):
        self.rotary = rotary
        self.original = original_max_positions

    @classmethod
    def for_model(cls, model: nn.Module) -> "LongRope | None":
        """The model's LongRope, or None when its rotary embedding is not LongRoPE."""
        rotary = getattr(model.base_model, "rotary_emb", None)
        if getattr(rotary, "rope_type", None) != "longrope":
            return None
        return cls(rotary, rotary.config.rope_parameters["original_max_position_embeddings"])

    def cache_salt(self, num_prompt_tokens: int) -> bytes | None:
        return LONG_PROMPT_SALT if num_prompt_tokens > self.original else None

    def long_rows(self, starts_and_lengths: Sequence[tuple[int, int]], prompt_lens: Sequence[int],
                  device: torch.device) -> torch.Tensor:
        """Which tokens of a step take the long factors (``[1, T]``, bool), for spans of ``(first position, tokens)``
        of sequences whose prompts are ``prompt_lens`` long."""
        rows = [max(position + 1, prompt_len) > self.original
                for (start, length), prompt_len in zip(starts_and_lengths, prompt_lens)
                for position in range(start, start + length)]
        return torch.tensor([rows], dtype=torch.bool, device=device)

    @contextmanager
    def applied(self, long_rows: torch.Tensor) -> Iterator[None]:
        """While open, the rotary embedding's tables take the long or short factors per token, as ``long_rows``
        says, whatever the call's highest position."""
        handle = self.rotary.register_forward_hook(partial(self._per_token, long_rows), with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _per_token(self, long_rows: torch.Tensor, module: nn.Module, args: tuple, kwargs: dict,
                   output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x = args[0] if args else kwargs["x"]
        positions = args[1] if len(args) > 1 else kwargs["position_ids"]
        # module.forward skips the hooks. Short: every position within the original length (the long rows' are
        # dropped); long: one more position past it, dropped after.
        short = module.forward(x, torch.where(long_rows, 0, positions))
        beyond = positions.new_full((positions.shape[0], 1), self.original)
        long = module.forward(x, torch.cat([positions, beyond], dim=1))
        pick = long_rows[..., None]
        return tuple(torch.where(pick, long_table[:, :-1], short_table) for long_table, short_table in zip(long, short))
