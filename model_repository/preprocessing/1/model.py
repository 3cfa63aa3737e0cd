"""TensorRT-LLM's `preprocessing` model: backend/serving/tokenizer_models.py."""

from backend.serving.tokenizer_models import Preprocessing as TritonPythonModel  # noqa: F401
