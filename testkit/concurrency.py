"""Running calls at once and reporting their failures together."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def run_concurrently(fn: Callable[..., Any], arg_list: list[tuple], timeout_s: float = 300.0) -> list[Any]:
    """Call fn(*args) for every args at once (one thread each, released together by a barrier).

    Returns the results in order; an exception is returned in its slot (not raised), so a caller sees all.
    """
    barrier = threading.Barrier(len(arg_list))

    def call(args):
        barrier.wait(timeout=60)
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            return exc

    with ThreadPoolExecutor(max_workers=len(arg_list)) as pool:
        futures = [pool.submit(call, args) for args in arg_list]
        return [f.result(timeout=timeout_s) for f in futures]


def raise_first_error(results: list[Any], what: str = "request") -> None:
    """AssertionError listing the exceptions among `results` (the first 8), if there are any."""
    errors = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    if errors:
        lines = [f"  #{i}: {type(e).__name__}: {e}" for i, e in errors[:8]]
        raise AssertionError(f"{len(errors)} of {len(results)} {what}s failed:\n" + "\n".join(lines))
