"""Reading a request body: a size cap while reading, a nesting bound before parsing, then JSON.

Python's JSON parser recurses once per nesting level: a body of 100,000 `[` would end in RecursionError (a
500) after a long parse. Real OpenAI bodies nest a few levels (a JSON schema inside a tool inside a list:
a dozen or two), so anything deeper than MAX_JSON_DEPTH is refused as a 400 before parsing. The depth is
measured with one regular-expression pass that skips over strings, so brackets inside text do not count.
"""

from __future__ import annotations

import json
import re

from aiohttp import web

from .errors import bad_request, body_too_large

READ_CHUNK_BYTES = 64 << 10
MAX_JSON_DEPTH = 64
# a JSON string (escapes included), or one bracket
_STRING_OR_BRACKET = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


async def read_json(request: web.Request, limit: int):
    """The body as JSON, read with a cap: past `limit` bytes the reading stops and the answer is 413."""
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    body = bytearray()
    async for chunk in request.content.iter_chunked(READ_CHUNK_BYTES):
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    return parse_json(bytes(body))


def parse_json(body: bytes):
    if too_deep(body):
        raise bad_request(
            f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep; at most {MAX_JSON_DEPTH} are allowed"
        )
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the interpreter allows despite the bound (a lowered recursion limit)
        raise bad_request("the request body nests JSON too deeply") from None


def too_deep(body: bytes) -> bool:
    """Whether arrays and objects in `body` nest deeper than MAX_JSON_DEPTH (brackets in strings do not count)."""
    depth = 0
    for match in _STRING_OR_BRACKET.finditer(body):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False
