"""Continuous batching: engine options, requests, scheduling, the model runner, sampling and the public generator."""

from .beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from .config import EngineConfig
from .generator import ContinuousBatchGenerator
from .stats import EngineStats
from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, RequestOutputKind
from .sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "ContinuousBatchGenerator",
    "EngineConfig",
    "EngineStats",
    "InvalidParameter",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
