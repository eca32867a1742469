"""Ending a process the harness started, and a harness's daemons with the session however it ends."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from typing import Callable

_STOPS: dict[int, Callable[[bool], None]] = {}  # id(owner) -> its stop(quick)
_installed = False


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


def stop_with_session(owner: object, stop: Callable[[bool], None]) -> None:
    """`stop(quick)` runs at interpreter exit (quick False) and on SIGTERM (quick True; the process
    then ends as SIGTERM would), unless `forget(owner)` came first: a session ended by `timeout`
    leaves no cluster behind. One handler serves every harness, so the SLURM cluster's and the
    Kubernetes cluster's are both stopped whichever started first."""
    global _installed
    _STOPS[id(owner)] = stop
    if not _installed:
        _installed = True
        atexit.register(_stop_all, False)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def forget(owner: object) -> None:
    _STOPS.pop(id(owner), None)


def _stop_all(quick: bool) -> None:
    for stop in list(_STOPS.values()):
        try:
            stop(quick)
        except Exception:  # noqa: BLE001 - the others are stopped all the same
            pass


def _on_sigterm(signum, frame) -> None:
    _stop_all(True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
