"""`PagedMetadata`: what every attention layer of one forward step needs, built in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .kv_storage import PagedKVStorage


@dataclass
class PagedMetadata:
    """Everything the attention of one forward step needs, shared by all layers.

    Tokens are packed (the engine never pads; `generate`'s batches and CUDA-graph replays may), sequences with one new
    token (decodes) first: tokens ``[query_start_loc[s], query_start_loc[s + 1])`` belong to sequence ``s``, whose
    keys after this step are ``seq_lens[s]`` tokens held in the blocks ``block_tables[s]``. ``slot_mapping`` is the
    flat slot each new token is written to (``-1``: not written, a padding token). The first ``num_decodes``
    sequences have one new token each.
    ``kv`` holds the block tensors the step reads and writes.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    num_decodes: int
    kv: PagedKVStorage | None = None
    # The layers whose attention wrote this step's keys and values (none: a forward that dropped its kwargs).
    layers_written: set[int] = field(default_factory=set)

    @classmethod
    def build(cls, kv: PagedKVStorage, tables: list[list[int]], seq_lens: list[int], query_lens: list[int],
              slots: list[int]) -> "PagedMetadata":
        """From plain lists: each sequence's block table, its length after the step and its new tokens this step
        (decodes first), and the slots of all new tokens."""
        width = max(1, max(len(t) for t in tables))
        query_start = [0]
        for n in query_lens:
            query_start.append(query_start[-1] + n)
        num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        device = kv.device

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            slot_mapping=tensor(slots, torch.long),
            block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            seq_lens=tensor(seq_lens, torch.int32),
            query_start_loc=tensor(query_start, torch.int32),
            max_query_len=max(query_lens),
            num_decodes=num_decodes,
            kv=kv,
        )
