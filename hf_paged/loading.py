"""Loading a model for the paged backend: a local directory or the embedded default, quantized or not."""

from __future__ import annotations

import os

import torch

from .default_model import resolve_model
from .quantization import quantized_load_kwargs

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(
    name_or_path: str | os.PathLike | None = None, dtype: str | torch.dtype = "float32", device: str = "cpu",
    quant_backend: str | None = None,
):
    """``(model, tokenizer)`` with ``attn_implementation="paged"``; None loads the embedded SmolLM2-135M-Instruct.

    ``dtype`` is that of activations and the KV cache; GPTQ/AWQ weights stay 4-bit whatever it is, computed by the
    gptqmodel kernel ``quant_backend`` (see :mod:`hf_paged.quantization` for the default).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    kwargs = quantized_load_kwargs(path, device, quant_backend)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="paged", dtype=dtype, device_map=device,
                                                 **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer
