"""Threads that carry their name into the operating system, so `top -H`, `ps -L` and /proc show which of the
server's threads takes the CPU (the engine loop, the kernels' workers, the output sender, the metrics
publisher, ...; Python names its threads only for itself before 3.14), and that can step back for the step.

A step's kernels keep every core busy, so a service thread (sending responses, publishing metrics) that wakes
mid-step takes a core from a kernel worker, and the whole op then waits for that worker's chunk: the step loses
about twice the CPU the service thread used. Run `SERVICE_NICE` levels below the step, a service thread still
gets its share over time, but the scheduler runs it when a core goes idle (between ops, during the step's
Python) instead of preempting the kernel. Measured through Triton: up to +10 %, or within the noise
(docs/benchmarks.md, "Service threads behind the step")."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

SERVICE_NICE = 10  # added to a service thread's nice value; raising it needs no privilege
_PR_SET_NAME = 15  # linux/prctl.h
_libc = ctypes.CDLL(None, use_errno=True)  # the process's own symbols, libc's among them


def set_os_thread_name(name: str) -> None:
    """Name the calling thread for the OS (Linux keeps 15 bytes); a no-op where prctl is missing."""
    prctl = getattr(_libc, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def lower_thread_priority(by: int) -> None:
    """Raise the calling thread's nice value by `by`. Linux only: it schedules threads one by one, and elsewhere
    a thread id given as a process id could name another process."""
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError as exc:  # a sandbox without setpriority
        log.debug("could not lower thread %s's priority: %s", tid, exc)


class NamedThread(threading.Thread):
    """A `threading.Thread` whose OS-level name is its Python name; `service=True` for threads that should
    yield the cores to the step (see the module's docstring)."""

    def __init__(self, target, name: str, args: tuple = (), daemon: bool = True, service: bool = False):
        super().__init__(target=target, name=name, args=args, daemon=daemon)
        self.service = service

    def run(self) -> None:
        set_os_thread_name(self.name)
        if self.service:
            lower_thread_priority(SERVICE_NICE)
        super().run()
