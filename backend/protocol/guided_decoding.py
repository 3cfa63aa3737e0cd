"""Output constraints as clients ask for them, checked for shape here, in pure Python:

- vLLM's sampling-parameter keys `guided_json`, `guided_json_object`, `guided_regex`, `guided_choice`,
  `guided_grammar`;
- the `structured_outputs` object (vLLM's StructuredOutputsParams, what vllm_backend's `sampling_parameters` take):
  one of `json`, `json_object`, `regex`, `choice`, `grammar`, `structural_tag`, with the options
  `disable_any_whitespace`, `disable_additional_properties`, `whitespace_pattern`;
- the `guided_decoding` object (vLLM's older GuidedDecodingParams, what vllm_backend took before
  `structured_outputs`): the same, plus `backend` and `disable_fallback`.

An object may come as JSON text (vllm_backend's clients send `json.dumps(...)`) or as an object.
backend/sampling/structured_output.py turns a constraint into an llguidance grammar and compiles it on the engine's
side, where a grammar that does not compile fails its request with the compiler's message."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from backend.protocol.values import InvalidRequest, as_bool

# vLLM's sampling-parameter keys and the constraint each asks for (the kinds are the keys of the objects below).
_GUIDED_KEYS = {
    "guided_json": "json",
    "guided_json_object": "json_object",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# StructuredOutputsParams' options: how JSON is written (no effect on the other kinds, as in vLLM)
_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern")
# GuidedDecodingParams' own: the backend (every vLLM backend's name is served by ours, llguidance) and its options
_LEGACY_OPTIONS = ("backend", "disable_fallback")
VLLM_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
_BACKEND_OPTIONS = {
    "no-fallback": None,  # there is one backend: nothing to fall back from
    "disable-any-whitespace": "disable_any_whitespace",
    "no-additional-properties": "disable_additional_properties",
}
OBJECT_KEYS = {
    "structured_outputs": KINDS + _OPTIONS,
    "guided_decoding": KINDS + _OPTIONS + _LEGACY_OPTIONS,
}
CONSTRAINT_KEYS = sorted(_GUIDED_KEYS) + sorted(OBJECT_KEYS)


@dataclass(frozen=True)
class GuidedDecoding:
    """One output constraint. `kind`: one of KINDS; `key`: the client's key (named in error messages); `spec`: the
    constraint as text (a JSON schema, choice list or structural tag as JSON, a regular expression, a Lark or GBNF
    grammar; empty for json_object). JSON (json, json_object and a structural tag's schemas) is written without
    whitespace between tokens unless `any_whitespace` (vLLM's `disable_any_whitespace: false`, given explicitly)
    or a `whitespace_pattern` (the whitespace allowed there, a regular expression) says otherwise."""

    kind: str
    key: str
    spec: str
    any_whitespace: bool = False
    whitespace_pattern: str | None = None


def pop_guided_decoding(values: dict[str, Any]) -> GuidedDecoding | None:
    """Remove the structured-output keys from a request's parameters and return the constraint they ask for (at
    most one per request)."""
    found = [(key, _GUIDED_KEYS[key], values.pop(key)) for key in list(values) if key in _GUIDED_KEYS]
    options: dict[str, Any] = {}
    for name in OBJECT_KEYS:
        nested = values.pop(name, None)
        if nested is not None:
            found += _object_constraints(name, nested, options)
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
    spec = _spec(key, kind, value, bool(options.get("disable_additional_properties")))
    disable_any_whitespace = options.get("disable_any_whitespace")
    return GuidedDecoding(kind, key, spec, disable_any_whitespace is False, options.get("whitespace_pattern"))


def _object_constraints(name: str, nested: Any, options: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """The constraints of a `structured_outputs` / `guided_decoding` object; its options go into `options`."""
    nested = _from_json_text(name, nested, "a JSON object")
    if not isinstance(nested, dict):
        raise InvalidRequest(f"{name} must be an object, got {type(nested).__name__}")
    allowed = OBJECT_KEYS[name]
    unknown = sorted(set(nested) - set(allowed))
    if unknown:
        raise InvalidRequest(f"unknown {name} key(s) {unknown}; allowed: {sorted(allowed)}")
    constraints = [(f"{name}.{kind}", kind, value) for kind, value in nested.items() if kind in KINDS]
    if not any(value is not None for _, _, value in constraints):
        raise InvalidRequest(f"{name} names no constraint: give one of {list(KINDS)}")
    for option in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if nested.get(option) is not None:
            options[option] = as_bool(f"{name}.{option}", nested[option])
    pattern = nested.get("whitespace_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or not pattern:
            raise InvalidRequest(
                f"{name}.whitespace_pattern must be a non-empty string (a regular expression), got {pattern!r}"
            )
        options["whitespace_pattern"] = pattern
    if nested.get("backend") is not None:
        options.update(_backend_options(f"{name}.backend", nested["backend"]))
    return constraints


def _backend_options(key: str, value: Any) -> dict[str, bool]:
    """vLLM's `backend` is `name` or `name:option,option`; the name may be any of vLLM's (the grammar is the same
    language whichever library compiles it), the options those of vLLM's that change the output's language."""
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{key} must be a string, one of {list(VLLM_BACKENDS)}, got {value!r}")
    backend, _, listed = value.partition(":")
    if backend.strip() not in VLLM_BACKENDS:
        raise InvalidRequest(f"{key} must be one of {list(VLLM_BACKENDS)} (optionally name:options), got {value!r}")
    options = {}
    for option in filter(None, (o.strip() for o in listed.split(","))):
        if option not in _BACKEND_OPTIONS:
            raise InvalidRequest(f"{key} option {option!r} is not one of {sorted(_BACKEND_OPTIONS)}")
        if _BACKEND_OPTIONS[option] is not None:
            options[_BACKEND_OPTIONS[option]] = True
    return options


def _spec(key: str, kind: str, value: Any, closed_objects: bool) -> str:
    """The constraint's text; malformed values (not well-formed JSON, wrong types) raise InvalidRequest.
    `closed_objects` (vLLM's disable_additional_properties): an object schema that lists properties and says
    nothing of others allows none."""
    if kind == "json_object":
        return ""
    if kind == "json":
        schema = _schema(key, value)
        return json.dumps(_closed(schema) if closed_objects else schema)
    if kind == "structural_tag":
        return json.dumps(_structural_tag(key, value, closed_objects))
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise InvalidRequest(f"{key} must be a non-empty list of non-empty strings, got {value!r}")
        return json.dumps(value)
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{key} must be a non-empty string, got {value!r}")
    return value


def _from_json_text(key: str, value: Any, what: str) -> Any:
    """`value`, or what its JSON text holds where it is a string."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{key} must be {what}: {exc.msg} at position {exc.pos}") from None


def _schema(key: str, value: Any) -> dict | bool:
    value = _from_json_text(key, value, "a JSON schema")
    if not isinstance(value, (dict, bool)):
        raise InvalidRequest(f"{key} must be a JSON schema (an object), got {type(value).__name__}")
    return value


_TAG_SHAPE = '{"structures": [{"begin": str, "schema": object, "end": str}, ...], "triggers": [str, ...]}'


def _structural_tag(key: str, value: Any, closed_objects: bool) -> dict:
    """vLLM's structural tag, `{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}`: free text in
    which each structure, once its trigger appears, is its begin text, JSON fitting its schema, then its end text."""
    value = _from_json_text(key, value, "JSON")
    if not isinstance(value, dict):
        raise InvalidRequest(f"{key} must be {_TAG_SHAPE}, got {type(value).__name__}")
    if "format" in value:
        raise InvalidRequest(
            f"{key}: the 'format' form of a structural tag (xgrammar's) is not served; give {_TAG_SHAPE}"
        )
    if value.get("type", "structural_tag") != "structural_tag":
        raise InvalidRequest(f"{key}.type must be 'structural_tag' where given, got {value['type']!r}")
    unknown = sorted(set(value) - {"structures", "triggers", "type"})
    if unknown:
        raise InvalidRequest(f"{key}: unknown key(s) {unknown}; give {_TAG_SHAPE}")
    triggers, structures = value.get("triggers"), value.get("structures")
    if not (isinstance(triggers, list) and triggers and all(isinstance(t, str) and t for t in triggers)):
        raise InvalidRequest(f"{key}.triggers must be a non-empty list of non-empty strings, got {triggers!r}")
    if not (isinstance(structures, list) and structures):
        raise InvalidRequest(f"{key}.structures must be a non-empty list, got {structures!r}")
    checked = []
    for i, structure in enumerate(structures):
        where = f"{key}.structures[{i}]"
        if not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"}:
            raise InvalidRequest(f"{where} must be an object with exactly begin, schema and end, got {structure!r}")
        begin, end = structure["begin"], structure["end"]
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidRequest(f"{where}.begin and .end must be strings")
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise InvalidRequest(f"{where}.begin {begin!r} starts with none of the triggers {triggers}")
        schema = _schema(f"{where}.schema", structure["schema"])
        if not isinstance(schema, dict):
            raise InvalidRequest(f"{where}.schema must be a JSON schema object, got {schema!r}")
        checked.append(
            {"trigger": trigger, "begin": begin, "schema": _closed(schema) if closed_objects else schema, "end": end}
        )
    return {"structures": checked}


# JSON Schema keywords whose value maps names to subschemas, and those whose value is a subschema or a list of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = (
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
)


def _closed(schema: dict | bool) -> dict | bool:
    """A copy of the schema in which every object schema that lists properties and sets no additionalProperties
    gets additionalProperties false."""
    schema = copy.deepcopy(schema)

    def close(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                close(item)
            return
        if not isinstance(node, dict):
            return
        for keyword in _SCHEMA_MAPS:
            if isinstance(node.get(keyword), dict):
                for sub in node[keyword].values():
                    close(sub)
        for keyword in _SUBSCHEMAS:
            close(node.get(keyword))
        lists_properties = isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
        if lists_properties and "additionalProperties" not in node:
            node["additionalProperties"] = False

    close(schema)
    return schema
