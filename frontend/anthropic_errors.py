"""Errors on the Anthropic routes (`/v1/messages`, `/v1/messages/count_tokens`) in Anthropic's shape:
`{"type": "error", "error": {"type", "message"}}`, with the status Anthropic gives each type. The front door's
errors are raised as `APIError` (frontend/errors.py) everywhere; on these routes the error middleware
(frontend/app.py) answers them with `error_response` instead of OpenAI's object."""

from __future__ import annotations

from aiohttp import web

from .errors import APIError

ROUTE = "/v1/messages"  # the Messages API and the routes under it

# HTTP status -> Anthropic's error type (a status not listed: api_error)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
OVERLOADED_STATUS = 529  # Anthropic's status for a server too busy to take the request (its SDK's OverloadedError)


def is_anthropic_route(path: str) -> bool:
    return path == ROUTE or path.startswith(ROUTE + "/")


def status_of(error: APIError) -> int:
    """The status Anthropic gives the error: a full queue (`server_busy`) is its 529, the rest keep theirs."""
    return OVERLOADED_STATUS if error.code == "server_busy" else error.status


def error_body(error: APIError) -> dict:
    """Anthropic's error object; its message names the field (OpenAI's `param`) where the text does not already."""
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": _TYPES.get(status_of(error), "api_error"), "message": message}}


def error_response(error: APIError) -> web.Response:
    return web.json_response(error_body(error), status=status_of(error), headers=error.headers)
