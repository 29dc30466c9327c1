"""The attention function registered as ``attn_implementation="paged"``, and its mask function."""

from __future__ import annotations

import contextlib

import torch

from .cache.metadata import PagedMetadata
from .cache.paged_cache import PagedCache
from .kernels import paged_attention
from .kernels.torch_ops import dense_attention

# Keyword arguments some models pass for attention features the paged kernels do not implement.
_UNSUPPORTED_KWARGS = {"position_bias": "an additive position bias"}
_SINKS_KWARGS = ("s_aux", "sinks")  # attention sinks, one logit per query head (gpt-oss passes s_aux)


def _closure_value(function, name: str):
    cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
    return cells[name].cell_contents if name in cells else None


def is_causal_pattern(mask_function) -> bool:
    """Whether a Transformers mask function is the causal pattern, alone or cut by a sliding window: the patterns the
    kernels apply themselves. Packed sequences, bidirectional blocks (image tokens), chunked attention and custom
    mask functions are not."""
    name = getattr(mask_function, "__qualname__", "")
    if name == "causal_mask_function":
        return True
    if name != "and_masks.<locals>.and_mask":
        return False
    parts = _closure_value(mask_function, "mask_functions") or ()
    names = [getattr(part, "__qualname__", "") for part in parts]
    return "causal_mask_function" in names and all(
        n in ("causal_mask_function", "sliding_window_overlay.<locals>.inner_mask") for n in names
    )


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function for ``"paged"``: the 2-D padding mask ``[batch, kv_length]``, or None when nothing is padding.

    Causality, sliding windows and sequence boundaries are handled by the kernels, so no 4-D mask is ever built; a
    forward that asks for any other mask pattern is refused rather than run causally. A sliding-window mask
    (Transformers passes its window as ``local_size``) is always answered with a 2-D bool tensor (all True when
    nothing is padding) that carries the window to the attention function (``paged_sliding_window``,
    ``paged_is_padding``), since some models set the window only here. `tests/test_generate.py` pins both ways
    Transformers hands these to us (``test_transformers_hands_the_paged_backend_its_mask_and_window``).
    """
    if mask_function is not None and not is_causal_pattern(mask_function):
        raise NotImplementedError(
            "the paged attention backend applies causal and sliding-window masks only; this forward asks for another "
            "mask pattern (packed sequences, bidirectional blocks, chunked attention or a custom mask function)"
        )
    if getattr(attention_mask, "paged_unpadded", False):
        attention_mask = None
    elif attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
            attention_mask = None
    window = local_size
    if window is None:
        return attention_mask
    mask = attention_mask
    if mask is None:
        mask = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
    mask.paged_sliding_window = window
    mask.paged_is_padding = attention_mask is not None
    return mask


def unpadded_mask(num_tokens: int, device: torch.device) -> torch.Tensor:
    """The ``attention_mask`` of the engine's packed steps, ``[1, num_tokens]``, all True and marked so, so that
    `padding_mask` need not read it: reading it costs a device-to-host sync every step, which no CUDA graph can hold.
    Transformers must get some mask: without one it reads the restarting positions as packed sequences."""
    mask = torch.ones(1, num_tokens, dtype=torch.bool, device=device)
    mask.paged_unpadded = True
    return mask


def _check_supported(module: torch.nn.Module, attention_mask, dropout: float, kwargs: dict) -> None:
    for name, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the paged attention backend does not support {feature} "
                                      f"({type(module).__name__})")
    if not getattr(module, "is_causal", True):
        raise NotImplementedError("the paged attention backend supports causal attention only "
                                  f"({type(module).__name__})")
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "the paged attention backend does not compute attention weights (output_attentions); load the model with "
            "attn_implementation='eager' to get them"
        )
    if dropout and module.training:
        raise NotImplementedError("the paged attention backend is for inference: attention dropout is not supported")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(
            f"the paged attention backend takes a 2-D padding mask, got a {attention_mask.dim()}-D attention mask"
        )


def _claim_layer(module: torch.nn.Module, metadata: PagedMetadata, key: torch.Tensor) -> int:
    """The layer whose blocks this attention call writes: each layer once a forward (its keys carry it on to the
    layers that reuse them, in Gemma3n)."""
    if module.layer_idx in metadata.layers_written:
        raise NotImplementedError(
            f"{type(module).__name__}: layer {module.layer_idx}'s attention ran twice in one forward (differential "
            "attention, or one module reused for several layers); the paged KV cache holds one set of keys and values "
            "per layer")
    metadata.layers_written.add(module.layer_idx)
    if metadata.kv.spec.num_shared_layers:
        key.paged_source = (metadata, module.layer_idx)
    return module.layer_idx


class _NoGradients(torch.autograd.Function):
    """The paged kernels read keys and values back from the blocks, outside autograd: an output that would carry
    gradients carries this instead, whose backward refuses (the forward's values are right)."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("no gradients flow through the paged KV cache: run a forward that needs them "
                                  "without a PagedCache (no cache, or use_cache=False)")


