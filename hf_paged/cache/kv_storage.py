"""`PagedKVStorage`: every layer's KV block tensors and the pool that hands their blocks out, shared by the engine
and `generate`; `KVCacheSpec`: their shape, read from a model config."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import PretrainedConfig

from .block_pool import DEFAULT_BLOCK_SIZE, BlockPool
from .kv_cache_manager import BlockCopy

PAGED_LAYER_TYPES = ("full_attention", "sliding_attention")
# Linear attention keeps a recurrent state (a hybrid model's layers), not keys to attend to.
_RECURRENT_ATTENTION = ("linear_attention",)


def unpaged_layer_types(config: PretrainedConfig) -> list[str]:
    """The layer types of ``config`` that keep no plain KV (convolutions, recurrent and linear attention states, ...):
    hybrid models whose layers a paged KV cache cannot hold."""
    types = getattr(config.get_text_config(decoder=True), "layer_types", None) or []
    return sorted(set(types) - set(PAGED_LAYER_TYPES))


def unserved_attention_types(config: PretrainedConfig) -> list[str]:
    """The attention layer types of ``config`` whose keys the paged kernels cannot attend to in their pattern (Llama 4's
    chunks, sparse or indexed selections of the keys): refused when the model is built, since even Transformers'
    cache cannot serve them under paged attention."""
    return [t for t in unpaged_layer_types(config) if t.endswith("attention") and t not in _RECURRENT_ATTENTION]


def kv_head_dim(config: PretrainedConfig) -> int:
    """One KV head's size in ``config`` (a text config); keys and values of different sizes (multi-head latent
    attention, as in DeepSeek-V2/V3) raise `NotImplementedError`: a block holds keys and values of one size."""
    if getattr(config, "qk_nope_head_dim", None) is not None and getattr(config, "qk_rope_head_dim", None) is not None:
        key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    else:
        key_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    value_dim = getattr(config, "v_head_dim", None) or key_dim
    if value_dim != key_dim:
        raise NotImplementedError(
            f"{config.model_type} attends with keys of {key_dim} and values of {value_dim} numbers per head; the paged "
            "KV cache holds keys and values of one size (multi-head latent attention is not supported)")
    return key_dim


def local_kv_heads(model: torch.nn.Module, spec: "KVCacheSpec") -> int | None:
    """The KV heads this rank's attention layers see, for a tensor-parallel model: counted from the first ``k_proj``
    this rank holds, else what Transformers' plan gives each rank (fused projections); None for a model held whole by
    one process (its config is right)."""
    tp_size = getattr(model, "_tp_size", None) or 1
    if tp_size <= 1:
        return None
    for module in model.modules():
        k_proj = getattr(module, "k_proj", None)
        if isinstance(k_proj, torch.nn.Linear):
            return _local_rows(k_proj) // getattr(module, "head_dim", spec.head_dim)
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    heads = get_kv_heads_per_rank(model.tp_plan, spec.num_kv_heads, tp_size)
    if heads is None:
        raise NotImplementedError(f"{type(model).__name__}'s {spec.num_kv_heads} KV heads do not split over "
                                  f"{tp_size} ranks")
    return heads


def _local_rows(linear: torch.nn.Linear) -> int:
    """The output rows of ``linear`` this process holds (a tensor-parallel shard's, or all)."""
    weight = linear.weight
    return (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0]


def _check_layers_alike(model: torch.nn.Module) -> None:
    """Refuse (``NotImplementedError``) a model whose decoder layers project keys of different shapes (MiMo-V2-Flash's
    sliding layers have twice the KV heads): its config describes one shape, and the cache holds one."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    shapes = set()
    for module in decoder.modules():
        k_proj, head_dim = getattr(module, "k_proj", None), getattr(module, "head_dim", None)
        if isinstance(k_proj, torch.nn.Linear) and isinstance(head_dim, int) and hasattr(module, "layer_idx"):
            shapes.add((_local_rows(k_proj) // head_dim, head_dim))
    if len(shapes) > 1:
        raise NotImplementedError(
            f"{type(model).__name__}'s layers differ in the shape of their keys (KV heads x head size: "
            f"{', '.join(f'{h} x {d}' for h, d in sorted(shapes))}); the paged KV cache holds one shape for every "
            "layer")


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
        num_heads = getattr(config, "num_attention_heads", None)
        if num_heads is None:
            raise NotImplementedError(f"{config.model_type} has no attention heads (a state-space or recurrent "
                                      "model): a paged KV cache has nothing to hold for it")
        try:
            head_dim = kv_head_dim(config)
            num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        except RuntimeError as err:  # Transformers' per_layer_config: a KV shape that varies over the layers
            if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError":
                raise
            raise NotImplementedError(
                f"{config.model_type}'s layers differ in the shape of their keys and values, as Gemma 4's "
                f"full-attention layers have wider heads (Transformers: {str(err).split('.')[0]}); the paged KV cache "
                "holds one head size and one number of KV heads for every layer") from None
        shared = getattr(config, "num_kv_shared_layers", None) or 0
        return cls(config.num_hidden_layers, num_kv_heads, head_dim, shared)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> "KVCacheSpec":
        """The spec of ``model``'s cache on this rank: under tensor parallelism its attention layers see only their
        local KV heads, counted from the key projection this rank holds (not from the config)."""
        spec = cls.from_config(model.config)
        _check_layers_alike(model)
        local = local_kv_heads(model, spec)
        return spec if local is None else replace(spec, num_kv_heads=local)

    @property
    def num_cached_layers(self) -> int:
        return self.num_layers - self.num_shared_layers

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_cached_layers * block_size * self.num_kv_heads * self.head_dim * element


class PagedKVStorage:
    """Per layer, ``k``/``v`` tensors stored ``[num_blocks, num_kv_heads, block_size, head_dim]`` and handed to the
    kernels as ``[num_blocks, block_size, num_kv_heads, head_dim]`` views (see :mod:`hf_paged.kernels.torch_ops`).

    Args:
        config: the model config (its number of layers and KV heads size the blocks).
        spec: the blocks' shape when not the config's (``KVCacheSpec.from_model``: a tensor-parallel rank's heads).
        num_blocks: how many blocks to hold. Either this or ``memory_budget`` (bytes).
        block_size: tokens per block.
        dtype / device: of the KV tensors; by default those of the first keys written.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        num_blocks: int | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        memory_budget: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        spec: KVCacheSpec | None = None,
    ):
        unpaged = unpaged_layer_types(config)
        if unpaged:
            raise NotImplementedError(
                f"a paged KV cache holds the keys and values of full and sliding-window attention only; this model "
                f"also has {unpaged} layers (recurrent or convolution states, linear or chunked attention: hybrid "
                "models are not supported by the paged backend's cache)"
            )
        self.spec = spec or KVCacheSpec.from_config(config)
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if num_blocks is None:
            if memory_budget is None:
                raise ValueError("a paged KV cache needs `num_blocks` or `memory_budget`")
            num_blocks = memory_budget // self.spec.bytes_per_block(block_size, dtype or torch.float32)
            if num_blocks < 1:
                raise ValueError(f"memory_budget={memory_budget} bytes holds no {block_size}-token KV block")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []

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

    def grow(self, num_blocks: int) -> None:
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
                f"layer {layer_idx} produced keys with {key.shape[1]} heads of dim {key.shape[3]}, but the KV cache "
                f"was sized for {k_cache.shape[1]} heads of dim {k_cache.shape[3]} from the config "
                "(num_key_value_heads, head_dim); a model whose attention gets other keys than its config describes "
                "(JetMoe repeats them; other models size some layers' keys differently) cannot be paged"
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
