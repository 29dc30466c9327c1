"""Everything ``import hf_paged`` registers with Transformers."""

from __future__ import annotations

from transformers import AttentionInterface, PreTrainedModel
from transformers.generation.utils import GenerationMixin
from transformers.masking_utils import AttentionMaskInterface

from .attention import padding_mask, paged_attention_forward
from .cache import DEFAULT_BLOCK_SIZE, KVCacheSpec, PagedCache, unpaged_layer_types
from .cache.kv_storage import kv_head_dim, unserved_attention_types

ATTN_IMPLEMENTATION = "paged"
# Models whose attention does what no paged kernel computes, beyond what their config or layer types show.
UNSERVED_MODELS = {"doge": "its attention adds a mask that it computes from the input (dynamic mask attention)"}
# Tokens per row the cache `generate` builds starts with; it doubles when they run out, so a large max_length does
# not reserve its worst case up front.
INITIAL_TOKENS_PER_ROW = 512

_original_prepare_cache = GenerationMixin._prepare_cache_for_generation
_original_check_attn = PreTrainedModel._check_and_adjust_attn_implementation


def uses_paged_attention(model) -> bool:
    """Whether ``model`` runs its attention through the ``"paged"`` implementation."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
    """Give a paged model a growable `PagedCache` where Transformers would build a dynamic one."""
    paged = (
        uses_paged_attention(self) and model_kwargs.get("cache") is None and generation_config.use_cache is not False
    )
    given = model_kwargs.get("cache")
    if uses_paged_attention(self) and getattr(given, "is_compileable", False) and not isinstance(given, PagedCache):
        # Static caches (the compileable kind) hand attention every slot, filled or not, with no way to tell.
        raise NotImplementedError(
            f"{type(given).__name__}: a model with the paged attention backend keeps its KV cache in a PagedCache or, "
            "outside it, in a DynamicCache (pass cache=PagedCache(...), or none)"
        )
    implementation = generation_config.cache_implementation
    if paged and implementation not in (None, "dynamic"):
        raise NotImplementedError(
            f"cache_implementation={implementation!r}: a model with the paged attention backend keeps its KV cache in "
            "a PagedCache (leave cache_implementation unset, or pass cache=PagedCache(...))"
        )
    # A hybrid model keeps Transformers' own cache: its attention layers then attend without paging.
    if not (paged and self._supports_default_dynamic_cache()) or unpaged_layer_types(self.config):
        return _original_prepare_cache(self, generation_config, model_kwargs, generation_mode, batch_size,
                                       max_cache_length)
    rows = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1) * batch_size
    blocks_per_row = -(-min(max_cache_length, INITIAL_TOKENS_PER_ROW) // DEFAULT_BLOCK_SIZE) + 1
    model_kwargs["cache"] = PagedCache(
        self.config, num_blocks=rows * blocks_per_row, block_size=DEFAULT_BLOCK_SIZE, dtype=self.dtype,
        device=self.device, growable=True, spec=KVCacheSpec.from_model(self),
    )


def reaches_paged_attention(model_class) -> bool:
    """Whether ``model_class``'s attention layers call Transformers' attention interface, where "paged" plugs in (a
    model may not declare it: Falcon; Transformers' own source check decides then)."""
    if getattr(model_class, "_supports_attention_backend", False):
        return True
    return getattr(model_class, "_can_set_attn_implementation", lambda: True)()


def switch_to_paged_attention(model, role: str = "") -> None:
    """Run ``model``'s attention through "paged" (an engine's model; ``role`` prefixes the error)."""
    if not reaches_paged_attention(type(model)):
        raise ValueError(f"{role}{type(model).__name__} does not run its attention through Transformers' attention "
                         "interface, so the paged backend cannot serve it")
    if not uses_paged_attention(model):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
    """Refuse ``"paged"`` for a model whose attention it cannot reach, or whose keys and values it cannot hold, when
    the model is built (Transformers accepts any registered implementation for any model)."""
    applied = _original_check_attn(self, attn_implementation, *args, **kwargs)
    if applied == ATTN_IMPLEMENTATION:
        if not reaches_paged_attention(type(self)):  # Bloom, MPT: their attention is computed in the module itself
            raise NotImplementedError(f"{type(self).__name__} computes its attention itself, not through Transformers' "
                                      "attention interface, so attn_implementation='paged' cannot serve it")
        text = self.config.get_text_config(decoder=True)
        if getattr(text, "qk_nope_head_dim", None) is not None:
            kv_head_dim(text)
        if text.model_type in UNSERVED_MODELS:
            raise NotImplementedError(f"{type(self).__name__}: {UNSERVED_MODELS[text.model_type]}, which paged "
                                      "attention does not apply")
        unserved = unserved_attention_types(text)
        if unserved:
            raise NotImplementedError(f"{type(self).__name__} has {unserved} layers, whose attention pattern (chunks "
                                      "of the context, or a selection of its keys) no paged kernel computes")
        decoder = all(getattr(text, name, None) is not None for name in ("num_attention_heads", "num_hidden_layers"))
        if decoder and not unpaged_layer_types(text):  # not an encoder of other inputs (Phi-4-multimodal's audio)
            KVCacheSpec.from_config(text)  # keys and values of one shape in every layer
    return applied


def register() -> None:
    """Register ``"paged"`` as an attention implementation, with its mask function and `generate` cache."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
    GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
    PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation
