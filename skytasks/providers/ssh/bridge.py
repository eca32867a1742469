"""A remote process's stdin and stdout (an asyncssh channel) as a pair of local pipes: the
controller reads and writes every node's stream alike, whichever way the node was reached (SSH
to the node itself, or srun on a SLURM login node)."""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any, BinaryIO

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

    def controller_to_agent() -> None:
        try:
            while data := os.read(to_agent_r, CHUNK):
                asyncio.run_coroutine_threadsafe(_write_drain(proc.stdin, data), loop).result()
        except Exception:  # noqa: BLE001 - the channel is gone; the reader reports it
            pass
        finally:
            os.close(to_agent_r)
            try:  # after stop() there is no loop, and no channel left to end
                loop.call_soon_threadsafe(_eof, proc.stdin)
            except RuntimeError:
                pass

    tasks = [asyncio.ensure_future(agent_to_controller()), asyncio.ensure_future(agent_stderr())]
    threading.Thread(target=controller_to_agent, daemon=True, name=f"skytasks-out-{label}").start()
    return os.fdopen(from_agent_r, "rb"), os.fdopen(to_agent_w, "wb"), tasks


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


