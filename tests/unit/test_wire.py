"""backend/protocol/wire.py: the Triton wire contract agrees with the model's config.pbtxt, and error kinds survive
the trip through a message."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from backend.protocol import wire
from backend.protocol.wire import ERROR_KINDS, ErrorText, error_text, parse_error

CONFIG = Path(__file__).resolve().parents[2] / "model_repository" / "llm" / "config.pbtxt"
_TENSOR = re.compile(r'name: "(\w+)",\s*data_type: TYPE_(\w+),\s*dims: \[ ([-\d, ]+) \]')


def declared(section: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The tensors config.pbtxt declares in its `input` or `output` list, as wire.py writes them."""
    text = CONFIG.read_text()
    body = text.split(f"\n{section} [", 1)[1].split("\n]", 1)[0]
    return {
        name: ({"STRING": "BYTES"}.get(dtype, dtype), tuple(int(d) for d in dims.split(",")))
        for name, dtype, dims in _TENSOR.findall(body)
    }


def test_inputs_match_the_model_config():
    assert declared("input") == wire.INPUTS


def test_outputs_match_the_model_config():
    assert declared("output") == wire.OUTPUTS


def test_input_groups():
    assert set(wire.LIST_INPUTS) == {"input_ids", "stop", "stop_words", "bad_words", "stop_token_ids"}
    assert all(f"return_{name}" in wire.INPUTS for name in wire.OPTIONAL_OUTPUTS)
    assert set(wire.OPTIONAL_OUTPUTS) <= set(wire.OUTPUTS)
    assert len(set(wire.INPUT_NAMES)) == len(wire.INPUT_NAMES)


@pytest.mark.parametrize("kind", ERROR_KINDS)
def test_error_kinds_round_trip(kind):
    message = "server busy: 4 requests are already waiting\n(max_queue_size=4); retry later"
    assert parse_error(error_text(message, kind)) == (kind, message)
    assert parse_error(error_text(ErrorText(message, kind))) == (kind, message)


def test_error_text_is_a_string_with_a_kind():
    error = ErrorText("the server is shutting down", wire.UNAVAILABLE)
    assert error == "the server is shutting down" and error.startswith("the server") and error.kind == "unavailable"
    assert error_text("plain") == "[internal] plain"  # a message without a kind is the engine's failure
    assert parse_error("unexpected inference input 'x'") == (None, "unexpected inference input 'x'")
    assert parse_error("[unknown_kind] text") == (None, "[unknown_kind] text")
    with pytest.raises(ValueError, match="unknown error kind"):
        ErrorText("x", "busy")


def test_the_protocol_room_imports_no_engine_library():
    """The front door and the client validate requests with this room: it must stay light."""
    code = (
        "import sys, backend.protocol.wire, backend.protocol.sampling_params, backend.protocol.guided_decoding; "
        "heavy = {'torch', 'numpy', 'llguidance', 'transformers'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CONFIG.parents[2])
