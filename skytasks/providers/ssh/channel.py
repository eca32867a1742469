"""An SSH process (asyncssh, on its connection's event loop) as the remote toolkit drives a node's
stream from a thread of its own: `Channel` while the agent starter reads the bootstrap's lines and
writes the env and the package (remote.agent_start), `Session` once bridged to local pipes
(remote.bridge), for the re-attach (remote.reattach)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from typing import Any, BinaryIO, Callable, Optional, TypeVar

T = TypeVar("T")


class Channel:
    """A process just started on an SSH connection, before it is bridged: its stdout read line by
    line, its stdin written, on the connection's loop."""

    def __init__(self, proc: Any, loop: asyncio.AbstractEventLoop):
        self.proc, self._loop = proc, loop
        self.inbound: Any = _Lines(proc, loop)
        self.outbound: Any = _Writes(proc, loop)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self.proc.close)

    def last_words(self) -> str:
        """Why it never got to the check: the shell's or Python's own words on stderr."""
        try:
            said = asyncio.run_coroutine_threadsafe(asyncio.wait_for(self.proc.stderr.read(), 5), self._loop).result(10)
        except Exception:  # noqa: BLE001 - nothing more to say
            said = b""
        return (said or b"").decode(errors="replace")


class _Lines:
    def __init__(self, proc: Any, loop: asyncio.AbstractEventLoop):
        self._proc, self._loop = proc, loop

    def readline(self) -> bytes:
        try:
            return asyncio.run_coroutine_threadsafe(self._proc.stdout.readline(), self._loop).result()
        except Exception as exc:  # noqa: BLE001 - a dropped channel: said as the line instead
            return f"{type(exc).__name__}: {exc}".encode()


class _Writes:
    def __init__(self, proc: Any, loop: asyncio.AbstractEventLoop):
        self._proc, self._loop = proc, loop

    def write(self, data: bytes) -> int:
        self._loop.call_soon_threadsafe(_write_quietly, self._proc.stdin, data)  # in order, on the loop
        return len(data)

    def flush(self) -> None:
        """Each write is handed to the channel on the loop, in order: nothing is held here."""


def _write_quietly(stdin: Any, data: bytes) -> None:
    try:
        stdin.write(data)
    except Exception:  # noqa: BLE001 - the channel closed: its reader says so
        pass


class Session:
    """An attach's SSH process bridged to local pipes: its status, and its stderr's last lines."""

    def __init__(self, proc: Any, inbound: BinaryIO, outbound: BinaryIO, said: collections.deque):
        self.proc, self.inbound, self.outbound, self._said = proc, inbound, outbound, said

    def close(self) -> None:
        close_quietly(self.outbound)
        close_quietly(self.inbound)

    def last_words(self) -> str:
        return " / ".join(self._said)

    def exit_code(self) -> Optional[int]:
        return self.proc.exit_status


class Tail:
    """An attach's stderr, kept (its last words when it ends) rather than reported: the
    controller says what became of the node."""

    def __init__(self, lines: collections.deque):
        self._lines = lines

    def note(self, line: str) -> None:
        self._lines.append(line.split("] ", 1)[-1])


async def in_own_thread(fn: Callable[[], T]) -> T:
    """`fn` on a thread of its own, awaited: a start that waits on its node must not hold one of
    the loop's few executor threads, which the started nodes' bridges write with."""
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - raised where it is awaited
            done.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="skytasks-ssh-start").start()
    return await asyncio.wrap_future(done)


def close_quietly(f: Any) -> None:
    try:
        f.close()
    except OSError:
        pass
