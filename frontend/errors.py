"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status."""

from __future__ import annotations

import json

from aiohttp import web


class APIError(Exception):
    """An error answered to the client as OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def sse(self) -> bytes:
        """The error as a server-sent event, for a stream whose 200 status is already sent."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unsupported(param: str, why: str = "") -> APIError:
    return bad_request(f"'{param}' is not supported by this server{why}", param, "unsupported_parameter")


def model_not_found(model: str, served: list[str]) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist; served: {served}",
        "invalid_request_error",
        "model",
        "model_not_found",
    )


def body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body exceeds the limit of {limit} bytes", "invalid_request_error", None, "request_too_large"
    )


RETRY_AFTER_S = 1  # what a refused client is told to wait (the queue drains in seconds, not minutes)


def server_busy(message: str) -> APIError:
    return APIError(503, message, "server_busy", None, "server_busy", {"Retry-After": str(RETRY_AFTER_S)})


def unauthorized() -> APIError:
    return APIError(
        401,
        "a valid API key is required: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
        "invalid_request_error",
        None,
        "invalid_api_key",
        {"WWW-Authenticate": "Bearer"},
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable")


def internal_error(message: str) -> APIError:
    return APIError(500, message, "internal_server_error", None, None)
