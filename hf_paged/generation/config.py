"""`EngineConfig`: how a `ContinuousBatchGenerator` is sized and what it may do; one validated dataclass that the
generator, the ``hf-paged`` command line and the benchmarks all take."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

import torch

from ..cache import DEFAULT_BLOCK_SIZE
from ..reasoning import PARSERS

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
KV_CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1.5g"`` or a plain byte count, as bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 2GiB, 512MiB, 1GB or a byte count")
    return int(float(match.group(1)) * _UNITS[unit])


_COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_token_count(text: str) -> int:
    """A token count as vLLM writes it: ``"4096"``, ``"4k"`` (4000), ``"25.6k"``, ``"4K"`` (4096)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", text)
    if match is None or ("." in match.group(1) and match.group(2) in ("", "K", "M", "G")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count: write e.g. 4096, 4k (4000) or 4K (4096)")
    return int(round(float(match.group(1)) * _COUNT_UNITS[match.group(2)]))


SCHEDULING_POLICIES = ("fcfs", "priority")
SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATION_SCHEDULES = ("constant", "heuristic")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's ``speculative_config`` fields. Invalid values raise ``ValueError`` naming the field.

    ``method``: ``"ngram"`` (prompt lookup of the last ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens; 2 to 4
    when neither is given, and one given alone stands for both, as in vLLM) or ``"draft_model"``
    (``model``: a smaller model with the same tokenizer, a local directory or, from Python, a loaded model; given
    alone it implies this method, as in vLLM). ``num_speculative_tokens``: guesses per step.

    ``num_speculative_tokens_schedule`` (as Transformers' ``num_assistant_tokens_schedule``): ``"constant"`` (vLLM's
    way: every step guesses ``num_speculative_tokens``) or ``"heuristic"`` (Transformers' rule, per sequence: one guess
    at first, two more after a step that kept every guess, one fewer after a step that rejected one, never more than
    ``num_speculative_tokens``). A step's cost grows with every guess it verifies (on a 2-core CPU each one adds about
    5% (fp32) to 8% (bf16) of a one-token step), so long guesses pay only where they are kept: the heuristic follows a
    sequence between text it copies and text it writes (`benchmarks/speculation.py --workload grounded`).

    ``disable_by_batch_size``: no sequence speculates while more than this many run. Verifying ``k`` guesses costs a
    forward over ``k + 1`` tokens per sequence; at one sequence that is nearly free (the weights are read once
    either way), at a large batch it is extra compute that guesses rarely repay (vLLM measured speculation 1.4-1.8x
    slower at high load). Default 4: on a 2-core CPU a decode step of 4 sequences with 4 guesses each (20 tokens)
    took about 1.6x the step without guesses, so each sequence must keep more than half a guess per step to gain.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    num_speculative_tokens_schedule: str = "constant"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: object = None
    disable_by_batch_size: int = 4

    def __post_init__(self) -> None:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low, high = 2, 4
        object.__setattr__(self, "prompt_lookup_min", high if low is None else low)
        object.__setattr__(self, "prompt_lookup_max", low if high is None else high)
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens_schedule not in SPECULATION_SCHEDULES:
            raise ValueError(f"speculative_config.num_speculative_tokens_schedule must be one of "
                             f"{', '.join(SPECULATION_SCHEDULES)}, got {self.num_speculative_tokens_schedule!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config.model is required by the draft_model method: a local model "
                             "directory with the same tokenizer as the target")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is for the draft_model method; ngram takes none")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike, torch.nn.Module)):
            raise ValueError(f"speculative_config.model must be a model directory or a loaded model, got "
                             f"{type(self.model).__name__}")

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """From a `SpeculativeConfig`, a dict of its fields, its JSON text, or None (no speculation)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of its fields, got {type(value).__name__}")
        unknown = set(value) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {sorted(unknown)}; it takes "
                             f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        if value.get("model") is not None and "method" not in value:
            value = {**value, "method": "draft_model"}
        return cls(**value)


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``: the JSON of a `SpeculativeConfig`'s fields."""
    try:
        return SpeculativeConfig.from_value(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _option(help_text: str, default=None, flag: str | None = None, type_=None):
    """A field with its command-line form: ``flag`` (default ``--field-name``; a boolean's flag flips its default)."""
    return field(default=default, metadata={"help": help_text, "flag": flag, "type": type_})


@dataclass(frozen=True)
class EngineConfig:
    """Engine options, with vLLM's names. Invalid values raise ``ValueError`` naming the field."""

    block_size: int = _option(f"tokens per KV block (default: {DEFAULT_BLOCK_SIZE})", DEFAULT_BLOCK_SIZE)
    num_blocks: int | None = _option("KV cache size in blocks (default: what --kv-cache-memory holds; not with it)")
    kv_cache_memory: int | None = _option(
        "KV cache size in bytes, e.g. 2GiB or 512MB (default: 2GiB on CPU, or vLLM's $VLLM_CPU_KVCACHE_SPACE GiB; "
        "half the free memory on GPU)", type_=parse_memory)
    gpu_memory_utilization: float | None = _option(
        "on GPU, the fraction of its memory the engine may hold, weights included: the KV cache takes what is left "
        "of it once the model is loaded (vLLM's; default: the KV cache takes half the free memory; ignored on CPU, "
        "as vLLM's CPU backend ignores it)", type_=float)
    kv_cache_dtype: str | None = _option(
        "KV cache dtype: float32, bfloat16 or float16 (default: auto, the weights' dtype); bfloat16 under float32 "
        "weights halves the cache's memory and the bytes attention reads")
    max_num_seqs: int = _option("most sequences in one step (default: 256)", 256)
    max_num_batched_tokens: int | None = _option(
        "most tokens computed in one step; longer prompts are prefilled in chunks (default: 512 where the native CPU "
        "decoder runs the model and is the faster for all its steps, which it then takes; 2048 elsewhere; never below "
        "--max-num-seqs)",
        type_=parse_token_count)
    long_prefill_token_threshold: int | None = _option(
        "most tokens of one prompt computed in a step (vLLM's), so that a long prompt leaves room in every step for "
        "the others' prompts and decodes instead of holding them up for its whole prefill; 0: no limit (default: a "
        "quarter of --max-num-batched-tokens, at least 512 and at most half)",
        type_=parse_token_count)
    max_model_len: int | None = _option(
        "longest prompt + output in tokens (default: the model's context, capped by the cache; more than either "
        "is refused; 4k is 4000, 4K 4096)", type_=parse_token_count)
    enable_prefix_caching: bool = _option(
        "do not reuse the KV of prompt prefixes shared between requests", True, flag="--no-prefix-caching")
    prepack_weights: bool = _option(
        "on CPU, run linear layers through plain torch instead of oneDNN with weights packed once (packing is "
        "faster and costs the linear weights' memory once more; layers the native decoder covers are not packed)",
        True, flag="--no-prepack-weights")
    enforce_eager: bool = _option(
        "run every step through the model's own eager Transformers forward: no CUDA graphs for decode steps on GPU, "
        "no native CPU decoder for short steps of Llama, Mistral and Qwen2/3 models", False)
    speculative_config: SpeculativeConfig | None = _option(
        "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2, \"disable_by_batch_size\": 4} (prompt lookup), or "
        "{\"model\": \"/path/to/draft\", \"num_speculative_tokens\": 4} (a draft model with the same tokenizer); "
        "greedy outputs stay token-identical (default: off)", type_=parse_speculative_config)
    reasoning_parser: str | None = _option(
        "a thinking model's reasoning (between <think> and </think>) is read apart: the chat reply answers it in "
        "its reasoning and reasoning_content fields, apart from the content, and a structured output starts after "
        f"it (vLLM's; one of {', '.join(PARSERS)}: both read these tags) (default: none)", type_=str)
    enable_lora: bool = _option(
        "serve LoRA adapters (vLLM's): a request may name one (LoRARequest; the server's --lora-modules), and one "
        "step runs requests of several adapters and of none (default: off)", False)
    max_loras: int = _option("most LoRA adapters among the running requests; a request of another one waits (default: "
                             "1, vLLM's)", 1)
    max_lora_rank: int = _option("highest LoRA rank served; an adapter of a higher one is refused (default: 16, "
                                 "vLLM's)", 16)
    max_cpu_loras: int | None = _option(
        "most LoRA adapters kept loaded; loading one more drops the least recently used, read again when next asked "
        "for (default: --max-loras, as vLLM)")
    seed: int | None = _option(
        "seed of the draws of requests that give no seed of their own (vLLM's): sampled outputs then repeat when "
        "the same requests come in the same order (default: none, different every run)")
    scheduling_policy: str = _option(
        "fcfs: requests are admitted in arrival order and the newest running one is preempted first; priority: by "
        "each request's priority (lower first, vLLM's), then arrival, and the running one last in that order is "
        "preempted first (default: fcfs)", "fcfs", type_=str)

    def __post_init__(self) -> None:
        if isinstance(self.kv_cache_memory, str):  # "2GiB", as on the command line
            try:
                object.__setattr__(self, "kv_cache_memory", parse_memory(self.kv_cache_memory))
            except argparse.ArgumentTypeError as err:
                raise ValueError(f"EngineConfig.kv_cache_memory: {err}") from None
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"EngineConfig.seed must be an integer, got {self.seed!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_blocks", "kv_cache_memory",
                     "max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if threshold is not None and (not isinstance(threshold, int) or isinstance(threshold, bool) or threshold < 0):
            raise ValueError(f"EngineConfig.long_prefill_token_threshold must be an integer >= 0 (0: no limit), got "
                             f"{threshold!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"EngineConfig.max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                             f"({self.max_loras})")
        sizes = [name for name in ("num_blocks", "kv_cache_memory", "gpu_memory_utilization")
                 if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ValueError(f"EngineConfig: give one of num_blocks, kv_cache_memory and gpu_memory_utilization, not "
                             f"{' and '.join(sizes)}")
        utilization = self.gpu_memory_utilization
        if utilization is not None and (isinstance(utilization, bool) or not isinstance(utilization, (int, float))
                                        or not 0 < utilization <= 1):
            raise ValueError(f"EngineConfig.gpu_memory_utilization is a fraction in (0, 1], got {utilization!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"EngineConfig.max_model_len must be an integer >= 2 (a prompt token and an output "
                             f"token), got {self.max_model_len!r}")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.from_value(self.speculative_config))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy is one of {', '.join(SCHEDULING_POLICIES)}, got "
                             f"{self.scheduling_policy!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"EngineConfig.reasoning_parser is one of {', '.join(PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if isinstance(self.kv_cache_dtype, torch.dtype):  # accepted as a dtype, kept as its name
            object.__setattr__(self, "kv_cache_dtype", str(self.kv_cache_dtype).removeprefix("torch."))
        if self.kv_cache_dtype == "auto":
            object.__setattr__(self, "kv_cache_dtype", None)
        if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")

    def replace(self, **changes) -> "EngineConfig":
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] if self.kv_cache_dtype else model_dtype

    # --------------------------------------------------------------------------------------------- command line
    @classmethod
    def add_cli_arguments(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """One command-line option per field (``--max-num-seqs``; a boolean's flag flips its default, e.g.
        ``--no-prefix-caching``, ``--enforce-eager``)."""
        for f in dataclasses.fields(cls):
            flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
            if f.type == "bool":  # the flag flips the default
                action = "store_false" if f.default else "store_true"
                parser.add_argument(flag, dest=f.name, action=action, help=f.metadata["help"])
            else:
                kind = f.metadata["type"] or (str if f.name == "kv_cache_dtype" else int)
                parser.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f.metadata["help"])

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
