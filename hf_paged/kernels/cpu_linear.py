"""Linear layers on CPU through oneDNN, with each weight packed once into oneDNN's blocked layout, and through the
native matrix-vector kernel (`cpu_decoder.linear`) at one to eight rows.

A plain ``nn.Linear`` on CPU calls MKL's GEMM, which re-packs the weight on every call. At decode batch sizes that
packing is a large part of the work: on a 2-core AVX-512 machine, SmolLM2-135M's 49152-row output projection takes
33 ms at 64 rows through ``F.linear`` and 17 ms with the weight packed once. `prepack_linear_layers` switches every
plain ``nn.Linear`` of a model to `PrepackedLinear`, which keeps such a packed copy beside the weight. The module
keeps its weight, its ``state_dict`` and ``isinstance(module, nn.Linear)``; the cost is the memory of the linear
weights once more. At one to eight rows a product only streams the weight, and the native kernel, reading the plain
weight, streams it faster than oneDNN (SmolLM2's linear layers: 1.5x at one row, 1.2x at eight). Results match
``F.linear`` to rounding (a different summation order), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from torch.nn import functional as F

from . import cpu_decoder

__all__ = ["PrepackedLinear", "available", "prepack_linear_layers", "unpack_linear_layers"]

_DTYPES = (torch.float32, torch.bfloat16)


def _linear_pointwise(*args):
    # The resolved overload: calling it skips the operator packet's overload lookup (a few microseconds a call).
    return torch.ops.mkldnn._linear_pointwise.default(*args)


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and CPU can run packed oneDNN linear layers in ``dtype``."""
    if dtype not in _DTYPES or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PrepackedLinear(nn.Linear):
    """An ``nn.Linear`` whose CPU inference forward multiplies by a oneDNN-packed copy of its weight.

    The copy is rebuilt when the weight changes (in place or replaced; an inference-mode weight changed in place is not
    noticed). With autograd recording, under autocast, on another device, in another dtype than fp32/bf16, or for an
    input of another dtype, the forward is plain ``F.linear``.
    """

    _packed: torch.Tensor | None = None
    _packed_from: tuple[int, int] | None = None
    _packed_source: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        # The packed copy is opaque to copy and pickle; a copy packs its own on its first forward.
        state = self.__dict__.copy()
        for name in ("_packed", "_packed_from", "_packed_source"):
            state.pop(name, None)
        return state

    def _pack(self) -> torch.Tensor | None:
        """The packed copy of the current weight, or None where oneDNN cannot pack it (bf16 on CPUs without
        AVX-512 or AVX-NE-CONVERT, say after ``model.to(torch.bfloat16)``): then the forward is plain ``F.linear``."""
        weight = self.weight
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        if self._packed_from != key:
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            except (RuntimeError, NotImplementedError):
                self._packed = None
            self._packed_from = key
            # Its storage is kept while the key names its address: a weight given later cannot take that address.
            self._packed_source = weight.detach()
        return self._packed

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # Kept lean: a decode step calls this for every linear layer, and at one row the checks and the operator
        # lookup cost as much as a small layer's multiply.
        weight = self.weight
        if (
            input.is_cpu
            and weight.is_cpu
            and input.dtype == weight.dtype
            and weight.dtype in _DTYPES
            and not (torch.is_grad_enabled() and (weight.requires_grad or input.requires_grad))
            and not torch.is_autocast_enabled("cpu")
        ):
            if cpu_decoder.linear_fits(input, weight, self.bias):
                return cpu_decoder.linear(input, weight, self.bias)
            packed = self._pack()
            if packed is not None:
                return _linear_pointwise(input, packed, self.bias, "none", [], "")
        return F.linear(input, weight, self.bias)


def prepack_linear_layers(model: nn.Module, keep_plain: Collection[nn.Module] = ()) -> int:
    """Turn every plain CPU ``nn.Linear`` of ``model`` in a supported dtype into a `PrepackedLinear`, packing now.

    Subclasses of ``nn.Linear``, weights that are tensor subclasses (quantized layers of either kind) and the layers in
    ``keep_plain`` are left alone. The model stays packed after the caller is done with it; `unpack_linear_layers`
    frees the copies. Returns how many layers changed.
    """
    count = 0
    kept = set(map(id, keep_plain))
    for module in model.modules():
        if type(module) is not nn.Linear or type(module.weight.data) is not torch.Tensor or id(module) in kept:
            continue
        weight = module.weight
        if weight.device.type != "cpu" or not available(weight.dtype):
            continue
        module.__class__ = PrepackedLinear
        if module._pack() is None:  # a weight oneDNN cannot take: leave the layer plain
            _unpack(module)
            continue
        count += 1
    return count


def unpack_linear_layers(model: nn.Module) -> int:
    """Undo `prepack_linear_layers`: plain ``nn.Linear`` again, packed copies dropped. Returns how many changed."""
    count = 0
    for module in model.modules():
        if type(module) is PrepackedLinear:
            _unpack(module)
            count += 1
    return count


def _unpack(module: PrepackedLinear) -> None:
    module.__class__ = nn.Linear
    for name in ("_packed", "_packed_from", "_packed_source"):
        module.__dict__.pop(name, None)
