"""`PagedCache`: the adapter that lets `model.generate` keep its KV in a `PagedKVStorage` behind Transformers'
`Cache` interface: one block table per batch row, planned from the attention mask, cropped and reordered as
`generate` asks (assisted decoding, beam search)."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .block_pool import DEFAULT_BLOCK_SIZE, NoFreeBlocksError
from .kv_cache_manager import BlockCopy, KVCacheManager
from .kv_storage import KVCacheSpec, PagedKVStorage
from .metadata import PagedMetadata


class PagedCache(Cache):
    """A KV cache for `generate` stored in fixed-size blocks (a `PagedKVStorage`), addressed through block tables.

    Every batch row is a sequence with its own block table; left-padding tokens are never stored. The first attention
    layer of each forward plans the step (`step_metadata`) from the padding mask; the continuous-batching engine
    does not use this class: it plans its steps itself over the same storage.

    Args:
        config: the model config (its number of layers and KV heads size the cache).
        num_blocks: how many blocks to hold. Either this or ``memory_budget`` (bytes).
        block_size: tokens per block.
        dtype / device: of the KV tensors; by default those of the first keys written.
        growable: when the blocks run out, double them instead of raising `NoFreeBlocksError` (the cache
            ``generate`` creates on its own grows, so it can be passed to a later call or kept by an assistant model;
            one built by hand keeps its size).
        spec: the cache's shape when not the config's (``KVCacheSpec.from_model``: a tensor-parallel rank's heads).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        memory_budget: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        growable: bool = False,
        spec: KVCacheSpec | None = None,
    ):
        super().__init__(layers=[])
        self._text_config = config.get_text_config(decoder=True)  # whose attention implementation must be "paged"
        self.kv = PagedKVStorage(config, num_blocks, block_size, memory_budget, dtype, device, spec)
        self.growable = growable
        self.rows = KVCacheManager(self.kv.pool, enable_prefix_caching=False)
        self._row_lens: list[int] = []
        self._seen_tokens = 0
        self._step: PagedMetadata | None = None
        self._unclaimed: int | None = None  # the layer whose update handed this cache on, until its attention plans

    # The storage's face, for callers that size or inspect the cache.
    spec = property(lambda self: self.kv.spec)
    pool = property(lambda self: self.kv.pool)
    block_size = property(lambda self: self.kv.block_size)
    num_blocks = property(lambda self: self.kv.num_blocks)
    key_cache = property(lambda self: self.kv.key_cache)
    value_cache = property(lambda self: self.kv.value_cache)

    # ------------------------------------------------------------------------------------- step planning
    def update(self, key_states, value_states, layer_idx, *args, kwargs=None, **ignored):
        """Hand this cache to the paged attention function through the model's attention kwargs, or where a model
        passes none (GPT-NeoX, Falcon), through the keys it returns.

        The keys and values are written into their slots by the attention function, which also knows which query
        positions are padding; they are returned unchanged.
        """
        if layer_idx == 0:
            self._step, self._unclaimed = None, None  # a new forward: plan it at its first attention layer
            implementation = getattr(self._text_config, "_attn_implementation", None)  # None: a config of its own
            if implementation not in (None, "paged"):
                raise ValueError(f"a PagedCache is read only by attn_implementation='paged', and this model's "
                                 f"attention is {implementation!r}: switch it back (model.set_attn_implementation"
                                 "('paged')) or pass it another cache")
        if self._unclaimed is not None:
            raise TypeError(f"layer {self._unclaimed}'s attention did not receive the PagedCache its `cache.update` "
                            "handed on (the model changed its keys between them); hf_paged cannot page this model")
        if kwargs is None:
            key_states.paged_cache = self
        else:
            kwargs["paged_cache"] = self
        self._unclaimed = layer_idx
        return key_states, value_states

    def step_metadata(self, batch_size: int, query_len: int, mask: torch.Tensor | None) -> PagedMetadata:
        """This forward's metadata, planned on first use from the batch rows.

        ``mask`` (``[batch, past + query_len]`` bool, or None when nothing is padding) marks the tokens that are not
        padding: the new ones to store, and the cached ones, which must be those this cache stored.
        """
        self._unclaimed = None
        if self._step is None:
            self._step = self._plan_rows(batch_size, query_len, mask)
        return self._step

    def _new_token_counts(self, batch_size: int, query_len: int, mask: torch.Tensor | None) -> list[int]:
        if not self._row_lens:
            self._row_lens = [0] * batch_size
        if batch_size != len(self._row_lens):
            raise ValueError(f"PagedCache holds {len(self._row_lens)} rows but the batch has {batch_size}")
        past = [self._seen_tokens] * batch_size if mask is None else mask[:, :-query_len].sum(dim=1).tolist()
        if past != self._row_lens:
            raise ValueError(
                f"the attention mask marks {past} cached tokens per row as real, but this PagedCache stored "
                f"{self._row_lens} (padding is never stored: continue with the mask the cached tokens had)"
            )
        if mask is None:
            return [query_len] * batch_size
        valid = mask[:, -query_len:]
        if bool((valid[:, 1:] < valid[:, :-1]).any()):
            raise ValueError("the paged backend supports left padding only (a padding token follows a real one)")
        return valid.sum(dim=1).tolist()

    def _allocate_row(self, row: int, start: int, end: int) -> list[BlockCopy]:
        copies = self.rows.allocate(row, start, end)
        if copies is None and self.growable:
            needed = self.rows.num_blocks_needed(row, start, end)
            self.kv.grow(max(needed - self.pool.num_free_blocks, self.num_blocks))
            copies = self.rows.allocate(row, start, end)
        if copies is None:
            needed = self.rows.num_blocks_needed(row, start, end)
            raise NoFreeBlocksError(needed, self.pool.num_free_blocks)
        return copies

    def _plan_rows(self, batch_size: int, query_len: int, mask: torch.Tensor | None) -> PagedMetadata:
        counts = self._new_token_counts(batch_size, query_len, mask)
        slots: list[int] = []
        copies: list[BlockCopy] = []
        for row, count in enumerate(counts):
            start = self._row_lens[row]
            copies += self._allocate_row(row, start, start + count)
            slots += [-1] * (query_len - count) + self.rows.slots(row, start, start + count)
            self._row_lens[row] = start + count
        self.kv.copy_blocks(copies)
        self._seen_tokens += query_len
        tables = [self.rows.block_table(row) for row in range(batch_size)]
        return PagedMetadata.build(self.kv, tables, self._row_lens, [query_len] * batch_size, slots)

    # ------------------------------------------------------------------- what `generate` asks of a Cache
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen per row, padding included (the position the next token gets under `generate`)."""
        return self._seen_tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen_tokens + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return True

    # Per-layer flags: every layer keeps all its tokens (sliding windows are applied by the kernels), none is a linear
    # attention state. `generate` reads them, e.g. to skip the cached part of the prompt when continuing a cache.
    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.spec.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.spec.num_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.spec.num_layers

    @property
    def is_initialized(self) -> bool:
        return bool(self.key_cache)

    @property
    def batch_size(self) -> int:
        return len(self._row_lens) or -1

    def reset(self) -> None:
        """Free every row's blocks; the KV tensors are kept for reuse."""
        self.rows.free_all()
        self._row_lens = []
        self._seen_tokens = 0
        self._step = None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (assisted decoding rolls back this way)."""
        if tokens_to_remove > 0:
            raise ValueError("PagedCache.crop takes a negative number: how many tokens to remove")
        remove = -tokens_to_remove
        for row, length in enumerate(self._row_lens):
            self._row_lens[row] = max(0, length - remove)
            self.rows.truncate(row, self._row_lens[row])
        self._seen_tokens = max(0, self._seen_tokens - remove)

    def _select_rows(self, indices: list[int]) -> None:
        """Rebuild the rows as ``indices`` of the current ones; repeated rows share blocks copy-on-write."""
        self.rows.select(indices)
        self._row_lens = [self._row_lens[old] for old in indices]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues from row ``beam_idx[i]``."""
        self._select_rows(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows([row for row in range(len(self._row_lens)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select_rows(indices.tolist())

    def __repr__(self) -> str:
        return (
            f"PagedCache(num_blocks={self.num_blocks}, block_size={self.block_size}, rows={len(self._row_lens)}, "
            f"used_blocks={self.pool.num_used_blocks})"
        )
