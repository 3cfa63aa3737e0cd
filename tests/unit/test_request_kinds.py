"""backend/serving/request_kinds.py: the kind of a request to the `llm` model, read once from its parameters, and
what its handler needs."""

from __future__ import annotations

import json

from backend.serving.request_kinds import RequestKind, route


def test_a_plain_request_generates_with_its_parameters_untouched():
    routed = route('{"temperature": 0.5}')
    assert routed.kind == RequestKind.GENERATE and routed.parameters == '{"temperature": 0.5}'
    assert routed.forwarded_id is None and route("").kind == RequestKind.GENERATE


def test_a_forwarded_request_generates_without_the_forwarding_parameter():
    routed = route(json.dumps({"forwarded_id": "f1", "max_tokens": 3}))
    assert routed.kind == RequestKind.GENERATE and routed.forwarded_id == "f1"
    assert json.loads(routed.parameters) == {"max_tokens": 3}


def test_the_other_kinds():
    assert route(json.dumps({"batch_view": True})).kind == RequestKind.BATCH_VIEW
    admin = route(json.dumps({"lora_adapters": {"action": "list"}}))
    assert admin.kind == RequestKind.LORA_ADMIN and admin.lora_action == {"action": "list"}
    cancel = route(json.dumps({"cancel_forwarded": "f1"}))
    assert cancel.kind == RequestKind.CANCEL_FORWARDED and cancel.cancel_id == "f1"
