"""TensorRT-LLM's `tensorrt_llm` core model: backend/serving/forwarding_model.py."""

from backend.serving.forwarding_model import TritonPythonModel  # noqa: F401
