"""`DraftModel`: speculative guesses from a smaller model with the same tokenizer (``speculative_config`` method
``"draft_model"``), written into a step after the scheduler has allocated its blocks.

The draft keeps KV tensors of its own, addressed by the target's block tables and slots (the same block ids), so it
needs no allocator: in every step of a batch small enough to speculate it computes the tokens the target computes
(in one forward of its own), so its blocks hold its keys and values wherever the target's hold the target's, through
prefix sharing, copy-on-write, forks and preemption (also in steps where no sequence speculates: a block computed
then may be shared, by a fork or a prefix match, with one that does). Sequences that speculate then take one more
draft forward per further guess, batched. While the batch is too large to speculate the draft sits out (`skip`), and
each sequence catches up in the draft's first step after, in forwards of at most ``max_num_batched_tokens``: blocks
filled meanwhile and then shared by a prefix match hold no draft keys and values.
Guesses are the draft's greedy choices, so verification (`verify_drafts`) treats them as certain proposals: greedy
outputs are the target's own and sampled ones keep its distribution. The draft's keys and values only ever help a
guess: where they are stale (after every guess was kept, the last one's until the next step) fewer guesses are kept,
and no output changes.
"""

from __future__ import annotations

import itertools
import os

import torch

from ..cache import KVCacheManager, KVCacheSpec, PagedKVStorage
from ..integration import switch_to_paged_attention
from ..kernels.cpu_linear import prepack_linear_layers
from ..native_decoder import NativeDecoder
from .config import EngineConfig
from .model_runner import ModelRunner, Span
from .sampler import greedy_tokens
from .scheduler import SchedulerOutput
from .sequence import Sequence


