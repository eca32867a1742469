"""Ending a child process that speaks over its stdin and stdout (a local agent, an srun step)."""

from __future__ import annotations

import subprocess
from typing import IO, Protocol


class ChildProcess(Protocol):
    """What of `subprocess.Popen` ending one takes (a forked local agent has the same)."""

    @property
    def stdin(self) -> IO[bytes] | None: ...
    @property
    def stdout(self) -> IO[bytes] | None: ...
    @property
    def stderr(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


# How long a node found lost is given to end on its own, at each step of `end_child`: it cannot
# be heard (frozen, or its machine gone), and its replacement waits on this.
LOST_WAIT_SECONDS = 1.0


def end_child(proc: ChildProcess, *, terminate_first: bool = False, wait: float = 10.0) -> None:
    """EOF on its stdin (an agent then stops its ranks and exits); if it lingers, SIGTERM when
    `terminate_first` (srun passes it on to the step's tasks), then SIGKILL. Its pipes are closed."""
    if proc.poll() is None:
        try:
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        signals = ([proc.terminate] if terminate_first else []) + [proc.kill]
        for send in [None, *signals]:
            if send is not None:
                send()
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is None:
            continue
        try:
            stream.close()
        except OSError:
            pass
