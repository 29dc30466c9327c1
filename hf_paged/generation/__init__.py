"""Continuous batching: requests, scheduling, the model runner, sampling and the public generator."""

from .generator import ContinuousBatchGenerator, EngineStats
from .sampling_params import SamplingParams, StructuredOutputsParams
from .sequence import CompletionOutput, RequestMetrics, RequestOutput

__all__ = [
    "CompletionOutput",
    "ContinuousBatchGenerator",
    "EngineStats",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
