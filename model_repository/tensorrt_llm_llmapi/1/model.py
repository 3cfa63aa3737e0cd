"""TensorRT-LLM's LLM-API `tensorrt_llm` model, here `tensorrt_llm_llmapi`: backend/serving/forwarding_model.py."""

from backend.serving.forwarding_model import TritonPythonModel  # noqa: F401
