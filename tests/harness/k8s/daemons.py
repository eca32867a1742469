"""The cluster's daemons: started to die with this process, stopped with their process groups, and every
cluster stopped at exit or on SIGTERM (tests.harness.processes.stop_with_session)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from tests.harness.processes import forget, stop_with_session

if TYPE_CHECKING:
    from tests.harness.k8s.cluster import K8sCluster

def _popen(argv: list[str], log: Path, **kw) -> subprocess.Popen:
    """A daemon in a process group of its own that the kernel kills when this thread exits."""
    with open(log, "ab") as out:
        return subprocess.Popen(["setpriv", "--pdeathsig", "KILL", *argv], stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **kw)


def _popen_kept(argv: list[str], log: Path) -> subprocess.Popen:
    """`_popen` from a thread of its own that waits on the daemon: it dies with this process, not
    with the thread that asked for it (a node restarted from a test's helper thread outlives it)."""
    started: list[subprocess.Popen | BaseException] = []
    up = threading.Event()

    def keep() -> None:
        try:
            started.append(_popen(argv, log))
        except BaseException as e:
            started.append(e)
        up.set()
        if isinstance(started[0], subprocess.Popen):
            started[0].wait()

    threading.Thread(target=keep, daemon=True, name=f"keeps {Path(argv[0]).name}").start()
    up.wait()
    if isinstance(started[0], BaseException):
        raise started[0]
    return started[0]


# -- images --------------------------------------------------------------------------------------


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _killpg(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


def _reap(p: subprocess.Popen, grace: float = 10.0) -> None:
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    # the rest of its group (socat's forks)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# -- stopping at exit ----------------------------------------------------------------------------


def _register(c: K8sCluster) -> None:
    # on SIGTERM without waiting for a stop already under way (the kernel ends the daemons then)
    stop_with_session(c, lambda quick: c.stop(not quick))


def _unregister(c: K8sCluster) -> None:
    forget(c)
