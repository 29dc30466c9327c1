"""`ServingOptions`: how the server answers where vLLM's ``serve`` flags choose (one field per flag).

``ServerLimits`` bound what a call may ask; these say what the answers look like and what the server logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..chat_template import CONTENT_FORMATS, content_format
from ..generation import SamplingParams
from ..generation.sampling_params import GENERATION_CONFIG_DEFAULTS
from ..pooling import PoolingConfig
from .metrics import METRICS_PREFIXES


@dataclass(frozen=True)
class ServingOptions:
    generation_config: str = "auto"  # "auto": the model's recommended sampling settings stand for what a request
    #                                   leaves out; "vllm": OpenAI's defaults do; a folder: its generation_config.json's
    override_generation_config: dict = field(default_factory=dict)  # generation-config names over those defaults
    response_role: str = "assistant"  # a chat reply's role (a reply that continues the last message keeps its role)
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>" (a request may ask either way)
    log_requests: bool = False  # log each request's prompt and sampling parameters when it is queued
    max_log_len: int | None = None  # characters of a logged prompt, and its token ids (None: all)
    chat_template_content_format: str = "auto"  # messages' content as a string, or as OpenAI's list of parts
    metrics_prefix: str = "hf_paged"  # /metrics names "<prefix>:<vLLM's name>"; "vllm" for vLLM's dashboards
    pooling: PoolingConfig | None = None  # how /v1/embeddings pools (None: as the model directory says)

    def __post_init__(self) -> None:
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(self._generation_config_file):
            raise ValueError(f"generation_config is 'auto', 'vllm' or a folder that holds a generation_config.json, "
                             f"got {self.generation_config!r}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format is one of {', '.join(CONTENT_FORMATS)}, got "
                             f"{self.chat_template_content_format!r}")
        if self.metrics_prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics_prefix is one of {', '.join(METRICS_PREFIXES)}, got {self.metrics_prefix!r}")
        if not self.response_role:
            raise ValueError("response_role must not be empty")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be at least 0, got {self.max_log_len}")
        unknown = sorted(set(self.override_generation_config) - set(GENERATION_CONFIG_DEFAULTS))
        if unknown:
            raise ValueError(f"override_generation_config sets {', '.join(map(repr, unknown))}: it takes "
                             f"{', '.join(GENERATION_CONFIG_DEFAULTS)}")
        SamplingParams(**self.sampling_overrides())  # a bad value is refused here, not in every request

    def sampling_overrides(self) -> dict:
        """``override_generation_config`` as `SamplingParams` fields."""
        return {GENERATION_CONFIG_DEFAULTS[name]: value for name, value in self.override_generation_config.items()}

    @property
    def _generation_config_file(self) -> str:
        return os.path.join(self.generation_config, "generation_config.json")

    def sampling_defaults(self, model_generation_config) -> dict:
        """What a request leaves out of its sampling settings: the model's recommendations (``"auto"``) or those of
        the folder's generation config, then the overrides over them."""
        if self.generation_config in ("auto", "vllm"):
            recommended = model_generation_config if self.generation_config == "auto" else None
        else:
            from transformers import GenerationConfig

            recommended = GenerationConfig.from_pretrained(self.generation_config, local_files_only=True)
        return {**SamplingParams.model_defaults(recommended), **self.sampling_overrides()}

    def content_format(self, chat_template) -> str:
        return content_format(self.chat_template_content_format, chat_template)

    def pooling_of(self, model) -> PoolingConfig:
        """How embeddings are pooled: as asked, else as the model directory's sentence-transformers files say."""
        return self.pooling or PoolingConfig.of_model(getattr(model, "name_or_path", None))

