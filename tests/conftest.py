"""Shared by both suites: under CI (CI=true, as `.ci/run` sets) a test that would be skipped for a missing
part of the set-up (the model, tritonserver, a browser, a tool) fails instead, so a broken set-up cannot pass
CI by skipping; outside CI such tests skip and say what to build. A test the machine itself cannot run (an
instruction set its CPU lacks, huge pages its kernel does not offer) skips everywhere: `machine_lacks`."""

from __future__ import annotations

import os

import pytest

from launcher.paths import MODEL_DIR, REPO_ROOT

# What the suites need from the set-up (`make test` builds each first), with the target that builds it.
REQUIRED_SET_UP = {
    MODEL_DIR / "config.json": "make model",
    REPO_ROOT / ".triton" / "backends" / "python" / "triton_python_backend_stub": "make triton",
}


# The reason of every skip for what the machine lacks, which no set-up step can build.
MACHINE_LACKS = "this machine lacks "


def machine_lacks(what: str) -> str:
    """The reason for a skip (`pytest.skip`, `skipif`) because this machine's CPU or kernel lacks `what`: under
    CI it stays a skip, since CI runs on whatever kind of CPU it is given."""
    return MACHINE_LACKS + what


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def pytest_sessionstart(session):
    """Under CI a missing part of the set-up ends the run at once, with one message saying what to build."""
    missing = [
        f"{path.relative_to(REPO_ROOT)} (built by `{target}`)"
        for path, target in REQUIRED_SET_UP.items()
        if not path.exists()
    ]
    if missing and in_ci():
        pytest.exit(
            "CI=true and the set-up is incomplete, so the suite cannot run: missing " + "; ".join(missing), returncode=3
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and in_ci() and not hasattr(report, "wasxfail"):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if MACHINE_LACKS in why:
            return
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (the full set-up is required): {why}"
