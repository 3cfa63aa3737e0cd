"""Client values as they arrive (JSON or tensors, maybe as strings: GenAI-Perf sends them so) turned into typed
values, and the error that says what was wrong: `InvalidRequest`, whose message is meant for the client."""

from __future__ import annotations

import math

from backend.protocol.wire import INVALID_REQUEST


class InvalidRequest(ValueError):
    """A request the engine refuses; the message is meant for the client."""

    kind = INVALID_REQUEST


def in_range(name: str, value, low, high, hint: str = "") -> None:
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}{hint}, got {value}")


def as_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise InvalidRequest(f"{name} must be an integer, got {value!r}")


def as_float(name: str, value) -> float:
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number, got {value!r}")
    return number


def as_bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidRequest(f"{name} must be true or false, got {value!r}")
