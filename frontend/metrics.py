"""`/metrics`: the front door's own counters in Prometheus' text format, followed by the Triton server's
metrics when its metrics URL is known (so one scrape, or AIPerf's probe of the endpoint's `/metrics`, sees
both). Answers GET and HEAD."""

from __future__ import annotations

from collections import Counter

import aiohttp
from aiohttp import web


class FrontDoorMetrics:
    def __init__(self):
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status) -> finished requests
        self.in_flight = 0

    def render(self) -> str:
        lines = [
            "# HELP frontdoor_requests_total OpenAI API requests answered, by route and HTTP status.",
            "# TYPE frontdoor_requests_total counter",
            *(
                f'frontdoor_requests_total{{route="{route}",status="{status}"}} {count}'
                for (route, status), count in sorted(self.requests.items())
            ),
            "# HELP frontdoor_requests_in_flight OpenAI API requests being answered.",
            "# TYPE frontdoor_requests_in_flight gauge",
            f"frontdoor_requests_in_flight {self.in_flight}",
        ]
        return "\n".join(lines) + "\n"


async def triton_metrics(session: aiohttp.ClientSession, url: str) -> str:
    """The Triton server's metrics page, or a comment saying why not."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
            if resp.status == 200:
                return await resp.text()
            return f"# triton metrics at {url}: HTTP {resp.status}\n"
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"# triton metrics at {url} unavailable: {exc!r}\n"


def metrics_response(own: FrontDoorMetrics, triton_text: str) -> web.Response:
    return web.Response(
        text=own.render() + triton_text,
        content_type="text/plain",
        charset="utf-8",
        headers={"X-Content-Type-Options": "nosniff"},
    )
