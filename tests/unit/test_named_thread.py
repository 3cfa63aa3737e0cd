"""NamedThread: the OS sees the thread's name, and a service thread runs below the step's threads."""

import os
import sys
import threading

import pytest

from backend.core.named_thread import SERVICE_NICE, NamedThread

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="thread names and priorities per thread are Linux's")


def _observe(service: bool) -> tuple[str, int]:
    seen = {}

    def body():
        tid = threading.get_native_id()
        seen["comm"] = open(f"/proc/self/task/{tid}/comm").read().strip()
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, tid)

    thread = NamedThread(body, "llm-test-thread", service=service)
    thread.start()
    thread.join()
    return seen["comm"], seen["nice"]


def test_the_os_sees_the_threads_name_and_its_priority_is_left_alone():
    comm, nice = _observe(service=False)
    assert comm == "llm-test-thread"
    assert nice == os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_service_thread_runs_below_the_thread_that_started_it():
    comm, nice = _observe(service=True)
    assert comm == "llm-test-thread"
    assert nice == min(19, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + SERVICE_NICE)
