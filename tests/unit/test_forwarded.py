"""backend/serving/forwarded.py: the request parameters between the forwarding models and `llm`, and the registry
through which a forwarding model's cancel reaches the request it forwarded."""

from __future__ import annotations

import json

from backend.protocol.wire import CANCEL_FORWARDED, FORWARDED_ID
from backend.serving.forwarded import ForwardedRequests, split_parameters


def test_plain_parameters_pass_through_untouched():
    assert split_parameters('{"temperature": 0}') == (None, None, '{"temperature": 0}')
    assert split_parameters("") == (None, None, "")


def test_the_forwarding_keys_are_taken_out():
    forwarded, cancel, rest = split_parameters(json.dumps({FORWARDED_ID: "abc", "max_tokens": 3}))
    assert (forwarded, cancel, json.loads(rest)) == ("abc", None, {"max_tokens": 3})
    forwarded, cancel, rest = split_parameters(json.dumps({CANCEL_FORWARDED: "abc"}))
    assert (forwarded, cancel, json.loads(rest)) == (None, "abc", {})


def test_malformed_parameters_are_left_for_the_request_parser():
    text = '{"forwarded_id": '
    assert split_parameters(text) == (None, None, text)


def test_a_cancel_reaches_only_a_request_in_flight():
    registry = ForwardedRequests()
    registry.cancel("early")  # not in flight: forgotten, so the registry cannot grow from stray cancels
    registry.track("early")
    assert not registry.is_cancelled("early")
    registry.cancel("early")
    assert registry.is_cancelled("early")
    registry.done("early")
    assert not registry.is_cancelled("early") and len(registry) == 0
