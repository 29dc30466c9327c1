"""`ModelRunner`: packs one scheduled step into a single unpadded forward pass and returns the logits to sample."""

from __future__ import annotations

import inspect

import torch

from ..cache import KVCacheManager, PagedKVStorage, PagedMetadata
from .scheduler import SchedulerOutput


class ModelRunner:
    """Runs the model on a flat batch: ``input_ids [1, T]`` holding every scheduled token, no padding.

    The step's block tables and slots reach the attention layers as the forward argument ``paged_metadata``
    (Transformers hands its keyword arguments on to the attention function). Only the last token of sequences that
    finish their pending tokens this step produces logits.
    """

    def __init__(self, model: torch.nn.Module, kv: PagedKVStorage, kv_manager: KVCacheManager):
        self.model = model
        self.kv = kv
        self.kv_manager = kv_manager
        self.device = model.device
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters

    def prepare(self, out: SchedulerOutput) -> tuple[dict, list[int]]:
        """Model inputs for the step ``out``, and the token rows whose logits are sampled."""
        # Copy first: the scheduler has already pointed the tables at the new blocks, and a step that fails later
        # must still leave them filled.
        self.kv.copy_blocks(out.block_copies)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for seq, n in zip(out.seqs, out.num_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += self.kv_manager.slots(seq.seq_id, start, end)
            seq_lens.append(end)
            tables.append(self.kv_manager.block_table(seq.seq_id))
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
        metadata = PagedMetadata.build(self.kv, tables, seq_lens, out.num_tokens, slots)
        inputs = dict(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            # Nothing is padding. Without any mask (and no cache) Transformers would read the restarting positions as
            # packed sequences and ask for a mask pattern the kernels already apply through the block tables.
            attention_mask=torch.ones(1, len(input_ids), dtype=torch.bool, device=self.device),
            use_cache=False,
            paged_metadata=metadata,
        )
        if self._keeps_logits:
            inputs["logits_to_keep"] = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return inputs, sample_rows

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step; returns ``logits [sampled sequences, vocab]`` in step order."""
        inputs, rows = self.prepare(out)
        logits = self.model(**inputs).logits[0]
        return logits if self._keeps_logits else logits[rows]
