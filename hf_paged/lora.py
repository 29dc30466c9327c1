"""LoRA adapters served beside the base model, as vLLM serves them: each request may name one (`LoRARequest`), and
one step runs requests of several adapters and of none.

An adapter is a PEFT directory (``adapter_config.json`` and ``adapter_model.safetensors``): for each linear layer it
targets, ``A [r, in]``, ``B [out, r]`` and ``scale`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA), so that the
layer computes ``base(x) + (x A^T) B^T * scale`` as PEFT does. The base weights are never changed: the native decoder
adds each token's adapter's product in its own layers (`LoRAStep.stacked`, `LoRAStep.slots`); in a step through the
Transformers forward that holds adapted tokens, a forward hook on each targeted layer adds each adapter's product to
its own tokens' rows (`LoRAStep.applied`). Keys and values computed under an adapter are cached apart from the base
model's and other adapters' (`LoRAAdapter.cache_salt`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from .kernels.cpu_linear import PrepackedLinear

__all__ = ["LoRAAdapter", "LoRAAdapters", "LoRARequest", "LoRAStep"]

# adapter_config.json fields that change what the adapter computes beyond ``base(x) + B(A(x)) * scale``, by value
# that is not served
_UNSERVED = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "fan_in_fan_out": "Conv1D layers (fan_in_fan_out)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "layer_replication": "replicated layers (layer_replication)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
}
# init_lora_weights that change the base weights the adapter is trained against: served, it would add to the original
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_KEY = re.compile(r"(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>A|B)(?:\.[^.]+)?\.weight")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's ``LoRARequest``: an adapter by a name (how the server's requests choose it), a positive id unique to
    it, and its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class _Layer:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass(eq=False)
class LoRAAdapter:
    """A loaded adapter: its request and the ``(A, B, scale)`` of each module it changes, by module name."""

    request: LoRARequest
    layers: dict[str, _Layer]
    digest: bytes  # of what it computes: blocks cached under it are reused by its next load, not by other contents

    @property
    def cache_salt(self) -> bytes:
        return b"lora:" + self.digest[:16]

    @classmethod
    def load(cls, request: LoRARequest, model: nn.Module, max_rank: int) -> "LoRAAdapter":
        """Read ``request.lora_path`` for ``model``; ``ValueError`` names what does not fit."""
        where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
        try:
            return cls._read(request, model, max_rank, where)
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever a malformed adapter trips on is the adapter's fault
            raise ValueError(f"{where}: cannot be read: {type(err).__name__}: {err}") from err

    @classmethod
    def _read(cls, request: LoRARequest, model: nn.Module, max_rank: int, where: str) -> "LoRAAdapter":
        config = read_adapter_config(request.lora_path, where)
        pairs = _pairs(_read_weights(request.lora_path, where), where)
        output, digest = model.get_output_embeddings(), hashlib.sha256()
        layers = {}
        for name, pair in sorted(pairs.items()):
            target = _module_name(model, name, where)
            module = model.get_submodule(target)
            if module is output:  # its forward sees only the sampled rows
                raise ValueError(f"{where}: LoRA on the output layer ({name}) is not served")
            layers[target] = _layer(module, name, pair, config, max_rank, where, _home(module, model))
            for part in (pair["A"], pair["B"]):
                digest.update(part.contiguous().view(torch.uint8).numpy())
            digest.update(f"{target}:{layers[target].scale!r}".encode())
        return cls(request, layers, digest.digest())

    def fits(self, model: nn.Module) -> bool:
        """Whether it was read for ``model``: each of its layers is one of the model's, of the same sizes, its tensors
        in the dtype and on the device that layer's input comes in."""
        for name, layer in self.layers.items():
            try:
                module = model.get_submodule(name)
            except AttributeError:
                return False
            sizes = getattr(module, "in_features", None), getattr(module, "out_features", None)
            if (layer.a.shape[1], layer.b.shape[0]) != sizes or (layer.a.dtype, layer.a.device) != _home(module, model):
                return False
        return True


class AdapterNotFound(ValueError):
    """No adapter at the path given (vLLM answers its load with a 404)."""


