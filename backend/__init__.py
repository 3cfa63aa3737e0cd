"""The LLM engine: in-flight batching over a paged KV cache, speculative decoding and streaming.

It imports and runs without Triton; `model_repository/llm/1/model.py` is the thin Triton glue. The engine lives
in rooms, each importing only the rooms below it (pyproject.toml's import-linter contracts enforce it):

    serving    Triton's side: request inputs, response tensors, the batch view's watch stream
    engine     the engine (one step: schedule, run, sample, emit), its loop thread and output sender
    spec       speculative decoding: proposers, verification, rejection sampling, the adaptive policy
    core       requests and sequences, scheduler, KV block manager, output processor, detokenizer, config, metrics
    sampling   the batched sampler and structured output (grammar masks)
    model      the model runner, fused Llama forward, linear kernels, paged attention, weights, CPU features
    protocol   pure request parsing and validation and the Triton wire contract (no torch, numpy or llguidance:
               the front door and the client import only this room)

The names below are imported on first use, so `import backend.protocol` stays light.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ConfigError": "backend.core.config",
    "EngineConfig": "backend.core.config",
    "LLMEngine": "backend.engine.llm_engine",
    "EngineLoop": "backend.engine.loop",
    "EngineStopped": "backend.engine.loop",
    "ServerBusy": "backend.engine.loop",
    "FinishReason": "backend.core.request",
    "Request": "backend.core.request",
    "RequestOutput": "backend.core.request",
    "SampleOutput": "backend.core.request",
    "InvalidRequest": "backend.protocol.values",
    "SamplingParams": "backend.protocol.sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'backend' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
