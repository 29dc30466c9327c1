"""`NativeDecoder`: the decode steps of Llama-family models on CPU in one native call (``kernels/cpu_decoder.cpp``).

At a few tokens a step reads every weight once for very little arithmetic, and the Transformers forward spends as
long again in Python and small tensor ops between its linear layers. For the decoder layers it recognises exactly
(Llama, Mistral, Qwen2 and Qwen3 in Transformers, as loaded: plain linear layers, RMSNorm, SiLU MLP, rotary
embeddings), the native decoder runs the whole layer stack, stores and attends through the same paged kernel, and
returns the sampled rows' logits. It multiplies by its own copy of the linear weights, packed in panels for its products
(`cpu_decoder.pack`: the memory of those weights once more) and packed again whenever a weight moves or changes; norms
and biases are read where they are. The embedding and the rotary tables still come from the model's own modules, so
every rope variant Transformers implements is honoured. Each elementwise step rounds where Transformers rounds; only
summation orders differ, as they do between any two matrix-multiply kernels, and SiLU's exponential (vectorised, within
1 ulp, as torch's own is). Steps with LoRA-adapted tokens run natively too: each layer adds each token's adapter's
product as PEFT's LoRA layer does (`hf_paged.lora`), so long as the adapters change only the layers' linear layers.

Anything else (another architecture, a quantized, tensor-parallel or modified layer, a KV cache in another dtype, no
C++ compiler) is not recognised and runs through the Transformers forward, as do steps of more than `max_tokens`
tokens (prompts included): 512 where the panel products, 8 rows per pass over each panel, beat the oneDNN forward up
to there, 160 in fp32 on CPUs with AVX2 alone (`cpu_decoder.faster_tokens`). Steps taken while a forward hook, or an
instance's own ``forward``, is on a module it stands in for run through the Transformers forward as well; parameters
and modules replaced after the engine was built are read again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from .cache import PagedKVStorage, PagedMetadata
from .kernels import cpu_decoder, cpu_ops
from .kernels.cpu_linear import PrepackedLinear
from .lora import LoRAStep

logger = logging.getLogger(__name__)

# The models whose decoder layers' forward is Llama's (pre-norm residual attention and SiLU MLP): the classes of
# their causal LM, base model, decoder layer, RMSNorm, MLP and attention, each recognised only exactly.
_FAMILIES = {
    family: tuple(f"{prefix}{part}" for part in ("ForCausalLM", "Model", "DecoderLayer", "RMSNorm", "MLP", "Attention"))
    for family, prefix in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))
}
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = frozenset({"q_norm", "k_norm"})  # per-head norms of queries and keys, Qwen3's only


@dataclass(frozen=True)
class _Classes:
    causal_lm: type
    model: type
    layer: type
    norm: type
    mlp: type
    attention: type
    qk_norms: frozenset[str]  # the attention's norm children


def _classes(family: str) -> _Classes | None:
    import importlib

    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None
    found = [getattr(module, name, None) for name in _FAMILIES[family]]
    return None if None in found else _Classes(*found, qk_norms=_QK_NORMS if family == "qwen3" else frozenset())


_structure_changes = 0  # parameters and submodules set on a watched module since the first decoder was built
_watched: set[int] = set()  # ids of the modules of models a decoder runs (an id reused later costs one recheck)


def _count_structure_change(module: nn.Module, *_) -> None:  # a registration hook: None registers the value given
    # Only the models' own modules count: Transformers' forwards slice their layer lists into new ModuleLists.
    global _structure_changes
    if id(module) in _watched:
        _structure_changes += 1


def _watch_structure() -> None:
    """Count every parameter or module set on a watched module from now on (torch's global registration hooks)."""
    if _count_structure_change not in nn.modules.module._global_parameter_registration_hooks.values():
        nn.modules.module.register_module_parameter_registration_hook(_count_structure_change)
        nn.modules.module.register_module_module_registration_hook(_count_structure_change)


class Unsupported(Exception):
    """Why a model's decode steps run through the Transformers forward."""


def _held(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor's current storage, kept alive for the native decoder's pointers even if the parameter is later given
    other data (as ``model.to()`` does)."""
    return None if tensor is None else tensor.detach()


def _norm(norm: nn.Module, dtype: torch.dtype, where: str) -> torch.Tensor:
    """An RMSNorm's weight, read in place by the native call."""
    weight = norm.weight
    if weight.dtype != dtype or not weight.is_contiguous() or not weight.is_cpu:
        raise Unsupported(f"{where} is not a contiguous CPU {dtype} weight")
    return _held(weight)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    try:
        return cpu_decoder.pack(weight.detach())
    except ValueError as reason:  # a layout the panels do not take
        raise Unsupported(str(reason)) from None


def _linear(module: nn.Module, dtype: torch.dtype, where: str) -> nn.Module:
    if type(module) not in (nn.Linear, PrepackedLinear) or type(module.weight.data) is not torch.Tensor:
        raise Unsupported(f"{where} is a {type(module).__name__}, not a plain linear layer")
    for tensor in (module.weight, module.bias):
        if tensor is not None and (tensor.dtype != dtype or not tensor.is_contiguous() or not tensor.is_cpu):
            raise Unsupported(f"{where} is not a contiguous CPU {dtype} layer")
    return module


class NativeDecoder:
    """A recognised model's weights, bound to the engine's KV storage; `forward` runs steps of up to
    `cpu_decoder.MAX_TOKENS` tokens, and the engine gives it those of at most `max_tokens`, the sizes it runs faster
    than the Transformers forward. Built by `NativeDecoder.for_model`, which returns None for anything it does not
    recognise."""

    def __init__(self, model: nn.Module, kv: PagedKVStorage, weights: cpu_decoder.DecoderWeights):
        self.model = model
        self.max_tokens = cpu_decoder.faster_tokens(model.dtype)
        self.kv = kv
        self.embed = model.get_input_embeddings()
        self.rotary = model.base_model.rotary_emb
        self.gone = False  # the model no longer fits, for good
        _watch_structure()
        self._bind(weights)

    @property
    def takes_whole_steps(self) -> bool:
        """Whether it is the faster for steps of every size it runs (up to `cpu_decoder.MAX_TOKENS`): prompts then
        compute faster in its steps than in longer Transformers forwards. Not for fp32 on CPUs with AVX2 and no
        AVX-512, where oneDNN is the faster on prompts (see `cpu_decoder.faster_tokens`)."""
        return self.max_tokens == cpu_decoder.MAX_TOKENS

    def linear_layers(self) -> list[nn.Module]:
        """The linear layers whose products the decoder computes with its own packed copy of their weights."""
        weights = set(map(id, self.weights.packed_from))
        return [m for m in self.model.modules() if isinstance(m, nn.Linear) and id(m.weight) in weights]

    def _bind(self, weights: cpu_decoder.DecoderWeights) -> None:
        self.weights = weights  # keeps the tensors the native structures point into alive
        self._struct, self._layers = weights.struct()
        # The packed weights' in-place changes show in their versions (not an inference tensor's). Their storage is
        # kept, so that no weight the model is given later (by ``.to()``, say) can take the same address unnoticed.
        self._sources = [w for w in weights.packed_from if not w.is_inference()]
        self._kept = [w.detach() for w in weights.packed_from]
        self._parameters = list(self.model.parameters())
        self._at = self._addresses()
        self._seen, self._shape = _structure_changes, self._structure()
        _watched.update(map(id, self.model.modules()))
        base = self.model.base_model  # the modules whose forward the native call stands in for
        standing_in = [self.model, base, base.norm, self.model.get_output_embeddings(), *base.layers.modules()]
        self._hook_dicts = [(m._forward_hooks, m._forward_pre_hooks, m.__dict__) for m in standing_in]
        names = {id(module): name for name, module in self.model.named_modules()}
        self._linear_names = tuple(tuple(names[id(module)] for module in _linears(layer)) for layer in base.layers)

    def _addresses(self) -> tuple[int, ...]:
        # Converting a model or a part of it (``.to()``, ``.half()``) gives parameters new storage; an in-place change
        # (``load_state_dict``, say) moves a packed weight's version on. (A change through ``.data`` shows neither.)
        return (*map(torch.Tensor.data_ptr, self._parameters), *(w._version for w in self._sources))

    def _structure(self) -> tuple[int, ...]:
        """Which modules and parameters the model is made of (replacing one changes it)."""
        return (*map(id, self.model.modules()), *map(id, self.model.parameters()))

    def _changed(self) -> bool:
        if _structure_changes != self._seen:  # something, somewhere, was given a parameter or module
            self._seen = _structure_changes
            if self._structure() != self._shape:
                return True
        return self._addresses() != self._at

    def _hooked(self) -> bool:
        """Whether a forward hook, or an instance's own ``forward``, is on a module the native call stands in for:
        only the Transformers forward runs them."""
        module_hooks = nn.modules.module
        if module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks:
            return True
        return any(hooks or pre_hooks or "forward" in own for hooks, pre_hooks, own in self._hook_dicts)

    def ready(self) -> bool:
        """Whether the decoder runs the model's next step: not while `_hooked`; its weights are packed again if
        parameters or modules were replaced, moved or changed, and it is ``gone`` for good once the model no longer
        fits (converted to another dtype or device, say)."""
        if self._changed():
            try:
                self._bind(self._weights(self.model, self.kv))
            except Unsupported as reason:
                logger.info("hf_paged: the model changed, decode steps now run the Transformers forward: %s", reason)
                self.gone = True
                return False
        return not self._hooked()

    # -------------------------------------------------------------------------------------------- recognition
    @classmethod
    def for_model(cls, model: nn.Module, kv: PagedKVStorage) -> "NativeDecoder | None":
        try:
            return cls(model, kv, cls._weights(model, kv))
        except Unsupported as reason:
            logger.info("hf_paged: decode steps run through the Transformers forward: %s", reason)
            return None

    @classmethod
    def _weights(cls, model: nn.Module, kv: PagedKVStorage) -> cpu_decoder.DecoderWeights:
        config = model.config.get_text_config(decoder=True)
        family = getattr(config, "model_type", None)
        if family not in _FAMILIES:
            raise Unsupported(f"no native decoder for model type {family!r}")
        classes = _classes(family)
        base = model.base_model
        if classes is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
            raise Unsupported(f"this Transformers version's {family} modules are not the ones the native decoder knows")
        if type(model) is not classes.causal_lm or type(base) is not classes.model:
            raise Unsupported(f"{type(model).__name__} is not an unmodified {classes.causal_lm.__name__}")
        dtype = model.dtype
        if model.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise Unsupported("the native decoder runs fp32 and bf16 models on CPU")
        if getattr(model, "_tp_size", None) not in (None, 1):
            raise Unsupported("the model is split over tensor-parallel ranks")
        if not kv.key_cache or kv.dtype != dtype:
            raise Unsupported("the KV cache's dtype is not the model's")
        if not (cpu_decoder.available() and cpu_ops.available()):
            raise Unsupported("the native CPU library is not available")
        if type(base.norm) is not classes.norm or len(base.layers) != len(kv.key_cache):
            raise Unsupported("the model's final norm or layer count is not Llama's")
        lm_head = _linear(model.get_output_embeddings(), dtype, "the output projection")
        # Mistral's attention reads its window from the config
        window = getattr(config, "sliding_window", None) if family == "mistral" else None
        layers = [cls._layer(layer, i, classes, dtype, window, kv) for i, layer in enumerate(base.layers)]
        packed_from = [lm_head.weight] + [w for layer in layers for w in layer.pop("packed_from")]
        eps = {base.norm.variance_epsilon, *(e for layer in layers for e in layer.pop("eps"))}
        if len(eps) != 1:
            raise Unsupported("the model's norms use different epsilons")
        first = base.layers[0].self_attn
        mlp = base.layers[0].mlp
        return cpu_decoder.DecoderWeights(
            layers=layers, final_norm=_norm(base.norm, dtype, "the final norm"), lm_head=_packed(lm_head.weight),
            lm_head_bias=_held(lm_head.bias), packed_from=packed_from, hidden_size=mlp.gate_proj.in_features,
            intermediate_size=mlp.gate_proj.out_features, vocab_size=lm_head.out_features,
            num_heads=config.num_attention_heads, num_kv_heads=kv.spec.num_kv_heads, head_dim=first.head_dim,
            eps=eps.pop(),
        )

    @staticmethod
    def _layer(layer: nn.Module, index: int, classes: _Classes, dtype: torch.dtype, config_window: int | None,
               kv: PagedKVStorage) -> dict:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer) is not classes.layer or {n for n, _ in layer.named_children()} != _LAYER_CHILDREN:
            raise Unsupported(f"layer {index} is not an unmodified {classes.layer.__name__}")
        children = {n for n, _ in attn.named_children()}
        if (type(attn) is not classes.attention or children != _ATTENTION_CHILDREN | classes.qk_norms
                or type(mlp) is not classes.mlp):
            raise Unsupported(f"layer {index}'s attention or MLP is not the one the native decoder knows")
        norms = {"input_norm": layer.input_layernorm, "post_norm": layer.post_attention_layernorm,
                 **{name: getattr(attn, name) for name in sorted(classes.qk_norms)}}
        silu = type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU")
        if any(type(norm) is not classes.norm for norm in norms.values()) or not silu:
            raise Unsupported(f"layer {index}'s norms or activation are not RMSNorm and SiLU")
        entry = {"eps": [norm.variance_epsilon for norm in norms.values()],
                 **{name: _norm(norm, dtype, f"layer {index}'s {name}") for name, norm in norms.items()}}
        for name, module in zip(cpu_decoder.LINEARS, _linears(layer)):
            linear = _linear(module, dtype, f"layer {index}'s {name} projection")
            entry[name], entry[f"{name}_bias"] = _packed(linear.weight), _held(linear.bias)
            entry.setdefault("packed_from", []).append(linear.weight)
        if attn.head_dim > cpu_decoder.MAX_HEAD_DIM:
            raise Unsupported(f"layer {index}'s heads are of dim {attn.head_dim}, more than the native decoder's "
                              f"{cpu_decoder.MAX_HEAD_DIM}")
        k_cache = kv.key_cache[index]
        if attn.head_dim != k_cache.shape[3] or attn.k_proj.weight.shape[0] != k_cache.shape[1] * attn.head_dim:
            raise Unsupported(f"layer {index}'s key heads do not match the KV cache")
        entry.update(k_cache=k_cache.transpose(1, 2), v_cache=kv.value_cache[index].transpose(1, 2),
                     scale=attn.scaling, sliding_window=getattr(attn, "sliding_window", config_window))
        return entry

    # ---------------------------------------------------------------------------------------------- one step
    def takes(self, lora: LoRAStep | None) -> bool:
        """Whether it runs a step of these adapters: they change only the linear layers of its decoder layers."""
        return lora is None or self._lora_layers(lora) is not None

    def _lora_layers(self, lora: LoRAStep) -> cpu_decoder.LoraLayers | None:
        built, key = lora.built(), ("native decoder", self._linear_names)
        if key not in built:
            covered = {name for layer in self._linear_names for name in layer}
            changed = {name for adapter, _ in lora.groups for name in adapter.layers}
            built[key] = None if not changed <= covered else cpu_decoder.LoraLayers(
                [dict(zip(cpu_decoder.LINEARS, map(lora.stacked, layer))) for layer in self._linear_names])
        return built[key]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, metadata: PagedMetadata,
                sample_rows: torch.Tensor, prompt_lens: torch.Tensor | None = None,
                lora: LoRAStep | None = None) -> torch.Tensor:
        """Logits ``[len(sample_rows), vocab]`` of the tokens ``input_ids`` ``[1, T]`` at ``position_ids``, whose keys
        and values are stored in the slots ``metadata`` names (as the Transformers forward would store them).
        ``prompt_lens`` (int32, per sequence) marks its prompt tokens (`cpu_decoder.prompt_tiles`); ``lora``, the
        tokens' adapters, if any (the decoder `takes` them)."""
        hidden = self.embed(input_ids)[0].contiguous()
        cos, sin = self.rotary(hidden, position_ids)
        adapters = None if lora is None else (self._lora_layers(lora), lora.slots())
        return cpu_decoder.decoder_forward(self._struct, hidden, cos[0].contiguous(), sin[0].contiguous(), metadata,
                                           sample_rows, prompt_lens, adapters)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's linear layers, in `cpu_decoder.LINEARS` order."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj
