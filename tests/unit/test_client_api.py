"""Unit tests of client/ that need no Triton server: SSE parsing, input building, result assembly, HTTP paths
against a tiny standard-library server, and the CLI's argument handling."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from client import (
    DEFAULT_OUTPUTS,
    Chunk,
    Completion,
    ServerError,
    build_inputs,
    chunk_from_outputs,
    collect_http,
    generate_http,
    http_body,
    parse_sse,
    stream_http,
)
from client.__main__ import parse_args, request_kwargs
from client.http_generate import _error_text

# ---------------------------------------------------------------------------------------------- SSE parsing


def test_parse_sse_events():
    lines = [b'data: {"a": 1}\n', b"\n", b'data: {"b": 2}\r\n', b"\r\n"]
    assert list(parse_sse(lines)) == ['{"a": 1}', '{"b": 2}']


def test_parse_sse_multiline_comments_fields_and_eof():
    lines = [": keep-alive", "event: message", "id: 3", "data: line1", "data:line2", "", "", "data: last"]
    assert list(parse_sse(lines)) == ["line1\nline2", "last"]


def test_parse_sse_nothing():
    assert list(parse_sse([])) == []
    assert list(parse_sse(["", ": comment", ""])) == []


def test_error_text_variants():
    assert _error_text('{"error": "bad"}') == "bad"
    assert _error_text('data: {"error":"max_tokens must be >= 1"}\n\n') == "max_tokens must be >= 1"
    assert _error_text("plain failure\n") == "plain failure"


# ---------------------------------------------------------------------------------------------- inputs


def _grpc_inputs(*args, **kwargs):
    return {i.name(): i for i in build_inputs(*args, **kwargs)}


def test_build_inputs_grpc_dtypes_and_shapes():
    inputs = _grpc_inputs(
        "Hi",
        True,
        {"top_p": 0.9},
        max_tokens=8,
        temperature=0.5,
        seed=2**63 + 1,
        stop=["\n", "END"],
        ignore_eos=True,
        top_k=None,
        n=2,
    )
    spec = {name: (i.datatype(), i.shape()) for name, i in inputs.items()}
    assert spec == {
        "text_input": ("BYTES", [1]),
        "stream": ("BOOL", [1]),
        "sampling_parameters": ("BYTES", [1]),
        "max_tokens": ("INT32", [1]),
        "temperature": ("FP32", [1]),
        "seed": ("UINT64", [1]),
        "stop": ("BYTES", [2]),
        "ignore_eos": ("BOOL", [1]),
        "n": ("INT32", [1]),
    }
    assert np.frombuffer(inputs["seed"]._get_content(), np.uint64)[0] == 2**63 + 1
    assert np.frombuffer(inputs["max_tokens"]._get_content(), np.int32)[0] == 8
    assert np.frombuffer(inputs["stream"]._get_content(), np.bool_)[0]
    sampling = inputs["sampling_parameters"]._get_content()
    assert json.loads(sampling[4:]) == {"top_p": 0.9}  # BYTES: 4-byte length prefix, then the string


def test_build_inputs_single_stop_string_and_no_sampling():
    inputs = _grpc_inputs("Hi", False, stop="\n")
    assert set(inputs) == {"text_input", "stream", "stop"}
    assert inputs["stop"].shape() == [1]
    assert not np.frombuffer(inputs["stream"]._get_content(), np.bool_)[0]


def test_build_inputs_utf8_prompt_and_json_string_sampling():
    inputs = _grpc_inputs("héllo ✓", sampling='{"n": 2}')
    assert inputs["text_input"]._get_content()[4:] == "héllo ✓".encode()
    assert inputs["sampling_parameters"]._get_content()[4:] == b'{"n": 2}'


def test_build_inputs_unknown_key_guesses_dtype():
    inputs = _grpc_inputs("Hi", flag=True, count=3, ratio=0.5, word="x")
    assert [inputs[k].datatype() for k in ("flag", "count", "ratio", "word")] == ["BOOL", "INT64", "FP32", "BYTES"]


def test_build_inputs_http():
    inputs = {i.name(): i for i in build_inputs("Hi", True, None, protocol="http", max_tokens=4, stop=["a"])}
    assert {n: (i.datatype(), i.shape()) for n, i in inputs.items()} == {
        "text_input": ("BYTES", [1]),
        "stream": ("BOOL", [1]),
        "max_tokens": ("INT32", [1]),
        "stop": ("BYTES", [1]),
    }


def test_build_inputs_bad_protocol():
    with pytest.raises(ValueError):
        build_inputs("Hi", protocol="smtp")


def test_http_body():
    body = http_body("Hi", True, {"max_tokens": 3}, temperature=0.1, seed=None, stop=["x"])
    assert body == {
        "text_input": "Hi",
        "stream": True,
        "sampling_parameters": '{"max_tokens": 3}',
        "temperature": 0.1,
        "stop": ["x"],
    }


# ---------------------------------------------------------------------------------------------- results


def test_chunk_from_json_scalars_and_lists():
    c = chunk_from_outputs(
        {
            "text_output": "abc",
            "output_ids": 7,
            "finish_reason": ["stop"],
            "num_input_tokens": 3,
            "num_output_tokens": [1],
            "sample_index": 2,
            "model_name": "llm",
        },
        1.5,
    )
    assert (c.text, c.token_ids, c.finish_reason, c.sample_index, c.num_input_tokens, c.num_output_tokens) == (
        "abc",
        [7],
        "stop",
        2,
        3,
        1,
    )
    assert c.received_at == 1.5 and not c.is_final


def test_chunk_from_numpy():
    c = chunk_from_outputs(
        {
            "text_output": np.array([b"h\xc3\xa9", b"!"], dtype=np.object_),
            "output_ids": np.array([5, 6], dtype=np.int32),
            "finish_reason": np.array([b""], dtype=np.object_),
        },
        0.0,
        is_final=True,
    )
    assert (c.text, c.token_ids, c.finish_reason, c.is_final, c.num_tokens) == ("hé!", [5, 6], None, True, 2)


def test_chunk_finish_reason_none_until_the_end_and_cumulative_logprob():
    c = chunk_from_outputs(
        {
            "text_output": np.array([b"a"], dtype=np.object_),
            "finish_reason": np.array([b"None"], dtype=np.object_),
            "cumulative_logprob": np.array([-1.5], dtype=np.float32),
        },
        0.0,
    )
    assert c.finish_reason is None and c.cumulative_logprob == -1.5
    assert chunk_from_outputs({"text_output": "a"}, 0.0).cumulative_logprob is None


def test_a_chunk_of_several_samples_joins_them_without_the_id_padding():
    c = chunk_from_outputs(
        {
            "text_output": np.array([b"x", b"yz"], dtype=np.object_),
            "output_ids": np.array([[3, -1], [4, 5]], dtype=np.int32),
            "sample_index": np.array([0, 1], dtype=np.int32),
            "finish_reason": np.array([b"stop", b"length"], dtype=np.object_),
            "num_output_tokens": np.array([1, 2], dtype=np.uint32),
        },
        0.0,
    )
    assert (c.text, c.token_ids, c.finish_reason, c.sample_index, c.num_output_tokens) == (
        "xyz",
        [3, 4, 5],
        "stop",
        0,
        1,
    )
    assert c.raw["output_ids"] == [3, -1, 4, 5]


def test_chunk_num_tokens_fallbacks():
    assert Chunk(text="x").num_tokens == 1
    assert Chunk(text="x", num_output_tokens=3).num_tokens == 3
    assert Chunk(is_final=True).num_tokens == 0


def _c(t, text="", ids=(), **kw):
    return Chunk(text=text, token_ids=list(ids), received_at=t, **kw)


def test_completion_streaming_latencies():
    chunks = [_c(1.2, "a", [1]), _c(1.4, "bc", [2, 3]), _c(1.5, "d", [4], finish_reason="stop"), _c(1.6, is_final=True)]
    c = Completion.from_chunks(chunks, started_at=1.0)
    assert c.text == "abcd" and c.token_ids == [1, 2, 3, 4] and c.finish_reason == "stop"
    assert c.num_output_tokens == 4 and c.samples == {}
    assert c.ttft_s == pytest.approx(0.2)
    assert c.itl_s == pytest.approx([0.1, 0.1])  # 0.2 s / 2 tokens, then 0.1 s / 1 token
    assert c.mean_itl_s == pytest.approx(0.1)
    assert c.e2e_s == pytest.approx(0.6)
    assert c.tokens_per_s == pytest.approx(4 / 0.6)


def test_completion_non_streaming_uses_reported_count():
    chunks = [
        _c(
            2.0,
            "prompt + text",
            [1, 2, 3],
            num_output_tokens=2,
            num_input_tokens=5,
            finish_reason="length",
            is_final=True,
        )
    ]
    c = Completion.from_chunks(chunks, started_at=1.0)
    assert c.num_output_tokens == 2 and c.num_input_tokens == 5 and c.itl_s == [] and c.ttft_s == c.e2e_s == 1.0


def test_completion_samples():
    chunks = [
        _c(1.1, "a", [1], sample_index=0),
        _c(1.2, "x", [9], sample_index=1),
        _c(1.3, "b", [2], sample_index=0, finish_reason="length"),
        _c(1.5, "y", [8], sample_index=1, finish_reason="stop"),
        _c(1.6, is_final=True),
    ]
    c = Completion.from_chunks(chunks, started_at=1.0)
    assert sorted(c.samples) == [0, 1]
    assert (c.samples[0].text, c.samples[0].finish_reason) == ("ab", "length")
    assert (c.samples[1].text, c.samples[1].token_ids, c.samples[1].finish_reason) == ("xy", [9, 8], "stop")
    assert c.text == "ab" and c.num_output_tokens == 4
    assert c.ttft_s == pytest.approx(0.1) and c.e2e_s == pytest.approx(0.6)
    assert sorted(c.itl_s) == pytest.approx([0.2, 0.3])


def test_completion_no_tokens():
    c = Completion.from_chunks([_c(1.5, is_final=True)], started_at=1.0)
    assert c.text == "" and c.num_output_tokens == 0 and c.ttft_s is None and c.mean_itl_s is None


# ---------------------------------------------------------------------------------------------- HTTP paths


class _Handler(BaseHTTPRequestHandler):
    """generate / generate_stream stand-in: echoes the body's max_tokens as that many events."""

    def log_message(self, *args):
        pass

    def _send(self, status, body, content_type="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        n = int(body.get("max_tokens", 2))
        if self.path == "/v2/models/missing/generate":
            return self._send(400, json.dumps({"error": "Request for unknown model: 'missing' is not found"}))
        if self.path.endswith("/generate"):
            return self._send(
                200,
                json.dumps(
                    {
                        "model_name": "llm",
                        "text_output": body["text_input"] + " ok",
                        "output_ids": [1, 2],
                        "finish_reason": "stop",
                        "num_output_tokens": 2,
                    }
                ),
            )
        if n < 1:
            return self._send(400, 'data: {"error":"max_tokens must be >= 1"}\n\n', "text/event-stream")
        events = [{"text_output": f" t{i}", "output_ids": i} for i in range(n)]
        events[-1]["finish_reason"] = "length"
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        if body.get("fail"):
            text += 'data: {"error":"engine failed"}\n\n'
        self._send(200, text, "text/event-stream")


@pytest.fixture(scope="module")
def http_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}", server.bodies
    server.shutdown()


def test_stream_http(http_url):
    url, bodies = http_url
    chunks = list(stream_http("Hi", url, max_tokens=3, sampling={"top_k": 1}))
    assert [c.text for c in chunks] == [" t0", " t1", " t2", ""]
    assert [c.is_final for c in chunks] == [False, False, False, True]
    assert chunks[2].finish_reason == "length" and chunks[1].token_ids == [1]
    assert bodies[-1] == (
        "/v2/models/llm/generate_stream",
        {"text_input": "Hi", "stream": True, "sampling_parameters": '{"top_k": 1}', "max_tokens": 3, **DEFAULT_OUTPUTS},
    )


def test_collect_http(http_url):
    c = collect_http("Hi", "http://" + http_url[0], max_tokens=2)
    assert c.text == " t0 t1" and c.num_output_tokens == 2 and len(c.itl_s) == 1 and c.finish_reason == "length"


def test_stream_http_errors(http_url):
    url, _ = http_url
    with pytest.raises(ServerError, match="max_tokens must be >= 1"):
        list(stream_http("Hi", url, max_tokens=0))
    received = []
    with pytest.raises(ServerError, match="engine failed"):
        for c in stream_http("Hi", url, max_tokens=2, fail=True):
            received.append(c.text)
    assert received == [" t0", " t1"]


def test_generate_http(http_url):
    url, bodies = http_url
    c = generate_http("Hi", url, temperature=0.0)
    assert (c.text, c.token_ids, c.finish_reason, c.num_output_tokens) == ("Hi ok", [1, 2], "stop", 2)
    assert bodies[-1] == (
        "/v2/models/llm/generate",
        {"text_input": "Hi", "stream": False, "temperature": 0.0, **DEFAULT_OUTPUTS},
    )
    generate_http("Hi", url, return_finish_reason=None, return_num_input_tokens=False)
    assert bodies[-1][1] == {
        "text_input": "Hi",
        "stream": False,
        "return_num_input_tokens": False,
        "return_num_output_tokens": True,
    }
    with pytest.raises(ServerError, match="unknown model"):
        generate_http("Hi", url, model="missing")


def test_unreachable_server():
    with pytest.raises(ServerError, match="cannot reach"):
        generate_http("Hi", "127.0.0.1:1")


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_sampling_json():
    args = parse_args(
        [
            "Hi",
            "--max-tokens",
            "5",
            "--temperature",
            "0.7",
            "--stop",
            r"\n",
            "--stop",
            "é",
            "--json-params",
            '{"repetition_penalty": 1.1, "temperature": 0.2}',
            "--show-stats",
        ]
    )
    kw = request_kwargs(args)
    assert kw["url"] == "localhost:8001" and kw["model"] == "llm"
    assert kw["sampling"] == {"max_tokens": 5, "temperature": 0.2, "stop": ["\n", "é"], "repetition_penalty": 1.1}
    assert kw["return_finish_reason"] and kw["return_num_output_tokens"]


def test_cli_flat_http():
    kw = request_kwargs(parse_args(["Hi", "--protocol", "http", "--max-tokens", "5", "--seed", "1", "--flat"]))
    assert kw["url"] == "localhost:8000"
    assert kw["max_tokens"] == 5 and kw["seed"] == 1 and "sampling" not in kw
