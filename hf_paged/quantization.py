"""GPTQ and AWQ checkpoints: making small ones with gptqmodel, and the one loading choice they need.

The paged backend never looks inside linear layers, so quantized models need nothing special at run time. The one
special case is *loading* on CPU: gptqmodel's default CPU kernels (AVX-512) compile a C++ extension on first load
(minutes on a 2-core machine). We pick its ``torch_fused`` kernels instead, which load in about a second and were the
fastest here (SmolLM2-135M GPTQ, 30 greedy tokens, one thread: 2.0-2.5 s against 15-21 s for ``backend="torch"``
run eagerly, see `run_dequantize_eagerly`). The fused
kernels compute at reduced precision: with them Transformers' own eager and sdpa attention differ by up to 0.2 in the
logits of SmolLM2-GPTQ, so token-exact comparisons use ``backend="torch"`` / ``"torch_awq"`` (fp32
dequantize-and-matmul), which agree to 1e-4. The fused kernels take 4-bit weights in groups of up to 128 (AWQ: the
GEMM format) only; other checkpoints get the plain torch kernels. Requires the ``quant`` extra
(``pip install "hf-paged[quant]"``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

QUANT_METHODS = ("gptq", "awq")
_FUSED_GROUP_SIZES = (-1, 16, 32, 64, 128)


def _set_cpu_workers() -> None:
    """gptqmodel refuses to build its CPU thread pool on small machines unless told how many workers to use."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its own loader pool takes two, whatever the machine


def quantization_method(model_path: str | os.PathLike) -> str | None:
    """``"gptq"``, ``"awq"`` or None, from the checkpoint's config."""
    config_file = Path(model_path) / "config.json"
    if not config_file.exists():
        return None
    config = json.loads(config_file.read_text()).get("quantization_config") or {}
    method = config.get("quant_method")
    return method if method in QUANT_METHODS else None


def quantized_load_kwargs(model_path: str | os.PathLike, device: str = "cpu", backend: str | None = None) -> dict:
    """Extra `from_pretrained` arguments for a GPTQ/AWQ checkpoint (empty for anything else, or off CPU).

    ``backend`` overrides gptqmodel's kernel (e.g. ``"torch"`` for exact fp32 GPTQ math); by default the fused torch
    kernels where the checkpoint fits them (4 bits, their group sizes, symmetric GPTQ: asymmetric zero points came
    out wrong in the fused GPTQ kernel), else the plain torch ones.
    """
    method = quantization_method(model_path)
    if method is None or str(device) != "cpu":
        return {}
    _set_cpu_workers()
    config = json.loads((Path(model_path) / "config.json").read_text())["quantization_config"]
    fused = config.get("bits") == 4 and config.get("group_size", 128) in _FUSED_GROUP_SIZES
    if method == "gptq":
        from transformers import GPTQConfig

        default = "torch_fused" if fused and config.get("sym", True) else "torch"
        return {"quantization_config": GPTQConfig(bits=config["bits"], backend=backend or default)}
    from transformers import AwqConfig

    fused = fused and str(config.get("version", config.get("format", "gemm"))).lower() == "gemm"
    default = "torch_fused_awq" if fused else "torch_awq"
    return {"quantization_config": AwqConfig(bits=config["bits"], backend=backend or default)}


def run_dequantize_eagerly(model) -> int:
    """Undo the ``torch.compile`` gptqmodel wraps around each plain torch kernel's dequantize; returns how many.

    On CPU it buys nothing: one compile per layer on the first forward and more for each new shape (210 layers and
    about 50 s on 2 cores for SmolLM2-135M GPTQ before its first token) for forwards no faster than eager ones
    (0.26-0.6 s each for that model, either way; 30 greedy tokens on one thread: 72 s, then 24-27 s compiled, against
    21-22 s eager).
    """
    undone = 0
    for module in model.modules():
        if hasattr(vars(module).get("dequantize_weight"), "_torchdynamo_orig_callable"):
            del module.dequantize_weight  # the class's own, eager method shows through again
            undone += 1
    return undone


def quantize_checkpoint(
    model_path: str | os.PathLike,
    output_dir: str | os.PathLike,
    calibration_texts: list[str],
    method: str = "gptq",
    bits: int = 4,
    group_size: int = 128,
    desc_act: bool = False,
) -> str:
    """Quantize ``model_path`` with gptqmodel on CPU and save the checkpoint (weights and tokenizer) to ``output_dir``.

    ``method="awq"`` writes the GEMM format. Takes minutes for a 135M model on 2 cores.
    """
    if method not in QUANT_METHODS:
        raise ValueError(f"method must be one of {QUANT_METHODS}, got {method!r}")
    _set_cpu_workers()
    from gptqmodel import GPTQModel, QuantizeConfig

    if method == "gptq":
        config = QuantizeConfig(bits=bits, group_size=group_size, desc_act=desc_act)
    else:
        config = QuantizeConfig(bits=bits, group_size=group_size, quant_method="awq", format="gemm")
    model = GPTQModel.load(str(model_path), config, device="cpu")
    model.quantize(calibration_texts)
    model.save(str(output_dir))
    return str(output_dir)
