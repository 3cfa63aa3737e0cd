"""Triton's side of the engine: request inputs parsed from tensors, response tensors, the batch view's watch
stream. Used by model_repository/llm/1/model.py; no pb_utils import here, so it is tested without Triton."""
