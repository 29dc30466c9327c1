"""`PagedCache`: block-shaped KV tensors behind Transformers' `Cache` interface."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .block_pool import BlockPool, NoFreeBlocksError
from .kv_cache_manager import BlockCopy, KVCacheManager


@dataclass
class PagedMetadata:
    """Everything the attention of one forward step needs, shared by all layers.

    Tokens are packed without padding, sequences with one new token (decodes) first: tokens
    ``[query_start_loc[s], query_start_loc[s + 1])`` belong to sequence ``s``, whose keys after this step are
    ``seq_lens[s]`` tokens held in the blocks ``block_tables[s]``. ``slot_mapping`` is the flat slot each new token is
    written to (``-1``: not written, a padding token). The first ``num_decodes`` sequences have one new token each.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    num_decodes: int


PAGED_LAYER_TYPES = ("full_attention", "sliding_attention")


def unpaged_layer_types(config: PretrainedConfig) -> list[str]:
    """The layer types of ``config`` that keep no plain KV (convolutions, recurrent and linear attention states, ...):
    hybrid models whose layers a `PagedCache` cannot hold."""
    types = getattr(config.get_text_config(decoder=True), "layer_types", None) or []
    return sorted(set(types) - set(PAGED_LAYER_TYPES))


def local_kv_heads(model: torch.nn.Module, head_dim: int) -> int | None:
    """The KV heads the first attention layer's ``k_proj`` computes on this rank, for a tensor-parallel model; None
    for a model held whole by one process (its config is right)."""
    if (getattr(model, "_tp_size", None) or 1) <= 1:
        return None
    for module in model.modules():
        k_proj = getattr(module, "k_proj", None)
        if isinstance(k_proj, torch.nn.Linear):
            weight = k_proj.weight
            rows = (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]
            return rows // getattr(module, "head_dim", head_dim)
    raise NotImplementedError(
        f"{type(model).__name__} is tensor-parallel but has no `k_proj` layer to count its local KV heads from; "
        "the paged backend supports tensor parallelism for attention with separate q/k/v projections"
    )


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of a model's KV cache, read from its config.

    The last ``num_shared_layers`` layers (Gemma3n's KV sharing) attend with earlier layers' keys and values, so only
    the first ``num_cached_layers`` hold blocks.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_shared_layers: int = 0

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> "KVCacheSpec":
        config = config.get_text_config(decoder=True)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        shared = getattr(config, "num_kv_shared_layers", None) or 0
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, shared)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "KVCacheSpec":
        """The spec of ``model``'s cache on this rank: under tensor parallelism its attention layers see only their
        local KV heads, counted from the key projection this rank holds (not from the config)."""
        spec = cls.from_config(model.config)
        local = local_kv_heads(model, spec.head_dim)
        return spec if local is None else replace(spec, num_kv_heads=local)

    @property
    def num_cached_layers(self) -> int:
        return self.num_layers - self.num_shared_layers

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_cached_layers * block_size * self.num_kv_heads * self.head_dim * element


