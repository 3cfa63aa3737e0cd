"""Shared by both suites: under CI (CI=true, as `.ci/run` sets) a test that would be skipped for a missing
part of the set-up (the model, tritonserver, a browser, a tool) fails instead, so a broken set-up cannot pass
CI by skipping; outside CI such tests skip and say what to build."""
from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI", "").lower() in ("true", "1") and not hasattr(report, "wasxfail"):
        why = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true (the full set-up is required): {why}"
