"""Shared fixtures: one real Prefect API for the session, and a leak check after every test."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_TO_API_BATCH_INTERVAL", "0.3")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402
import pytest  # noqa: E402

ROLES = ("skytasks.agent", "skytasks.worker")


def skytasks_processes() -> list[psutil.Process]:
    """Every node agent and rank process on this machine, orphans included."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if any(role in cmd for role in ROLES) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def wait_for_no_skytasks_processes(timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := skytasks_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture(scope="session", autouse=True)
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture(autouse=True)
def no_leaked_processes():
    yield
    left = wait_for_no_skytasks_processes()
    assert not left, f"leaked skytasks processes: {[(p.pid, p.cmdline()) for p in left]}"
