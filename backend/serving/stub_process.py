"""The end of a Python stub process. Once a model's `finalize` has run, all that is left is the interpreter's
teardown (torch, transformers and the rest: 0.6 s for one stub, seconds for several on two cores), which Triton
waits for within its exit timeout and nothing of ours needs (docs/engine.md, "Start and stop"); every model of
ours ends its stub with `exit_stub_process` instead."""

from __future__ import annotations

import os
import sys


def exit_stub_process() -> None:
    """End the stub process now, its output flushed, skipping the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)