def read_adapter_config(path: str, where: str) -> dict:
    """The adapter's ``adapter_config.json``; ``ValueError`` (its message led by ``where``) for a missing or
    unreadable one, or a method or feature that is not served."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise AdapterNotFound(f"{where}: no adapter_config.json there (a PEFT LoRA adapter directory is expected)")
    try:
        with open(file) as handle:
            config = json.load(handle)
    except (OSError, ValueError) as err:
        raise ValueError(f"{where}: cannot read adapter_config.json: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{where}: adapter_config.json holds a {type(config).__name__}, not PEFT's object of fields")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(f"{where}: init_lora_weights={init!r} trained it against changed base weights; save it "
                         "as a plain LoRA first (PEFT's save_pretrained(..., path_initial_model_for_weight_conversion="
                         "...))")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: a {config['peft_type']} adapter; only LoRA is served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: trained biases (bias={config['bias']!r}) are not served")
    for key, what in _UNSERVED.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not served")
    alphas = config.get("alpha_pattern") or {}
    if not isinstance(alphas, dict) or not all(isinstance(k, str) and _is_number(v) for k, v in alphas.items()):
        raise ValueError(f"{where}: alpha_pattern must map module name patterns to numbers")
    if not _is_number(config.get("lora_alpha", 8)):
        raise ValueError(f"{where}: lora_alpha must be a number, got {config.get('lora_alpha')!r}")
    return config


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _read_weights(path: str, where: str) -> dict[str, torch.Tensor]:
    safetensors, binary = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if not os.path.isfile(safetensors) and not os.path.isfile(binary):
        raise ValueError(f"{where}: no adapter_model.safetensors or adapter_model.bin there")
    try:
        if os.path.isfile(safetensors):
            from safetensors.torch import load_file

            weights = load_file(safetensors)
        else:
            weights = torch.load(binary, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - a damaged file raises what its reader raises; the caller reads why
        raise ValueError(f"{where}: cannot read its weights: {err}") from None
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise ValueError(f"{where}: adapter_model.bin is not a dict of tensors")
    return weights


def _pairs(weights: dict[str, torch.Tensor], where: str) -> dict[str, dict[str, torch.Tensor]]:
    """``{module name: {"A": tensor, "B": tensor}}`` of PEFT's weight names."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"{where}: weight {key!r} is not a LoRA A or B matrix of a linear layer (embedding "
                             "LoRA and other PEFT methods are not served)")
        pairs.setdefault(match["module"], {})[match["part"]] = tensor
    if not pairs:
        raise ValueError(f"{where}: adapter_model holds no LoRA weights")
    return pairs


def _home(module: nn.Module, model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the layer's input: its weight's, or for a quantized layer the input embedding's."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        weight = model.get_input_embeddings().weight
    return weight.dtype, weight.device


def _module_name(model: nn.Module, name: str, where: str) -> str:
    """The model's name for the adapter's module ``name`` (saved from the causal LM, or from its base model)."""
    prefix = getattr(model, "base_model_prefix", "model")
    for candidate in (name, f"{prefix}.{name}"):
        try:
            model.get_submodule(candidate)
            return candidate
        except AttributeError:
            continue
    raise ValueError(f"{where}: the model has no module {name!r} (an adapter for another architecture?)")


def _layer(module: nn.Module, name: str, pair: dict[str, torch.Tensor], config: dict, max_rank: int,
           where: str, home: tuple[torch.dtype, torch.device]) -> _Layer:
    if set(pair) != {"A", "B"}:
        raise ValueError(f"{where}: {name} has lora_{next(iter(pair))} without lora_{'A' if 'B' in pair else 'B'}")
    a, b = pair["A"], pair["B"]
    size_in, size_out = getattr(module, "in_features", None), getattr(module, "out_features", None)
    if size_in is None or size_out is None:
        raise ValueError(f"{where}: {name} is a {type(module).__name__}, not a linear layer")
    if isinstance(module, nn.Linear) and not isinstance(module, PrepackedLinear) and \
            type(module).forward is not nn.Linear.forward:  # a router, say, whose forward returns more
        raise ValueError(f"{where}: {name} is a {type(module).__name__}, whose forward is its own, not a linear "
                         "layer's: LoRA on it is not served")
    rank = a.shape[0] if a.dim() == 2 else -1
    if rank < 1:
        raise ValueError(f"{where}: {name}'s A {tuple(a.shape)} is not a matrix of rank 1 or more")
    if b.dim() != 2 or tuple(a.shape) != (rank, size_in) or tuple(b.shape) != (size_out, rank):
        raise ValueError(f"{where}: {name}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the model's "
                         f"layer ({size_in} in, {size_out} out): an adapter for another model?")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} is above max_lora_rank ({max_rank}); raise --max-lora-rank")
    alpha = _pattern_value(config.get("alpha_pattern") or {}, name, config.get("lora_alpha", 8))
    dtype, device = home
    return _Layer(a.to(device, dtype).contiguous(), b.to(device, dtype).contiguous(),
                  float(alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank))


