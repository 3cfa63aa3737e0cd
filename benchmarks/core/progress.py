"""The progress lines of a benchmark run, timestamped, on stdout."""

from __future__ import annotations

import time


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)
