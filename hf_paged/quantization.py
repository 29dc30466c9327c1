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

A checkpoint declares its quantization in ``config.json`` (``quantization_config``) or, as AutoGPTQ and AutoAWQ wrote
them, in ``quantize_config.json`` / ``quant_config.json`` beside it (vLLM reads those too).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

QUANT_METHODS = ("gptq", "awq")
QUANTIZATIONS = ("gptq", "awq", "gptq_marlin", "awq_marlin")  # vLLM's names of the methods served here
_SETTINGS_FILES = ("quantize_config.json", "quant_config.json")
_AUTOAWQ_KEYS = {"w_bit": "bits", "q_group_size": "group_size", "zero_point": "zero_point", "version": "version"}
_FUSED_GROUP_SIZES = (-1, 16, 32, 64, 128)


def _set_cpu_workers() -> None:
    """gptqmodel refuses to build its CPU thread pool on small machines unless told how many workers to use."""
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its own loader pool takes two, whatever the machine


def quantization_settings(model_path: str | os.PathLike) -> tuple[dict | None, bool]:
    """A checkpoint's quantization settings (None: not quantized), and whether they come from a file beside
    ``config.json`` (which Transformers does not read)."""
    folder = Path(model_path)
    config = _read_json(folder / "config.json")
    declared = config.get("quantization_config") if isinstance(config, dict) else None
    if declared or config is None:  # no config.json, or one Transformers will name as malformed
        return declared or None, False
    for name in _SETTINGS_FILES:
        settings = _read_json(folder / name)
        if isinstance(settings, dict):
            if "w_bit" in settings:  # AutoAWQ's names
                return {"quant_method": "awq", **{new: settings[old] for old, new in _AUTOAWQ_KEYS.items()
                                                  if old in settings}}, True
            return {"quant_method": settings.get("method", "gptq"), **settings}, True
    return None, False


def _read_json(path: Path):
    """The JSON a file holds; None for no file or one that is not JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _declared_method(model_path: str | os.PathLike) -> str | None:
    method = (quantization_settings(model_path)[0] or {}).get("quant_method")
    return None if method is None else str(method).lower()


def quantization_method(model_path: str | os.PathLike) -> str | None:
    """``"gptq"``, ``"awq"`` or None, from the checkpoint's settings."""
    method = _declared_method(model_path)
    return method if method in QUANT_METHODS else None


def check_quantization(model_path: str | os.PathLike, asked: str | None) -> None:
    """vLLM's ``quantization`` option: the checkpoint must be quantized with that method (``ValueError`` otherwise);
    its weights load as they are."""
    if asked is None:
        return
    if asked not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {asked!r}")
    method = _declared_method(model_path)
    if method != asked.removesuffix("_marlin"):
        raise ValueError(f"quantization {asked}: {model_path} is "
                         f"{f'quantized with {method}' if method else 'not quantized'}; a checkpoint's own "
                         "quantization is what loads")


def quantized_load_kwargs(model_path: str | os.PathLike, device: str = "cpu", backend: str | None = None,
                          trust_remote_code: bool = False) -> dict:
    """Extra `from_pretrained` arguments for a GPTQ/AWQ checkpoint (empty for anything else, or off CPU).

    ``backend`` overrides gptqmodel's kernel (e.g. ``"torch"`` for exact fp32 GPTQ math); by default the fused torch
    kernels where the checkpoint fits them (4 bits, their group sizes, symmetric GPTQ: asymmetric zero points came
    out wrong in the fused GPTQ kernel), else the plain torch ones.
    """
    config, beside = quantization_settings(model_path)
    method = quantization_method(model_path)
    if method is None:
        return {}
    if config.get("lm_head"):
        raise ValueError(f"{model_path}: its output layer is quantized too (quantization_config.lm_head), which "
                         "Transformers does not load (it would be random); quantize it with lm_head=False")
    kwargs = {"config": _config_with(model_path, config, trust_remote_code)} if beside else {}
    if str(device) != "cpu":
        return kwargs
    _set_cpu_workers()
    fused = config.get("bits") == 4 and config.get("group_size", 128) in _FUSED_GROUP_SIZES
    if method == "gptq":
        from transformers import GPTQConfig

        default = "torch_fused" if fused and config.get("sym", True) else "torch"
        return {**kwargs, "quantization_config": GPTQConfig(bits=config["bits"], backend=backend or default)}
    from transformers import AwqConfig

    fused = fused and str(config.get("version", config.get("format", "gemm"))).lower() == "gemm"
    default = "torch_fused_awq" if fused else "torch_awq"
    return {**kwargs, "quantization_config": AwqConfig(bits=config["bits"], backend=backend or default)}


def _config_with(model_path: str | os.PathLike, settings: dict, trust_remote_code: bool):
    """The model's config holding quantization ``settings`` read beside it, so that Transformers loads the weights as
    quantized ones (a ``quantization_config`` argument alone would quantize them again)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    config.quantization_config = settings
    return config


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