def _contiguous_attention(query, key, value, attention_mask, scale, sliding_window, softcap, sinks):
    """Attention without a PagedCache (a plain forward, or `generate(use_cache=False)`)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    last_key = torch.arange(kv_len - q_len, kv_len, device=query.device).unsqueeze(1)
    key_pos = torch.arange(kv_len, device=query.device).unsqueeze(0)
    mask = key_pos <= last_key
    if sliding_window is not None:
        mask = mask & (key_pos > last_key - sliding_window)
    mask = mask[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -kv_len:]
    mask = mask | ~mask.any(dim=-1, keepdim=True)  # padding queries see nothing; keep them finite
    out = dense_attention(query, key, value, mask, scale, softcap, sinks)
    return out.transpose(1, 2).contiguous()


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    paged_metadata: PagedMetadata | None = None,
    paged_cache: PagedCache | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Write the new keys/values into their blocks and attend through the block tables.

    The step's blocks come as ``paged_metadata`` (a forward argument of the continuous-batching engine) or are planned
    by ``paged_cache`` (the `PagedCache` that `generate` passes, which puts itself here from `Cache.update`, or on
    ``key`` where the model gives `update` no kwargs).
    ``query`` is ``[B, Hq, S, D]`` and ``key``/``value`` ``[B, Hkv, S, D]`` (the new tokens only); returns
    ``[B, S, Hq, D]`` as Transformers' attention functions do.
    """
    _check_supported(module, attention_mask, dropout, kwargs)
    if hasattr(attention_mask, "paged_sliding_window"):  # the mask's window is what eager and sdpa would apply
        sliding_window = attention_mask.paged_sliding_window
        if not attention_mask.paged_is_padding:
            attention_mask = None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = next((kwargs[name] for name in _SINKS_KWARGS if kwargs.get(name) is not None), None)
    batch, num_heads, q_len, head_dim = query.shape
    paged_cache = paged_cache if paged_cache is not None else getattr(key, "paged_cache", None)
    if paged_metadata is None and paged_cache is not None:
        paged_metadata = paged_cache.step_metadata(batch, q_len, attention_mask)
    source = getattr(key, "paged_source", None)
    if source is not None:
        # A layer reusing another layer's keys and values (Gemma3n) attends to that layer's blocks; storing them
        # there again rewrites the same values into the same slots.
        paged_metadata, layer_idx = source
    elif paged_metadata is None:
        return _contiguous_attention(query, key, value, attention_mask, scale, sliding_window, softcap, sinks), None
    else:
        layer_idx = _claim_layer(module, paged_metadata, key)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    with torch.no_grad() if grad else contextlib.nullcontext():  # the blocks stay out of any autograd graph
        k_cache, v_cache = paged_metadata.kv.layer(layer_idx, key)
        q, k, v = (x.transpose(1, 2).reshape(batch * q_len, x.shape[1], head_dim) for x in (query, key, value))
        out = paged_attention(q, k, v, k_cache, v_cache, paged_metadata, scale, sliding_window, softcap, sinks)
    if grad:
        out = _NoGradients.apply(out, query, key, value)
    return out.view(batch, q_len, num_heads, head_dim), None
