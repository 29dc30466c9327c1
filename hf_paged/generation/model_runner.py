"""Packs one scheduled step into a single unpadded forward pass and returns the logits that will be sampled."""

from __future__ import annotations

import inspect

import torch

from ..cache import KVCacheManager, PagedCache, PagedMetadata
from .scheduler import ScheduledBatch
from .sequence import Sequence


class ModelRunner:
    """Runs the model on a flat batch: ``input_ids [1, T]`` holding every scheduled token, no padding.

    The attention layers find the step's block tables and slots in the `PagedCache` (see `PagedCache.set_step`).
    Only the last token of sequences that finish their pending tokens this step produces logits.
    """

    def __init__(self, model: torch.nn.Module, cache: PagedCache, kv_manager: KVCacheManager):
        self.model = model
        self.cache = cache
        self.kv = kv_manager
        self.device = model.device
        self.block_size = cache.block_size
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def prepare(self, batch: ScheduledBatch) -> tuple[dict, list[Sequence], list[int]]:
        """Model inputs for ``batch``, the sequences whose next token is sampled, and their token rows.

        The scheduler puts the decodes (one token each) first, which is the order `PagedMetadata` expects.
        """
        # Copy first: the scheduler has already pointed the tables at the new blocks, and a step that fails later
        # must still leave them filled.
        self.cache.copy_blocks(batch.block_copies)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_start = [0]
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        num_decodes = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.kv.slots(seq.seq_id, start, end)
            seq_lens.append(end)
            query_start.append(query_start[-1] + n)
            tables.append(self.kv.block_table(seq.seq_id))
            num_decodes += n == 1
            if end == seq.num_tokens:
                sample_rows.append(query_start[-1] - 1)
                sampled.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        metadata = PagedMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            block_tables=self._tensor(padded, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(query_start, torch.int32),
            max_query_len=max(batch.num_tokens),
            num_decodes=num_decodes,
        )
        self.cache.set_step(metadata)
        inputs = dict(
            input_ids=self._tensor(input_ids, torch.long).unsqueeze(0),
            position_ids=self._tensor(positions, torch.long).unsqueeze(0),
            cache=self.cache,
            use_cache=True,
        )
        if self._keeps_logits:
            inputs["logits_to_keep"] = self._tensor(sample_rows, torch.long)
        return inputs, sampled, sample_rows

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the step; returns ``logits [len(sampled), vocab]`` and the sampled sequences."""
        inputs, sampled, rows = self.prepare(batch)
        logits = self.model(**inputs).logits[0]
        if not self._keeps_logits:
            logits = logits[rows]
        return logits, sampled
