"""Output constraints as clients ask for them (vLLM's `guided_*` keys and `structured_outputs` object), checked
for shape here, in pure Python; backend/sampling/structured_output.py turns them into llguidance grammars and
compiles them on the engine's side, where a grammar that does not compile fails its request with the
compiler's message."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backend.protocol.values import InvalidRequest, as_bool

# vLLM's sampling-parameter keys (also the keys of its newer `structured_outputs` object, less the prefix).
_GUIDED_KEYS = {
    "guided_json": "json",
    "guided_json_object": "json_object",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_OUTPUTS_KEY = "structured_outputs"
CONSTRAINT_KEYS = sorted(_GUIDED_KEYS) + [_STRUCTURED_OUTPUTS_KEY]


@dataclass(frozen=True)
class GuidedDecoding:
    """One output constraint. `kind`: json, json_object, regex, choice or grammar; `key`: the client's key (named in
    error messages); `spec`: the constraint as text (a JSON schema or choice list as JSON, a regular expression,
    a Lark or GBNF grammar; empty for json_object)."""

    kind: str
    key: str
    spec: str


def pop_guided_decoding(values: dict[str, Any]) -> GuidedDecoding | None:
    """Remove the structured-output keys from a request's parameters and return the constraint they ask for.

    Accepts vLLM's `guided_json` / `guided_json_object` / `guided_regex` / `guided_choice` / `guided_grammar` and
    the `structured_outputs` object (`{"json": ...}`, `{"regex": ...}`, ...); at most one constraint per request.
    """
    found = [(key, _GUIDED_KEYS[key], values.pop(key)) for key in list(values) if key in _GUIDED_KEYS]
    nested = values.pop(_STRUCTURED_OUTPUTS_KEY, None)
    if isinstance(nested, str):
        try:
            nested = json.loads(nested)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"structured_outputs must be a JSON object: {exc.msg} at position {exc.pos}") from None
    if nested is not None:
        if not isinstance(nested, dict):
            raise InvalidRequest(f"structured_outputs must be an object, got {type(nested).__name__}")
        unknown = sorted(set(nested) - set(_GUIDED_KEYS.values()))
        if unknown:
            raise InvalidRequest(
                f"unknown structured_outputs key(s) {unknown}; allowed: {sorted(_GUIDED_KEYS.values())}"
            )
        found += [(f"structured_outputs.{kind}", kind, value) for kind, value in nested.items()]
    # json_object is a flag: false (or null, for any key) asks for nothing
    found = [
        (key, kind, value)
        for key, kind, value in found
        if value is not None and (kind != "json_object" or as_bool(key, value))
    ]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequest(f"give at most one output constraint, got {[key for key, _, _ in found]}")
    ((key, kind, value),) = found
    return GuidedDecoding(kind, key, _spec(key, kind, value))


def _spec(key: str, kind: str, value: Any) -> str:
    """The constraint's text; malformed values (not well-formed JSON, wrong types) raise InvalidRequest."""
    if kind == "json_object":
        return ""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise InvalidRequest(f"{key} must be a JSON schema: {exc.msg} at position {exc.pos}") from None
        if not isinstance(value, (dict, bool)):
            raise InvalidRequest(f"{key} must be a JSON schema (an object), got {type(value).__name__}")
        return json.dumps(value)
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{key} must be a non-empty list of non-empty strings, got {value!r}")
        return json.dumps(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{key} must be a non-empty string, got {value!r}")
    return value
