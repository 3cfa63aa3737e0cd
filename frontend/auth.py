"""The API key: with one set (`--api-key`, or LLM_API_KEY in the environment), every OpenAI and Anthropic
route, /tokenize, /detokenize and the web page's calls need `Authorization: Bearer <key>` or Anthropic's
`x-api-key: <key>`; /health, /health/ready, /metrics and the page's static files stay open (probes and scrapers
carry no key; the page asks for the key itself). The comparison takes constant time and the key is never logged."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from .errors import unauthorized

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


def api_key_middleware(api_key: str):
    bearer, key = f"Bearer {api_key}".encode(), api_key.encode()

    @web.middleware
    async def require_key(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if request.path.startswith(PROTECTED_PREFIXES):
            # both compared, whichever is sent: the time taken says nothing of which one matched
            by_bearer = hmac.compare_digest(request.headers.get("Authorization", "").encode(), bearer)
            by_header = hmac.compare_digest(request.headers.get("x-api-key", "").encode(), key)
            if not (by_bearer or by_header):
                raise unauthorized()
        return await handler(request)

    return require_key
