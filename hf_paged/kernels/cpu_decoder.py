"""Bindings of ``cpu_decoder.cpp`` (in the native library): linear layers at one to eight rows, and the decoder forward
of a Llama-family model in one call (`DecoderWeights` + `decoder_forward`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_ops, native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_ROWS = 8  # rows of one `linear` call (hf_paged_max_rows)
MAX_TOKENS = 512  # tokens of one `decoder_forward` step (hf_paged_decoder_max_tokens)
MAX_HEAD_DIM = 512  # the largest head dim `decoder_forward` takes (hf_paged_decoder_forward's check)
PANEL = 48  # output rows of one panel of a packed weight (kPanel)
_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [(name, _p) for name in (
        "input_norm", "post_norm", "q_norm", "k_norm", "q", "k", "v", "o", "gate", "up", "down",
        "q_bias", "k_bias", "v_bias", "o_bias", "gate_bias", "up_bias", "down_bias", "k_cache", "v_cache",
    )] + [("scale", _f32), ("sliding_window", _i32)]


class _Model(ctypes.Structure):
    _fields_ = [
        ("layers", _p), ("final_norm", _p), ("lm_head", _p), ("lm_head_bias", _p),
        ("c_stride_block", _i64), ("c_stride_row", _i64), ("c_stride_head", _i64),
        ("num_layers", _i32), ("hidden_size", _i32), ("intermediate_size", _i32), ("num_heads", _i32),
        ("num_kv_heads", _i32), ("head_dim", _i32), ("vocab_size", _i32), ("block_size", _i32), ("num_blocks", _i32),
        ("eps", _f32), ("dtype", _i32),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("hidden", _p), ("cos", _p), ("sin", _p), ("query_start_loc", _p), ("block_tables", _p), ("bt_stride", _i64),
        ("seq_lens", _p), ("slot_mapping", _p), ("sample_rows", _p), ("prompt_lens", _p), ("logits", _p),
        ("lora", _p), ("lora_slots", _p),
        ("num_tokens", _i32), ("num_seqs", _i32), ("bt_width", _i32), ("num_samples", _i32), ("num_threads", _i32),
    ]


class _LoraLinear(ctypes.Structure):
    _fields_ = [("a", _p), ("bt", _p), ("offsets", _p), ("ranks", _p), ("scales", _p), ("rank", _i32)]


LINEARS = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's linear layers, in the order `LoraLayers` takes them


_library: ctypes.CDLL | None = None
_linear_rows = 0  # the rows `linear_fits` takes (hf_paged_linear_rows), once the library is loaded


def _bind(library: ctypes.CDLL) -> None:
    library.hf_paged_linear.argtypes = [_p, _i64, _i32, _i64, _p, _p, _p, _i64, _i64, _i32, _i32]
    library.hf_paged_decoder_forward.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)]
    sizes = [library.hf_paged_decoder_struct_sizes(i) for i in range(4)]
    limits = library.hf_paged_max_rows(), library.hf_paged_decoder_max_tokens()
    if sizes != [ctypes.sizeof(s) for s in (_Layer, _Model, _Step, _LoraLinear)] or limits != (MAX_ROWS, MAX_TOKENS):
        raise RuntimeError("cpu_decoder.cpp and cpu_decoder.py disagree on the structures' layout")


def available() -> bool:
    """Whether the native library is built and loaded (builds it on first call)."""
    global _library, _linear_rows
    if _library is None:
        _library = native.bound(_bind)
        _linear_rows = _library.hf_paged_linear_rows() if _library is not None else 0
    return _library is not None


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def linear_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `linear` takes these and beats oneDNN at them: CPU fp32/bf16 of one dtype, contiguous weight and bias,
    contiguous rows of x, one to `linear_rows()` rows."""
    return (
        x.dtype == weight.dtype in _DTYPES
        and x.is_cpu
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous()))
        and x.shape[-1] == weight.shape[1] > 0
        and x.stride(-1) == 1
        and available()
        and 0 < x.numel() // x.shape[-1] <= _linear_rows
    )