class PagedCache(Cache):
    """A KV cache stored in fixed-size blocks, addressed through block tables.

    Each layer keeps ``k``/``v`` tensors seen as ``[num_blocks, block_size, num_kv_heads, head_dim]``, stored
    ``[num_blocks, num_kv_heads, block_size, head_dim]`` (see :mod:`hf_paged.kernels.torch_ops`). Under
    ``model.generate`` every batch row is a sequence with its own block table; left-padding tokens are never stored.
    The continuous-batching engine uses the same object but plans each step itself (:meth:`set_step`).

    Args:
        config: the model config (its number of layers and KV heads size the cache).
        spec: the cache's shape when not the config's (``KVCacheSpec.from_model``: a tensor-parallel rank's heads).
        num_blocks: how many blocks to hold. Either this or ``memory_budget`` (bytes).
        block_size: tokens per block.
        dtype / device: of the KV tensors; by default those of the first keys written.
        growable: when the blocks run out under ``generate``, double them instead of raising `NoFreeBlocksError`
            (the cache ``generate`` creates on its own grows, so it can be passed to a later call or kept by an
            assistant model; one built by hand keeps its size).
    """

    def __init__(
        self,
        config: PretrainedConfig,
        num_blocks: int | None = None,
        block_size: int = 16,
        memory_budget: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        growable: bool = False,
        spec: KVCacheSpec | None = None,
    ):
        super().__init__(layers=[])
        unpaged = unpaged_layer_types(config)
        if unpaged:
            raise NotImplementedError(
                f"PagedCache holds attention keys and values only; this model also has {unpaged} layers, whose "
                "states it cannot keep (hybrid models are not supported by the paged backend's cache)"
            )
        self.growable = growable
        self.spec = spec or KVCacheSpec.from_config(config)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if num_blocks is None:
            if memory_budget is None:
                raise ValueError("PagedCache needs `num_blocks` or `memory_budget`")
            num_blocks = memory_budget // self.spec.bytes_per_block(block_size, dtype or torch.float32)
            if num_blocks < 1:
                raise ValueError(f"memory_budget={memory_budget} bytes holds no {block_size}-token KV block")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []
        self.rows = KVCacheManager(self.pool, enable_prefix_caching=False)
        self._row_lens: list[int] = []
        self._seen_tokens = 0
        self._next_step: PagedMetadata | None = None
        self._step: PagedMetadata | None = None

    # ----------------------------------------------------------------------------------------------- storage
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the KV tensors of every layer (done on the first write if not called before)."""
        if self.key_cache:
            return
        self.dtype = self.dtype or dtype
        self.device = self.device or device
        shape = (self.num_blocks, self.spec.num_kv_heads, self.block_size, self.spec.head_dim)
        for _ in range(self.spec.num_cached_layers):
            # Zeros, not empty: attention reads whole blocks and masks the unused rows, which must stay finite.
            self.key_cache.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self.value_cache.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def _grow(self, num_blocks: int) -> None:
        """Add ``num_blocks`` blocks, copying the KV tensors into larger ones."""
        self.pool.grow(num_blocks)
        for caches in (self.key_cache, self.value_cache):
            for i, old in enumerate(caches):
                caches[i] = torch.cat([old, old.new_zeros(num_blocks, *old.shape[1:])])

    def layer(self, layer_idx: int, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(k, v)`` block tensors of ``layer_idx`` as ``[num_blocks, block_size, num_kv_heads, head_dim]`` views,
        checked against the new ``key`` ``[B, Hkv, S, D]``."""
        self.allocate(key.dtype, key.device)
        if layer_idx >= len(self.key_cache):
            raise ValueError(f"layer {layer_idx} stores keys, but the config says only the first {len(self.key_cache)} "
                             "layers do (num_kv_shared_layers)")
        k_cache = self.key_cache[layer_idx]
        if key.shape[1] != k_cache.shape[1] or key.shape[3] != k_cache.shape[3]:
            raise ValueError(
                f"layer {layer_idx} produced keys with {key.shape[1]} heads of dim {key.shape[3]}, but the PagedCache "
                f"was sized for {k_cache.shape[1]} heads of dim {k_cache.shape[3]}"
            )
        return k_cache.transpose(1, 2), self.value_cache[layer_idx].transpose(1, 2)

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy whole blocks (``(src, dst)`` pairs) in every layer, for copy-on-write."""
        if not copies or not self.key_cache:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in (*self.key_cache, *self.value_cache):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    # ------------------------------------------------------------------------------------- step planning
    def set_step(self, metadata: PagedMetadata) -> None:
        """Use ``metadata`` for the next forward pass instead of planning one row per batch element."""
        self._next_step = metadata

    def update(self, key_states, value_states, layer_idx, *args, kwargs=None, **ignored):
        """Hand this cache to the paged attention function through the model's attention kwargs.

        The keys and values are written into their slots by the attention function, which also knows which query
        positions are padding; they are returned unchanged.
        """
        if kwargs is None:
            raise TypeError(
                "this model's attention calls `cache.update` without its attention kwargs, so the paged attention "
                "function cannot find the cache; hf_paged supports models built on Transformers' attention interface"
            )
        if layer_idx == 0:
            self._step, self._next_step = self._next_step, None
        kwargs["paged_cache"] = self
        kwargs["paged_layer_idx"] = layer_idx
        if self.spec.num_shared_layers:
            # Models that share KV across layers (Gemma3n) hand these same tensors to later layers' attention, which
            # then finds their blocks through this tag.
            key_states.paged_source = (self, layer_idx)
        return key_states, value_states

    def step_metadata(self, batch_size: int, query_len: int, mask: torch.Tensor | None) -> PagedMetadata:
        """This forward's metadata; under ``generate`` planned on first use from the batch rows.

        ``mask`` (``[batch, past + query_len]`` bool, or None when nothing is padding) marks the tokens that are not
        padding: the new ones to store, and the cached ones, which must be those this cache stored.
        """
        if self._step is None:
            self._step = self._plan_rows(batch_size, query_len, mask)
        return self._step

    def _plan_rows(self, batch_size: int, query_len: int, mask: torch.Tensor | None) -> PagedMetadata:
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
        valid = None if mask is None else mask[:, -query_len:]
        if valid is None:
            counts = [query_len] * batch_size
        else:
            if bool((valid[:, 1:] < valid[:, :-1]).any()):
                raise ValueError("the paged backend supports left padding only (a padding token follows a real one)")
            counts = valid.sum(dim=1).tolist()
        slots: list[int] = []
        copies: list[BlockCopy] = []
        for row, count in enumerate(counts):
            start = self._row_lens[row]
            try:
                copies += self.rows.allocate(row, start, start + count)
            except NoFreeBlocksError as full:
                if not self.growable:
                    raise
                self._grow(max(full.requested - full.free, self.num_blocks))
                copies += self.rows.allocate(row, start, start + count)
            slots += [-1] * (query_len - count) + self.rows.slots(row, start, start + count)
            self._row_lens[row] = start + count
        self.copy_blocks(copies)
        self._seen_tokens += query_len
        device = self.device
        tables = [self.rows.block_table(row) for row in range(batch_size)]
        width = max(1, max(len(t) for t in tables))
        return PagedMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self._row_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, batch_size * query_len + 1, query_len, dtype=torch.int32, device=device),
            max_query_len=query_len,
            num_decodes=batch_size if query_len == 1 else 0,
        )

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
        self._step = self._next_step = None

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
