"""TensorRT-LLM's LLM-API `tensorrt_llm` model: backend/serving/forwarding_model.py."""

from backend.serving.forwarding_model import TritonPythonModel  # noqa: F401
