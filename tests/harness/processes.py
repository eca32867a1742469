"""Ending a process the harness started."""

from __future__ import annotations

import signal
import subprocess


def end(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout` s; reaped either way (one that
    already exited is only reaped)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
