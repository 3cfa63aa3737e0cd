"""benchmarks/core/thread_cpu.py: a server's CPU split by the names its threads carry, measured from /proc on a real
child process named as Triton's Python stub is, with a busy kernel worker and an idle output sender."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from benchmarks.core import thread_cpu

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads Linux's /proc")

STUB = textwrap.dedent(
    """
    import sys, threading, time
    from backend.core.named_thread import NamedThread, set_os_thread_name
    set_os_thread_name("triton_python_backend_stub")  # the main thread's name is the process's
    def busy():
        while time.thread_time() < 0.4:  # CPU seconds of this thread, however busy the machine is
            pass
        print("spun", flush=True)
        sys.stdin.readline()  # alive until measured: /proc forgets a thread that ended
    NamedThread(threading.Event().wait, "llm-output-sender", service=True).start()
    worker = NamedThread(busy, "llm-kernel-1")
    print("ready", flush=True)
    sys.stdin.readline()
    worker.start()
    worker.join()
    """
)


def test_a_busy_kernel_worker_counts_for_the_engine_and_a_sleeping_sender_for_little():
    child = subprocess.Popen([sys.executable, "-c", STUB], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        pids = thread_cpu.process_tree(child.pid)  # not this process's: a test server may be its child
        assert pids == [child.pid]
        before = thread_cpu.snapshot(pids)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "spun"
        used = thread_cpu.difference(thread_cpu.snapshot(pids), before)
        child.stdin.write("done\n")
        child.stdin.flush()
    finally:
        child.communicate(timeout=10)
    assert used[thread_cpu.ENGINE].cpu_s > 0.3  # the worker spun for 0.4 s of CPU
    assert used["output sender"].cpu_s < 0.05
    assert used["tritonserver"].cpu_s == 0  # no such process here
    assert set(used) == {g for g, _, _ in thread_cpu.GROUPS} | {thread_cpu.CLIENT}