def _pattern_value(patterns: dict, name: str, default):
    """PEFT's per-module override: the value of the first pattern that matches the end of the module's name."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", name):
            return value
    return default


class LoRAStacks:
    """What is built from a set of adapters for its steps (each layer's adapters side by side, `LoRAStep.stacked`,
    so that the layer adds them all in two products; the native decoder's structure of them), kept across steps for
    the ``size`` most recent sets of adapters (the same ones usually run together for many steps), by the adapters'
    contents, so nothing holds a dropped adapter beyond them."""

    def __init__(self, size: int = 4):
        self.size = size
        self._sets: OrderedDict[tuple[bytes, ...], dict] = OrderedDict()

    def of(self, adapters: tuple[bytes, ...]) -> dict:
        """What was built for the set of adapters of these digests, by key (filled as steps ask)."""
        stacks = self._sets.setdefault(adapters, {})
        self._sets.move_to_end(adapters)
        if len(self._sets) > self.size:
            self._sets.popitem(last=False)
        return stacks


@dataclass
class LoRAStep:
    """Which rows of a step's ``num_tokens`` flat tokens each adapter changes: ``(adapter, rows)``, rows None for
    all of them."""

    num_tokens: int
    groups: list[tuple[LoRAAdapter, torch.Tensor | None]]
    stacks: LoRAStacks = field(default_factory=LoRAStacks)

    @classmethod
    def of(cls, adapters: list[LoRAAdapter | None], lengths: list[int], device: torch.device,
           stacks: LoRAStacks | None = None) -> "LoRAStep | None":
        """The step of spans of ``lengths`` tokens, each of ``adapters[i]`` (None: the base model); None when no
        span has one."""
        stacks = stacks or LoRAStacks()
        if not any(adapters):
            return None
        # Grouped by what they compute (an adapter loaded again, or under two names, is one group).
        if len({None if adapter is None else adapter.digest for adapter in adapters}) == 1:
            return cls(sum(lengths), [(adapters[0], None)], stacks)
        rows: dict[bytes, tuple[LoRAAdapter, list[int]]] = {}
        start = 0
        for adapter, length in zip(adapters, lengths):
            if adapter is not None:
                rows.setdefault(adapter.digest, (adapter, []))[1].extend(range(start, start + length))
            start += length
        groups = sorted(rows.values(), key=lambda group: group[0].digest)  # the stacks' order, whatever the step's
        indices = [(adapter, torch.tensor(index, dtype=torch.long, device=device)) for adapter, index in groups]
        return cls(start, indices, stacks)

    @contextmanager
    def applied(self, model: nn.Module):
        """Hooks on ``model``'s adapted layers for the duration of one forward."""
        by_module: dict[str, list[tuple[_Layer, torch.Tensor | None]]] = {}
        for adapter, rows in self.groups:
            for name, layer in adapter.layers.items():
                by_module.setdefault(name, []).append((layer, rows))
        masks: dict[tuple, torch.Tensor] = {}
        handles = [model.get_submodule(name).register_forward_hook(self._hook(name, parts, masks))
                   for name, parts in by_module.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def built(self) -> dict:
        """What is kept for this step's set of adapters (`LoRAStacks`)."""
        return self.stacks.of(tuple(adapter.digest for adapter, _ in self.groups))

    def stacked(self, name: str) -> tuple[torch.Tensor, torch.Tensor, list[int], list[float]] | None:
        """Layer ``name``'s adapters in this step side by side, in `groups` order: ``A [sum of ranks, in]``, ``B``
        transposed ``[sum of ranks, out]``, and each group's rank there (0: its adapter leaves the layer alone) and
        scale; None where no adapter changes the layer."""
        built = self.built()
        if name not in built:
            layers = [adapter.layers.get(name) for adapter, _ in self.groups]
            changing = [layer for layer in layers if layer is not None]
            built[name] = None if not changing else (
                torch.cat([layer.a for layer in changing]), torch.cat([layer.b.T for layer in changing]).contiguous(),
                [0 if layer is None else layer.a.shape[0] for layer in layers],
                [0.0 if layer is None else layer.scale for layer in layers])
        return built[name]

    def slots(self) -> torch.Tensor:
        """Each token's group (its index in `groups`), -1 for a token of the base model: int32 ``[num_tokens]``."""
        if self.groups[0][1] is None:
            return torch.zeros(self.num_tokens, dtype=torch.int32)
        slots = torch.full((self.num_tokens,), -1, dtype=torch.int32)
        for index, (_, rows) in enumerate(self.groups):
            slots[rows] = index
        return slots

    def _hook(self, name: str, parts: list[tuple[_Layer, torch.Tensor | None]], masks: dict):
        if parts[0][1] is None:  # one adapter for every token: as PEFT computes it
            return _adds_one(parts[0][0])
        layout = (parts[0][0].a.device, *((id(rows), layer.a.shape[0], layer.scale) for layer, rows in parts))
        if layout not in masks:
            masks[layout] = self._mask(parts)
        return _adds_mixed(name, *self.stacked(name)[:2], masks[layout])

    def _mask(self, parts: list[tuple[_Layer, torch.Tensor]]) -> torch.Tensor:
        """``[tokens, sum of ranks]``, fp32: each adapter's scale in its rank's columns of its own tokens' rows, else
        0."""
        mask = torch.zeros(self.num_tokens, sum(layer.a.shape[0] for layer, _ in parts), dtype=torch.float32,
                           device=parts[0][0].a.device)
        column = 0
        for layer, rows in parts:
            rank = layer.a.shape[0]
            mask[rows, column:column + rank] = layer.scale
            column += rank
        return mask


class LoRAAdapters:
    """The adapters an engine has loaded, by ``lora_int_id``, at most ``max_loaded`` of them: loading one more drops
    the least recently used (requests holding it keep it; a later one loads it again). Thread-safe."""

    def __init__(self, model: nn.Module, max_rank: int, max_loaded: int):
        self.model = model
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self._loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()  # held for the table only, never while files are read

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The loaded adapter of ``request``, loading it first if need be (``ValueError`` for one that does not fit
        the model, or an id already taken by another adapter)."""
        adapter = self._loaded_as(request)
        if adapter is not None:
            return adapter
        adapter = LoRAAdapter.load(request, self.model, self.max_rank)
        with self._lock:
            loaded = self._loaded.setdefault(request.lora_int_id, adapter)  # another thread may have loaded it
            self._loaded.move_to_end(request.lora_int_id)
            while len(self._loaded) > self.max_loaded:
                self._loaded.popitem(last=False)
        return self._loaded_as(request) or loaded

    def _loaded_as(self, request: LoRARequest) -> LoRAAdapter | None:
        with self._lock:
            adapter = self._loaded.get(request.lora_int_id)
            if adapter is None:
                return None
            if (adapter.request.lora_name, adapter.request.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {adapter.request.lora_name!r} "
                                 f"({adapter.request.lora_path}); give {request.lora_name!r} an id of its own")
            self._loaded.move_to_end(request.lora_int_id)
            return adapter

    def remove(self, lora_int_id: int) -> bool:
        with self._lock:
            return self._loaded.pop(lora_int_id, None) is not None

    def holds(self, adapter: LoRAAdapter) -> bool:
        """Whether ``adapter`` is one of those loaded here (read for this model)."""
        with self._lock:
            return any(loaded is adapter for loaded in self._loaded.values())

    def ids(self) -> set[int]:
        with self._lock:
            return set(self._loaded)


def _adds_one(layer: _Layer):
    """The forward hook that adds one adapter's ``(x A^T) B^T * scale`` to every row."""

    def hook(module, args, output):
        x = args[0].to(layer.a.dtype)
        return output + ((x @ layer.a.T) @ layer.b.T * layer.scale).to(output.dtype)

    return hook


def _adds_mixed(name: str, a: torch.Tensor, bt: torch.Tensor, mask: torch.Tensor):
    """The forward hook that adds each adapter's product to its own tokens' rows: the adapters side by side (``a``,
    and B transposed, ``bt``), each token's product masked to its adapter's columns, scaled (``mask``)."""

    def hook(module, args, output):
        x = args[0].reshape(-1, args[0].shape[-1])
        if x.shape[0] != mask.shape[0]:
            raise RuntimeError(f"LoRA: {name} ran on {x.shape[0]} rows of a {mask.shape[0]}-token step (a layer that "
                               "sees a subset of the tokens, such as an expert's), so its adapters' rows are unknown")
        h = torch.mm(x.to(a.dtype), a.T).float().mul_(mask).to(bt.dtype)  # the scale rounded once
        if output.dtype == bt.dtype:
            return torch.addmm(output.reshape(-1, output.shape[-1]), h, bt).view(output.shape)
        return output + torch.mm(h, bt).view(output.shape).to(output.dtype)

    return hook
