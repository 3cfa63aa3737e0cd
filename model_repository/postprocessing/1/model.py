"""TensorRT-LLM's `postprocessing` model: backend/serving/tokenizer_models.py."""

from backend.serving.tokenizer_models import Postprocessing as TritonPythonModel  # noqa: F401
