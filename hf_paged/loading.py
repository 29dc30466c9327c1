"""Loading a model for the paged backend: a local directory or the embedded default, quantized or not."""

from __future__ import annotations

import os

import torch

from .default_model import resolve_model
from .generation.config import KV_CACHE_DTYPES
from .quantization import quantized_load_kwargs, run_dequantize_eagerly

# The dtypes a model loads in, with vLLM's other names for two of them.
DTYPES = {"auto": "auto", **KV_CACHE_DTYPES, "half": torch.float16, "float": torch.float32}


def resolve_device(device: str) -> str:
    """``"auto"``: the GPU when there is one (CUDA), else the CPU; any other name as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# vLLM's load formats: every one but dummy reads the weights as Transformers reads them.
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
    quant_backend: str | None = None, tensor_parallel_size: int = 1, trust_remote_code: bool = False,
    tokenizer: str | os.PathLike | None = None, load_format: str = "auto",
):
    """``(model, tokenizer)`` with ``attn_implementation="paged"``; None loads the embedded SmolLM2-135M-Instruct.
    ``trust_remote_code`` runs the Python code a model directory ships (its ``auto_map``), as in Transformers;
    ``tokenizer`` names a tokenizer other than the model's (a directory or a cached hub id), as vLLM's.
    ``load_format="dummy"`` (vLLM's) builds the model from its config with random weights, none read (to measure
    speed and memory; it writes nonsense); any other format is read as Transformers reads it.

    ``dtype`` is that of activations and the KV cache; GPTQ/AWQ weights stay 4-bit whatever it is, computed by the
    gptqmodel kernel ``quant_backend`` (see :mod:`hf_paged.quantization` for the default).
    ``tensor_parallel_size > 1`` shards the model across that many ranks (this process is one of them, started by
    torchrun or `hf_paged.distributed.launch`; see :mod:`hf_paged.distributed`); each rank then places its shard
    itself (`hf_paged.distributed.load_tensor_parallel_kwargs`), whatever ``device`` says.
    """
    from transformers import AutoTokenizer

    path = resolve_model(name_or_path)
    if load_format == "dummy":
        if tensor_parallel_size > 1:
            raise ValueError("random weights (load_format dummy) are built on one process, not tensor parallel")
        model = _random_model(path, dtype, device, trust_remote_code)
    elif tensor_parallel_size > 1:
        from .distributed import check_checkpoint

        check_checkpoint(path)
        model = _load_tensor_parallel(path, _dtype(dtype), tensor_parallel_size, trust_remote_code)
    else:
        model = load_causal_lm(path, dtype, device, quant_backend, trust_remote_code)
    return model, AutoTokenizer.from_pretrained(tokenizer or path, trust_remote_code=trust_remote_code)


def load_causal_lm(name_or_path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32",
                   device: str = "cpu", quant_backend: str | None = None, trust_remote_code: bool = False):
    """The model alone, as `load_model` loads it on one process (a draft model needs no tokenizer of its own)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(name_or_path)
    kwargs = quantized_load_kwargs(path, device, quant_backend, trust_remote_code)
    model, info = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=_dtype(dtype),
                                                       device_map=device, trust_remote_code=trust_remote_code,
                                                       output_loading_info=True, **kwargs)
    _check_weights(path, info)
    if kwargs:
        run_dequantize_eagerly(model)
    return model.eval()


def _check_weights(path: str, info: dict) -> None:
    """Transformers fills the weights a checkpoint lacks with random ones, and the model then writes nonsense."""
    missing = sorted(info.get("missing_keys") or ())
    if not missing:
        return
    quantized = [key for key in info.get("unexpected_keys") or () if key.endswith(".qweight")]
    hint = (f"; it holds quantized weights ({quantized[0]}, ...) that its config does not declare (no "
            "quantization_config in config.json, no quantize_config.json beside it)") if quantized else ""
    raise ValueError(f"{path} lacks {len(missing)} of the model's weights ({', '.join(missing[:3])}"
                     f"{', ...' if len(missing) > 3 else ''}){hint}: loaded, they would be random")


def _random_model(path: str, dtype: str | torch.dtype, device: str, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(config, "quantization_config", None) is not None:
        raise ValueError("random weights (load_format dummy) are not quantized: this checkpoint is")
    dtype = _dtype(dtype)
    dtype = getattr(config, "dtype", None) or torch.float32 if dtype == "auto" else dtype
    model = AutoModelForCausalLM.from_config(config, attn_implementation="paged", dtype=dtype,
                                             trust_remote_code=trust_remote_code)
    try:  # its recommended sampling settings, as a real load has them
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # the directory has none
        pass
    return model.to(device).eval()


def _dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return dtype


def _load_tensor_parallel(path, dtype, tensor_parallel_size: int, trust_remote_code: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import distributed

    distributed.init_process_group()
    if distributed.world_size() != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size is {tensor_parallel_size} but {distributed.world_size()} ranks were "
                         "started (one rank per shard)")
    distributed.set_cpu_threads()
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs = distributed.load_tensor_parallel_kwargs(config, tensor_parallel_size)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=dtype,
                                                 trust_remote_code=trust_remote_code, **kwargs)
    distributed.shard_replicated_kv_heads(model)
    return model.eval()
