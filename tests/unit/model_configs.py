"""A minimal config.pbtxt with a relative `model` path, shared by the model-config and deploy-manifest tests."""

CONFIG = """name: "llm"
backend: "python"

parameters [
  { key: "model", value: { string_value: "../../models/m" } },
  { key: "dtype", value: { string_value: "auto" } }
]
"""
