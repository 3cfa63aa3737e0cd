"""Programmatic client for the decoupled `llm` model (gRPC streaming and HTTP generate endpoints).

Only the standard library, numpy, tritonclient and the engine's pure protocol room are used, so tests and the
Locust load test can import it. The contract (tensor names, dtypes, sampling_parameters JSON, error kinds) is
backend/protocol/wire.py's; docs/interface.md describes it. The pieces: client/inputs.py (request building),
client/results.py (responses, completions, errors), client/grpc_stream.py and client/http_generate.py.
"""

from client.grpc_stream import GrpcStream, generate_grpc, gevent_compat, stream_grpc
from client.http_generate import collect_http, generate_http, http_body, parse_sse, stream_http
from client.inputs import DEFAULT_OUTPUTS, DEFAULT_TIMEOUT_S, FLAT_INPUTS, build_inputs
from client.results import Chunk, Completion, ServerError, chunk_from_outputs

__all__ = [
    "DEFAULT_OUTPUTS",
    "FLAT_INPUTS",
    "Chunk",
    "Completion",
    "GrpcStream",
    "DEFAULT_TIMEOUT_S",
    "ServerError",
    "build_inputs",
    "chunk_from_outputs",
    "collect_http",
    "generate_grpc",
    "generate_http",
    "gevent_compat",
    "http_body",
    "parse_sse",
    "stream_grpc",
    "stream_http",
]
