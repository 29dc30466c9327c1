"""`ModelRunner`: packs one scheduled step into a single unpadded forward pass and returns the logits to sample."""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..attention import unpadded_mask
from ..cache import KVCacheManager, PagedKVStorage, PagedMetadata
from ..integration import uses_paged_attention
from ..kernels import cpu_decoder
from ..lora import LoRAAdapter, LoRAStacks, LoRAStep
from ..native_decoder import NativeDecoder
from .beam_search import beam_candidates
from .config import EngineConfig
from .long_rope import LongRope
from .sampler import SamplerOutput, build_sampling_batch, prompt_logprobs, sample
from .scheduler import SchedulerOutput
from .spec_decode import verify_drafts

if TYPE_CHECKING:
    from .cuda_graphs import DecodeGraphs


Span = tuple[int, int, list[int]]  # a sequence's tokens in a step: (seq_id, position of the first, token ids)


@dataclass
class StepInputs:
    """One step's tokens, flat: ``input_ids`` and ``position_ids`` ``[1, T]``, the attention metadata, the token
    rows whose logits are sampled (``sample_rows``, int64, on the model's device), and, for the native decoder, each
    sequence's prompt length (``prompt_lens``, int32: its tokens at lower positions are prompt tokens); for LongRoPE
    models, which tokens take the long factors (``long_rope_rows``, `LongRope.long_rows`)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    metadata: PagedMetadata
    sample_rows: torch.Tensor
    prompt_lens: torch.Tensor | None = None
    long_rope_rows: torch.Tensor | None = None
    lora: LoRAStep | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]


class ModelRunner:
    """Runs the model on a flat batch: ``input_ids [1, T]`` holding every scheduled token, no padding.

    The step's block tables and slots reach the attention layers as the forward argument ``paged_metadata``
    (Transformers hands its keyword arguments on to the attention function). Logits are computed only for the sample
    rows: the last token of each sequence that finishes its pending tokens this step (and each speculative guess it
    verifies), then the prompt positions whose logprobs are asked for. Steps of at most ``native.max_tokens`` tokens go
    through the `NativeDecoder` instead, when the model has one; on GPU, decode steps of up to ``max_query_len``
    tokens per sequence replay CUDA graphs (``graphs``, see `hf_paged.generation.cuda_graphs`), given the engine's
    ``config`` and ``max_model_len``. Steps with LoRA-adapted tokens take the native decoder where it takes their
    adapters, never the graphs (`hf_paged.lora`).
    """

    def __init__(self, model: torch.nn.Module, kv: PagedKVStorage, kv_manager: KVCacheManager,
                 native: NativeDecoder | None = None, config: EngineConfig | None = None,
                 max_model_len: int | None = None, max_query_len: int = 1):
        self.model = model
        self.kv = kv
        self.kv_manager = kv_manager
        self.native = native
        self.long_rope = LongRope.for_model(model)
        self.lora_stacks = LoRAStacks()
        self.device = model.device
        self._keeps_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.graphs: DecodeGraphs | None = None
        if config is not None:
            from .cuda_graphs import decode_graphs  # which builds on this module

            self.graphs = decode_graphs(self, config, max_model_len, max_query_len)

    def native_linear_layers(self) -> list[torch.nn.Module]:
        """The linear layers the native decoder multiplies by with its own copy of their weights, where it takes
        steps of up to 512 tokens: they need no oneDNN copy as well (the Transformers forward of a longer step
        multiplies with torch's GEMM; a 4000-token fp32 prefill ran 0.94-0.97x as fast, for a copy of the weights
        less). None (an empty list) where it takes shorter steps (fp32 on CPUs with AVX2 alone) or does not run."""
        if self.native is None or self.native.max_tokens < cpu_decoder.MAX_TOKENS:
            return []
        return self.native.linear_layers()

    def cache_salt(self, num_prompt_tokens: int) -> bytes | None:
        """What keeps a prompt's cached blocks apart from others' computed differently (LongRoPE's factors)."""
        return None if self.long_rope is None else self.long_rope.cache_salt(num_prompt_tokens)

    def copy_blocks(self, out: SchedulerOutput) -> None:
        """Fill the blocks the scheduler gave sequences in place of shared ones (copy-on-write). Its tables already
        point at them, so this comes before anything in the step that can fail: a step that is undone keeps them."""
        self.kv.copy_blocks(out.block_copies)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Model inputs for the step ``out`` (its block copies made: `copy_blocks`)."""
        spans: list[Span] = []
        sample_rows: list[int] = []
        num_tokens = 0
        needs_lens = self.native is not None or self.long_rope is not None
        prompt_lens = [seq.request.num_prompt_tokens for seq in out.seqs] if needs_lens else None
        row_of_first: dict[int, int] = {}  # each sequence's first token's row, where its start position is
        for i, (seq, n) in enumerate(zip(out.seqs, out.num_tokens)):
            start = seq.num_computed_tokens
            guesses = out.spec_token_ids.get(seq.seq_id, [])  # speculative guesses, computed after its last token
            spans.append((seq.seq_id, start, seq.token_ids[start : start + n] + guesses))
            row_of_first[seq.seq_id] = num_tokens - start
            num_tokens += n
            if out.samples(i):  # its last token's logits, and each guess's
                sample_rows += range(num_tokens - 1 - len(guesses), num_tokens)
        for seq, first, count in out.prompt_logprob_spans:  # after every sampled row
            sample_rows += range(row_of_first[seq.seq_id] + first, row_of_first[seq.seq_id] + first + count)
        return self.pack(spans, sample_rows, prompt_lens, [seq.request.lora for seq in out.seqs])

    def pack(self, spans: list[Span], sample_rows: list[int], prompt_lens: list[int] | None = None,
             loras: list[LoRAAdapter | None] | None = None) -> StepInputs:
        """The flat inputs of ``spans``: ``(seq_id, first position, tokens)`` each, the sequences' blocks already
        allocated through their last token; ``sample_rows`` index the packed tokens; ``prompt_lens``, if given, the
        spans' prompt lengths (else taken as 0); ``loras``, if given, the spans' LoRA adapters (None: none)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        for seq_id, start, tokens in spans:
            end = start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slots += self.kv_manager.slots(seq_id, start, end)
            seq_lens.append(end)
            query_lens.append(len(tokens))
            tables.append(self.kv_manager.block_table(seq_id))
        long_rows = None
        if self.long_rope is not None:
            spans_at = [(start, len(tokens)) for _, start, tokens in spans]
            long_rows = self.long_rope.long_rows(spans_at, prompt_lens or [0] * len(spans), self.device)
        return StepInputs(
            input_ids=torch.tensor([input_ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            metadata=PagedMetadata.build(self.kv, tables, seq_lens, query_lens, slots),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            prompt_lens=None if prompt_lens is None or self.native is None else torch.tensor(prompt_lens,
                                                                                               dtype=torch.int32),
            long_rope_rows=long_rows,
            lora=LoRAStep.of(loras, query_lens, self.device, self.lora_stacks) if loras else None,
        )

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step (its block copies made); returns ``logits [sample rows, vocab]``: in step order one row per
        sampled sequence and one more per speculative guess it verifies, then the prompt-logprob rows."""
        if not uses_paged_attention(self.model):  # the native decoder would not notice, the Transformers forward would
            implementation = self.model.config.get_text_config(decoder=True)._attn_implementation
            raise RuntimeError(f"the model's attention was switched to {implementation!r} after the engine was built: "
                               "switch it back with model.set_attn_implementation('paged')")
        return self.run(self.prepare(out))

    @staticmethod
    def sample(out: SchedulerOutput, logits: torch.Tensor) -> SamplerOutput | None:
        """The step's draws from its ``logits`` (`execute`'s): sampled, or verified against their guesses
        (`verify_drafts`), with each beam search's candidates and the prompt logprobs asked for; None for a step
        that draws nothing and scores no prompt."""
        scored = out.num_prompt_logprob_rows
        if scored:
            logits, prompt_logits = logits[: logits.shape[0] - scored], logits[logits.shape[0] - scored :]
        if not out.draws:
            sampled = SamplerOutput([]) if scored else None
        elif out.spec_token_ids:
            sampled = verify_drafts(logits, out)
        else:
            rows = logits if len(out.draw_rows) == logits.shape[0] else logits[out.draw_rows]
            sampled = sample(rows, build_sampling_batch(out.draws, logits.device))
        if out.draws:
            sampled.beams = beam_candidates(logits, out.draws, out.draw_rows)
        if scored:
            sampled.prompt_logprobs, sampled.prompt_ranks = prompt_logprobs(prompt_logits, out.prompt_logprob_spans)
        return sampled

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """The logits of ``step``'s sample rows: through the native decoder when it takes the step, else `forward`."""
        rows = step.long_rope_rows
        with _evaluating(self.model), nullcontext() if rows is None else self.long_rope.applied(rows):
            return self._run(step)

    def _run(self, step: StepInputs) -> torch.Tensor:
        native = self.native
        if native is not None and step.num_tokens <= native.max_tokens:
            if native.ready():
                if native.takes(step.lora):
                    return native.forward(step.input_ids, step.position_ids, step.metadata, step.sample_rows,
                                          step.prompt_lens, lora=step.lora)
            elif native.gone:
                self.native = None
        if step.lora is not None:  # only the model's own forward calls the hooks that add the adapters' products
            with step.lora.applied(self.model):
                return self.forward(step)
        if self.graphs is not None and (logits := self.graphs.run(step)) is not None:
            return logits
        return self.forward(step)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """The step through the model's own (Transformers) forward."""
        inputs = dict(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            # Nothing is padding. Without any mask (and no cache) Transformers would read the restarting positions as
            # packed sequences and ask for a mask pattern the kernels already apply through the block tables.
            attention_mask=unpadded_mask(step.num_tokens, self.device),
            use_cache=False,
            paged_metadata=step.metadata,
        )
        if self._keeps_logits:
            inputs["logits_to_keep"] = step.sample_rows
        logits = self.model(**inputs).logits[0]
        if not step.metadata.layers_written:  # its attention ran without the cache: the logits are wrong
            raise TypeError(f"{type(self.model).__name__}'s forward does not pass its keyword arguments (the step's "
                            "paged_metadata) on to its attention layers")
        return logits if self._keeps_logits else logits[step.sample_rows]


@contextmanager
def _evaluating(model: torch.nn.Module):
    """``model`` in eval mode (dropout off) for one step, each module's own mode restored after: a model trained
    between steps (an RL loop) is served as after ``eval()``, and stays in training."""
    if not model.training:
        yield
        return
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode
