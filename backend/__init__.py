"""The LLM engine: in-flight batching over a paged KV cache, speculative decoding and streaming.

It imports and runs without Triton; `model_repository/llm/1/model.py` is the thin Triton glue.
"""
from .config import ConfigError, EngineConfig
from .engine import LLMEngine
from .engine_loop import EngineLoop, EngineStopped, ServerBusy
from .request import FinishReason, Request, RequestOutput, SampleOutput
from .sampling_params import InvalidRequest, SamplingParams

__all__ = [
    "ConfigError",
    "EngineConfig",
    "EngineLoop",
    "EngineStopped",
    "FinishReason",
    "InvalidRequest",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "SampleOutput",
    "SamplingParams",
    "ServerBusy",
]
