"""Framed messages over a byte stream: the one way the controller, node agents and ranks talk.

A frame is an 8-byte big-endian length followed by a stdlib pickle of a dict with an ``op`` key.
The same framing runs over pipes (local nodes) and over an SSH channel (remote nodes), so the
rank lifecycle does not care how a node was reached. Payloads from user code (the function and
its arguments, return values) are already cloudpickled bytes inside a frame: the agent forwards
them without unpickling, which keeps cloudpickle and torch out of the agent.

Pickle here is code execution, which is why the stream must always be an authenticated channel
(a pipe to a child process, or SSH with pinned host keys), never a listening socket.
"""

from __future__ import annotations

import pickle
import struct
import threading
from typing import Any, BinaryIO

_HEADER = struct.Struct(">Q")
# A frame larger than this is a corrupted stream, not a message: fail loudly instead of
# trying to allocate it.
MAX_FRAME = 1 << 40


class ChannelClosed(EOFError):
    """The other end of the stream has gone away."""


def encode(msg: dict[str, Any]) -> bytes:
    body = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    # readinto a preallocated buffer: one copy of a large payload, not a list of chunks.
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            raise ChannelClosed(f"stream closed after {got} of {n} bytes")
        got += k
    return bytes(buf) if n < 4096 else buf  # type: ignore[return-value]


def read_frame(stream: BinaryIO) -> dict[str, Any]:
    """Block until one whole message arrives; raise ChannelClosed at end of stream."""
    (size,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    if size > MAX_FRAME:
        raise ChannelClosed(f"frame of {size} bytes: the stream is corrupt")
    return pickle.loads(_read_exact(stream, size))


class FrameWriter:
    """Thread-safe writer: several threads (heartbeat, log relays, results) share one stream."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        self.send_raw(encode(msg))

    def send_raw(self, frame: bytes) -> None:
        with self._lock:
            try:
                self._stream.write(frame)
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc

    def close(self) -> None:
        with self._lock:
            try:
                self._stream.close()
            except OSError:
                pass
