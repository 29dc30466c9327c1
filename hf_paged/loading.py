"""Loading a model for the paged backend: a local directory or the embedded default, quantized or not."""

from __future__ import annotations

import os

import torch

from .default_model import resolve_model
from .quantization import quantized_load_kwargs

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
    quant_backend: str | None = None, tensor_parallel_size: int = 1,
):
    """``(model, tokenizer)`` with ``attn_implementation="paged"``; None loads the embedded SmolLM2-135M-Instruct.

    ``dtype`` is that of activations and the KV cache; GPTQ/AWQ weights stay 4-bit whatever it is, computed by the
    gptqmodel kernel ``quant_backend`` (see :mod:`hf_paged.quantization` for the default).
    ``tensor_parallel_size > 1`` shards the model across that many ranks (this process is one of them, started by
    torchrun or `hf_paged.launch`; see :mod:`hf_paged.distributed`), ``device`` then being each rank's own.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    kwargs = quantized_load_kwargs(path, device, quant_backend)
    if tensor_parallel_size > 1:
        if kwargs:
            raise ValueError("tensor parallelism is not supported for quantized (GPTQ/AWQ) checkpoints")
        return _load_tensor_parallel(path, dtype, tensor_parallel_size)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=dtype, device_map=device,
                                                 **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


def _load_tensor_parallel(path, dtype, tensor_parallel_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from . import distributed

    distributed.init_process_group()
    if distributed.world_size() != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size is {tensor_parallel_size} but {distributed.world_size()} ranks were "
                         "started (one rank per shard)")
    distributed.set_cpu_threads()
    config = AutoConfig.from_pretrained(path)
    kwargs = distributed.load_tensor_parallel_kwargs(config, tensor_parallel_size)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=dtype, **kwargs)
    distributed.shard_replicated_kv_heads(model)
    return model.eval(), AutoTokenizer.from_pretrained(path)
