"""Framed messages over a byte stream: the one way the controller, node agents and ranks talk.

A frame is a stdlib pickle (protocol 5) of a dict with an ``op`` key, followed by its
out-of-band buffers: large byte payloads (a cloudpickled argument, a return value) are wrapped in
`pickle.PickleBuffer` and written straight from their memory, never copied into the pickle
stream. The same framing runs over pipes (local nodes) and over an SSH channel (remote nodes),
so the rank lifecycle does not care how a node was reached. The agent forwards payloads without
unpickling them, which keeps cloudpickle and torch out of the agent.

Layout: header (meta length, buffer count), meta, then per buffer (length, bytes).

Pickle here is code execution, which is why the stream must always be an authenticated channel
(a pipe to a child process, or SSH with pinned host keys), never a listening socket.
"""

from __future__ import annotations

import pickle
import struct
import threading
from typing import Any, BinaryIO, NamedTuple

_HEADER = struct.Struct(">QI")
_LENGTH = struct.Struct(">Q")
# A frame larger than this is a corrupted stream, not a message: fail loudly instead of
# trying to allocate it.
MAX_FRAME = 1 << 40
# Byte payloads at least this large travel out of band (no copy into the pickle stream).
OUT_OF_BAND_BYTES = 64 * 1024


class BlobRef(NamedTuple):
    """Stands in a call for a large argument that travels (and is cached) on its own."""

    index: int  # into the call's blob references


class ChannelClosed(EOFError):
    """The other end of the stream has gone away."""


def _out_of_band(value: Any, depth: int = 0) -> Any:
    """Wrap large byte payloads (in dicts, lists and tuples) so pickle leaves them out of band."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) >= OUT_OF_BAND_BYTES:
            return pickle.PickleBuffer(value)
        return bytes(value) if isinstance(value, memoryview) else value
    if depth > 4:
        return value
    if isinstance(value, dict):
        return {k: _out_of_band(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_out_of_band(v, depth + 1) for v in value)
    return value


def encode(msg: dict[str, Any]) -> list[Any]:
    """The frame as a list of byte chunks, ready for writelines (no concatenation copies)."""
    buffers: list[pickle.PickleBuffer] = []
    meta = pickle.dumps(_out_of_band(msg), protocol=5, buffer_callback=buffers.append)
    chunks: list[Any] = [_HEADER.pack(len(meta), len(buffers)), meta]
    for buf in buffers:
        view = buf.raw()
        chunks += [_LENGTH.pack(view.nbytes), view]
    return chunks


def _read_exact(stream: BinaryIO, n: int) -> bytearray:
    # readinto a preallocated buffer: one copy of a large payload, not a list of chunks.
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            raise ChannelClosed(f"stream closed after {got} of {n} bytes")
        got += k
    return buf


def read_frame(stream: BinaryIO) -> dict[str, Any]:
    """Block until one whole message arrives; raise ChannelClosed at end of stream."""
    meta_len, count = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    if meta_len > MAX_FRAME:
        raise ChannelClosed(f"frame of {meta_len} bytes: the stream is corrupt")
    meta = _read_exact(stream, meta_len)
    buffers = []
    for _ in range(count):
        (size,) = _LENGTH.unpack(_read_exact(stream, _LENGTH.size))
        if size > MAX_FRAME:
            raise ChannelClosed(f"buffer of {size} bytes: the stream is corrupt")
        buffers.append(_read_exact(stream, size))
    return pickle.loads(meta, buffers=buffers)


class FrameWriter:
    """Thread-safe writer: several threads (heartbeat, log relays, results) share one stream."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self._lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        self.send_encoded(encode(msg))

    def send_encoded(self, chunks: list[Any]) -> None:
        with self._lock:
            try:
                self._stream.writelines(chunks)
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc

    def close(self) -> None:
        with self._lock:
            try:
                self._stream.close()
            except OSError:
                pass
