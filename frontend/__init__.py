"""An OpenAI-compatible front door for the Triton server's LLM model (run `llm-frontend --help`, or
`python -m frontend`)."""
