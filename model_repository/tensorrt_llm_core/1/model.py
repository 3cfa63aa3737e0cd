"""TensorRT-LLM's core model, here `tensorrt_llm_core`: backend/serving/forwarding_model.py."""

from backend.serving.forwarding_model import TritonPythonModel  # noqa: F401
