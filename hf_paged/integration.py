"""Everything ``import hf_paged`` registers with Transformers."""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface

from .attention import padding_mask, paged_attention_forward
from .cache.paged_cache import PagedCache

ATTN_IMPLEMENTATION = "paged"
DEFAULT_BLOCK_SIZE = 16

_original_prepare_cache = GenerationMixin._prepare_cache_for_generation


def uses_paged_attention(model) -> bool:
    """Whether ``model`` runs its attention through the ``"paged"`` implementation."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
    """Give a paged model a `PagedCache` sized for this `generate` call where Transformers would build a dynamic one."""
    paged = (
        uses_paged_attention(self) and model_kwargs.get("cache") is None and generation_config.use_cache is not False
    )
    implementation = generation_config.cache_implementation
    if paged and implementation not in (None, "dynamic"):
        raise NotImplementedError(
            f"cache_implementation={implementation!r}: a model with the paged attention backend keeps its KV cache in "
            "a PagedCache (leave cache_implementation unset, or pass cache=PagedCache(...))"
        )
    if not (paged and self._supports_default_dynamic_cache()):
        return _original_prepare_cache(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
    blocks_per_row = -(-max_cache_length // DEFAULT_BLOCK_SIZE) + 1
    model_kwargs["cache"] = PagedCache(
        self.config, num_blocks=rows * blocks_per_row, block_size=DEFAULT_BLOCK_SIZE, dtype=self.dtype,
        device=self.device, growable=True,
    )


def register() -> None:
    """Register ``"paged"`` as an attention implementation, with its mask function and `generate` cache."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
