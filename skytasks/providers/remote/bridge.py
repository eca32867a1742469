"""A remote process's stdin and stdout (an asyncssh channel) as a pair of local pipes: the
controller reads and writes every node's stream alike, whichever way the node was reached (SSH
to the node itself, or srun on a SLURM login node)."""

from __future__ import annotations

import array
import asyncio
import fcntl
import os
import select
import termios
import threading
import time
from typing import Any, BinaryIO, Callable, Optional

CHUNK = 1 << 20


def bridge_process(proc: Any, label: str, reporter: Any) -> tuple[BinaryIO, BinaryIO, list]:
    """A remote process's stdin and stdout (an asyncssh channel) as a pair of local pipes, so the
    controller reads and writes it exactly like a local node's pipes; its stderr lines go to the
    reporter. Call on the connection's event loop."""
    import asyncssh

    from_agent_r, from_agent_w = os.pipe()
    to_agent_r, to_agent_w = os.pipe()
    loop = asyncio.get_running_loop()

    # A dropped connection ends both readers; that is how a node is lost, not an error of
    # theirs: the closed pipe tells the controller (and nothing is left for asyncio to log).
    async def agent_to_controller() -> None:
        try:
            while data := await proc.stdout.read(CHUNK):
                await loop.run_in_executor(None, _write_all, from_agent_w, data)
        except (OSError, asyncssh.Error):
            pass
        finally:
            os.close(from_agent_w)  # the controller sees the node as lost

    async def agent_stderr() -> None:
        try:
            while line := await proc.stderr.readline():
                reporter.note(f"[{label}] {line.decode(errors='replace').rstrip()}")
        except (OSError, asyncssh.Error):
            pass

    forwarding = Forwarding(to_agent_r)

    def controller_to_agent() -> None:
        try:
            while True:
                select.select([to_agent_r], [], [])
                forwarding.busy = True  # before the bytes leave the pipe: see Forwarding.drained
                data = os.read(to_agent_r, CHUNK)
                if not data:
                    break
                asyncio.run_coroutine_threadsafe(_write_drain(proc.stdin, data), loop).result()
                forwarding.busy = False
        except Exception:  # noqa: BLE001 - the channel is gone; the reader reports it
            pass
        finally:
            forwarding.done = True
            os.close(to_agent_r)
            try:  # after stop() there is no loop, and no channel left to end
                loop.call_soon_threadsafe(_eof, proc.stdin)
            except RuntimeError:
                pass

    tasks = [asyncio.ensure_future(agent_to_controller()), asyncio.ensure_future(agent_stderr()), forwarding]
    threading.Thread(target=controller_to_agent, daemon=True, name=f"skytasks-out-{label}").start()
    return os.fdopen(from_agent_r, "rb"), os.fdopen(to_agent_w, "wb"), tasks


class Forwarding:
    """Whether every byte the controller wrote toward the agent was handed to the channel: what
    must be true before the connection is closed (an END written just before a teardown would
    otherwise be lost, and an agent holding a LEASE would wait out its window instead of ending)."""

    def __init__(self, fd: int):
        self.fd, self.busy, self.done = fd, False, False

    def drained(self) -> bool:
        if self.done:
            return True
        if self.busy:
            return False
        try:
            return _waiting(self.fd) == 0
        except OSError:
            return True


def _waiting(fd: int) -> int:
    """Bytes waiting to be read in a pipe or socket, without reading them."""
    count = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, count)
    return count[0]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def _write_drain(stream: Any, data: bytes) -> None:
    stream.write(data)
    await stream.drain()


def _eof(stream: Any) -> None:
    try:
        stream.write_eof()
    except Exception:  # noqa: BLE001
        pass




def await_answer(inbound: BinaryIO, timeout: float, exit_code: Callable[[], Optional[int]], said: Callable[[], str],
                 where: str) -> None:
    """Wait for the first bytes of an attach stream (`python -c attach.CLIENT DOOR` run through a
    provider's way in: the agent's CHALLENGE), reading nothing, so the controller's handshake
    finds every byte. Raises NodeGone when the attach ended with status 3 (no agent behind the
    door: it ended), TimeoutError when nothing came within `timeout`, ConnectionError when the
    way in ended otherwise (try again later). The caller closes the stream on an exception."""
    from skytasks.errors import NodeGone

    fd = inbound.fileno()
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if not ready:
        raise TimeoutError(f"{where}: no answer from its agent's door within {timeout:g}s")
    if _waiting(fd) > 0:  # the agent speaks: the caller hands the stream over, unread
        return
    deadline = time.monotonic() + 5  # the stream ended: its status follows it closely
    while (code := exit_code()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    words = said().strip()
    if code == 3:
        raise NodeGone(f"{where}: its agent is gone (no agent behind its door{': ' + words if words else ''})")
    raise ConnectionError(f"{where}: the attach ended (status {code}){': ' + words if words else ''}")