class DraftModel:
    """A draft model bound to the target engine's blocks. ``model``: a loaded causal LM on the target's device, or a
    local model directory (loaded in the target's dtype)."""

    def __init__(self, model: torch.nn.Module | str | os.PathLike, target: torch.nn.Module, target_kv: PagedKVStorage,
                 kv_manager: KVCacheManager, config: EngineConfig, max_model_len: int, num_tokens: int):
        model = self._load(model, target)
        if model.get_output_embeddings() is None:
            raise ValueError(f"speculative_config.model: {type(model).__name__} has no language-model head; a draft "
                             "must be a causal LM")
        vocab, target_vocab = (m.get_output_embeddings().weight.shape[0] for m in (model, target))
        if not num_tokens <= vocab <= target_vocab:
            raise ValueError(f"speculative_config.model has {vocab} output tokens, the target {target_vocab} and its "
                             f"tokenizer {num_tokens}: a draft model must share the target's tokenizer")
        # It may be padded less than the target (Qwen2.5-0.5B's 151936 against 7B's 152064): ids past it read as 0.
        self.vocab_size = vocab
        if model.device != target.device:
            raise ValueError(f"speculative_config.model is on {model.device}, the target on {target.device}")
        self.model = model
        positions = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        self.max_positions = min(positions or max_model_len, max_model_len)  # no guesses past the draft's context
        self.kv = PagedKVStorage(model.config, num_blocks=target_kv.num_blocks, block_size=target_kv.block_size,
                                 dtype=config.kv_dtype(model.dtype), device=model.device,
                                 spec=KVCacheSpec.from_model(model))
        self.kv.allocate(self.kv.dtype, model.device)
        native = None if config.enforce_eager else NativeDecoder.for_model(model, self.kv)
        self.runner = ModelRunner(model, self.kv, kv_manager, native, config, max_model_len)
        self.max_tokens = config.max_num_batched_tokens  # per draft forward
        if config.prepack_weights and model.device.type == "cpu":
            prepack_linear_layers(model, keep_plain=self.runner.native_linear_layers())
        self.computed: dict[int, int] = {}  # seq_id -> leading tokens whose draft keys and values are written

    @staticmethod
    def _load(model, target: torch.nn.Module) -> torch.nn.Module:
        if isinstance(model, (str, os.PathLike)):
            from ..loading import load_causal_lm

            model = load_causal_lm(model, dtype=target.dtype, device=str(target.device))
        switch_to_paged_attention(model, "speculative_config.model: ")
        return model.eval()

    def retain(self, running: list[Sequence]) -> None:
        """Forget the sequences that no longer run."""
        if len(self.computed) > 2 * len(running) + 64:
            live = {seq.seq_id for seq in running}
            self.computed = {seq_id: n for seq_id, n in self.computed.items() if seq_id in live}

    def skip(self, out: SchedulerOutput) -> None:
        """A step the draft does not compute: it only notes where each sequence's draft keys and values end."""
        self.kv.copy_blocks(out.block_copies)
        for seq in out.seqs:
            self.computed[seq.seq_id] = self._first(seq)

    def write_guesses(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Compute the step's tokens in the draft too, then guess for its speculating sequences (by seq_id, as many
        tokens as ``out.spec_token_ids`` holds placeholders for), before the target computes the step."""
        self.kv.copy_blocks(out.block_copies)  # the draft's blocks follow the target's copy-on-write
        spans: list[Span] = []
        for seq, n in zip(out.seqs, out.num_tokens):
            first = self._first(seq)  # through its known tokens; the guesses follow
            last = min(seq.num_computed_tokens + n, seq.num_tokens, self.max_positions)
            if last > first:
                spans.append((seq.seq_id, first, [t if t < self.vocab_size else 0 for t in seq.token_ids[first:last]]))
                self.computed[seq.seq_id] = last
        if not spans:
            return {}
        spans = self._catch_up(spans)
        ends = dict(zip((seq_id for seq_id, _, _ in spans), itertools.accumulate(len(t) for _, _, t in spans)))
        speculating = [seq for seq in out.seqs if seq.seq_id in out.spec_token_ids]
        logits = self.runner.run(self.runner.pack(spans, [ends[seq.seq_id] - 1 for seq in speculating]))
        guesses = [[token] for token in greedy_tokens(logits).tolist()]
        wanted = [len(out.spec_token_ids[seq.seq_id]) for seq in speculating]
        for j in range(1, max(wanted, default=0)):  # guess j + 1 from guess j, at the position after the last token + j
            active = [i for i, k in enumerate(wanted) if k > j]
            spans = [(speculating[i].seq_id, speculating[i].num_tokens - 1 + j, guesses[i][-1:]) for i in active]
            for i, token in zip(active, self._greedy(spans)):
                guesses[i].append(token)
        for seq, tokens in zip(speculating, guesses):
            self.computed[seq.seq_id] = seq.num_tokens - 1 + len(tokens)  # through the last token and guesses[:-1]
        return {seq.seq_id: tokens for seq, tokens in zip(speculating, guesses)}

    def _catch_up(self, spans: list[Span]) -> list[Span]:
        """Compute the spans' leading tokens in forwards of at most ``max_tokens`` until the rest fits one (each
        span keeps its last token for it); returns the rest."""
        while sum(len(tokens) for _, _, tokens in spans) > self.max_tokens:
            head, rest, room = [], [], self.max_tokens
            for seq_id, first, tokens in spans:
                take = max(0, min(room, len(tokens) - 1))
                if take:
                    head.append((seq_id, first, tokens[:take]))
                    room -= take
                rest.append((seq_id, first + take, tokens[take:]))
            if not head:
                break
            self.runner.run(self.runner.pack(head, [len(head[0][2]) - 1]))  # its keys and values only
            spans = rest
        return spans

    def _first(self, seq: Sequence) -> int:
        """The first of ``seq``'s tokens whose draft keys and values are not written yet. An unseen sequence starts
        where the target does: blocks it shares were computed by the draft as well. A preempted one starts over."""
        start = seq.num_computed_tokens
        known = self.computed.get(seq.seq_id)
        if known is None and seq.index > 0:  # a fork of the prompt's sequence: its blocks were that one's
            known = self.computed.get(seq.request.seqs[0].seq_id)
        return start if known is None else min(known, start)

    def _greedy(self, spans: list[Span]) -> list[int]:
        """The draft's most likely next token after each one-token span."""
        return greedy_tokens(self.runner.run(self.runner.pack(spans, list(range(len(spans)))))).tolist()