def faster_tokens(dtype: torch.dtype) -> int:
    """The steps, in tokens, up to which `decoder_forward` beats the Transformers forward in ``dtype``: `MAX_TOKENS`,
    or 160 for fp32 on CPUs with AVX2 and no AVX-512, where oneDNN's GEMMs are faster on longer prompts (0 without the
    library)."""
    return _library.hf_paged_decoder_faster_tokens(_DTYPES[dtype]) if available() else 0


def prompt_tiles() -> bool:
    """Whether `decoder_forward` multiplies bf16 prompt tokens with AMX tiles: built for a CPU with AMX-BF16 and given
    the tile registers by the kernel. Prompts then prefill several times faster; generated tokens always take the
    vector kernels, whose sums do not depend on the batch."""
    return available() and bool(_library.hf_paged_decoder_prompt_tiles())


def linear_rows() -> int:
    """The rows up to which `linear_fits` sends products to the native kernel: `MAX_ROWS`, or 2 on CPUs with AVX2 and
    no AVX-512, where oneDNN is faster from 4 rows on (0 without the library)."""
    available()
    return _linear_rows


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a few rows, each weight row read once for all of them; the caller checks
    `linear_fits`. Each row's result is the same whatever other rows come with it."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
    status = _library.hf_paged_linear(rows.data_ptr(), rows.stride(0), rows.shape[0], rows.shape[1], weight.data_ptr(),
                                      _ptr(bias), out.data_ptr(), out.stride(0), weight.shape[0], _DTYPES[x.dtype],
                                      torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"native linear failed with status {status}")
    return out.view(*x.shape[:-1], weight.shape[0])


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` in the native decoder's layout: panels of `PANEL` output rows (N padded with zero rows),
    each ``[K, PANEL]`` in fp32 and ``[K / 2, PANEL, 2]`` in bf16 (pairs of k side by side; K must be even). A copy:
    the decoder reads it instead of the weight."""
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a bf16 weight packs only with an even number of columns, not {k}")
    padded = weight.new_zeros(-(-n // PANEL) * PANEL, k)
    padded[:n] = weight
    rows = padded.view(-1, PANEL, k)
    if weight.dtype == torch.bfloat16:
        return rows.view(-1, PANEL, k // 2, 2).transpose(1, 2).contiguous()
    return rows.transpose(1, 2).contiguous()


@dataclass
class DecoderWeights:
    """A model's tensors as the native decoder reads them (kept alive here), and its sizes; built by
    `hf_paged.native_decoder`. Per layer: norms, projections (`pack`-ed) and biases (None where absent), softmax scale,
    sliding window (0: none), and the layer's ``[num_blocks, block_size, kv_heads, head_dim]`` cache views."""

    layers: list[dict]
    final_norm: torch.Tensor
    lm_head: torch.Tensor  # packed
    lm_head_bias: torch.Tensor | None
    packed_from: list[torch.Tensor]  # the parameters the packed tensors copy
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float

    def struct(self) -> tuple[_Model, ctypes.Array]:
        first = self.layers[0]
        k_cache = first["k_cache"]
        layers = (_Layer * len(self.layers))()
        for entry, layer in zip(layers, self.layers):
            for name, _ in _Layer._fields_[:-2]:
                setattr(entry, name, _ptr(layer.get(name)))
            entry.scale, entry.sliding_window = layer["scale"], layer["sliding_window"] or 0
        model = _Model(
            ctypes.addressof(layers), self.final_norm.data_ptr(), self.lm_head.data_ptr(), _ptr(self.lm_head_bias),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            len(self.layers), self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads,
            self.head_dim, self.vocab_size, k_cache.shape[1], k_cache.shape[0], self.eps, _DTYPES[first["gate"].dtype],
        )
        return model, layers


class LoraLayers:
    """A set of LoRA adapters as `decoder_forward` reads them: for each layer's linear layers (`LINEARS`), the
    adapters that change it side by side (``A [sum of ranks, in]`` and B transposed, ``[sum of ranks, out]``, in the
    model's dtype) and where each adapter's rows are. ``layers[i][name]`` is None, or ``(A, B^T, ranks, scales)`` with
    one rank and scale per adapter of the set (rank 0: the adapter leaves the layer alone)."""

    def __init__(self, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor, list[int], list[float]] | None]]):
        self.layers = layers
        self.array = (_LoraLinear * (len(layers) * len(LINEARS)))()
        self._kept = []
        stacks = (layer[name] for layer in layers for name in LINEARS)
        for index, stacked in enumerate(stacks):
            if stacked is None:
                continue
            a, bt, ranks, scales = stacked
            offsets = [sum(ranks[:i]) for i in range(len(ranks))]
            tensors = (a, bt, torch.tensor(offsets, dtype=torch.int32),
                       torch.tensor(ranks, dtype=torch.int32), torch.tensor(scales, dtype=torch.float32))
            self._kept += tensors
            self.array[index] = _LoraLinear(*(t.data_ptr() for t in tensors), a.shape[0])


def decoder_forward(model: _Model, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metadata,
                    sample_rows: torch.Tensor, prompt_lens: torch.Tensor | None = None,
                    lora: tuple[LoraLayers, torch.Tensor] | None = None) -> torch.Tensor:
    """Run every layer on ``hidden`` ``[T, hidden_size]`` (the tokens' embeddings, overwritten) with the rotary
    ``cos``/``sin`` ``[T, head_dim]`` and the step's `PagedMetadata`, storing the new keys and values in the cache;
    returns the logits ``[len(sample_rows), vocab]`` of the rows ``sample_rows`` (int64). ``prompt_lens`` (int32, one
    per sequence) marks the tokens at lower positions as prompt tokens, which bf16 multiplies with AMX tiles where the
    CPU has them (see `prompt_tiles`). ``lora``: the step's adapters and each token's (int32, its index among them,
    -1 for none), whose products the layers add as PEFT's LoRA layers do."""
    num_seqs = metadata.seq_lens.shape[0]
    if prompt_lens is not None and (prompt_lens.dtype != torch.int32 or prompt_lens.shape != (num_seqs,)
                                    or not prompt_lens.is_contiguous()):
        raise ValueError(f"prompt_lens must be {num_seqs} contiguous int32 values, one per sequence")
    layers, slots = lora if lora is not None else (None, None)
    if lora is not None and (len(layers.layers) != model.num_layers or slots.dtype != torch.int32
                             or slots.shape != (hidden.shape[0],) or not slots.is_contiguous()):
        raise ValueError(f"lora must cover the model's {model.num_layers} layers with one contiguous int32 adapter "
                         f"index per token")
    logits = torch.empty(sample_rows.shape[0], model.vocab_size, dtype=hidden.dtype)
    tables = metadata.block_tables
    step = _Step(
        hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(), metadata.query_start_loc.data_ptr(), tables.data_ptr(),
        tables.stride(0), metadata.seq_lens.data_ptr(), metadata.slot_mapping.data_ptr(), sample_rows.data_ptr(),
        _ptr(prompt_lens), logits.data_ptr(), None if layers is None else ctypes.addressof(layers.array),
        _ptr(slots), hidden.shape[0], num_seqs, tables.shape[1],
        sample_rows.shape[0], torch.get_num_threads(),
    )
    status = _library.hf_paged_decoder_forward(ctypes.byref(model), ctypes.byref(step))
    if status in cpu_ops.INDEX_ERRORS:
        raise ValueError("native decoder: " + cpu_ops.INDEX_ERRORS[status].format(last_block=model.num_blocks - 1))
    if status != 0:
        raise RuntimeError(f"native decoder failed with status {status}")
    return logits
