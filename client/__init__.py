"""Clients for the decoupled `llm` Triton model: `llm-client --help` (or `python -m client`) for the CLI,
`client.api` for code."""

from client.api import (  # noqa: F401
    DEFAULT_OUTPUTS,
    FLAT_INPUTS,
    Chunk,
    Completion,
    GrpcStream,
    ServerError,
    __all__,  # noqa: F401
    build_inputs,
    chunk_from_outputs,
    collect_http,
    generate_grpc,
    generate_http,
    http_body,
    parse_sse,
    stream_grpc,
    stream_http,
)
