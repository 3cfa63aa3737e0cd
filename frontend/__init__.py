"""An OpenAI-compatible front door for the Triton server's LLM model (run `python -m frontend --help`)."""
