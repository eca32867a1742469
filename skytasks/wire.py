"""Framed messages over a byte stream: the one way the controller, node agents and ranks talk.

A frame is a stdlib pickle (protocol 5) of a dict with an ``op`` key, followed by its
out-of-band buffers: large byte payloads (a cloudpickled argument, a return value) are wrapped in
`pickle.PickleBuffer` and written straight from their memory, never copied into the pickle
stream. The same framing runs over pipes (local nodes) and over an SSH channel (remote nodes),
so the rank lifecycle does not care how a node was reached. The agent forwards payloads without
unpickling them, which keeps cloudpickle and torch out of the agent.

Layout: header (meta length, buffer count), meta, then per buffer (length, bytes).

Pickle here is code execution, which is why the stream must always be an authenticated channel
(a pipe to a child process, SSH with pinned host keys, a peer link of TLS with the pool's key).
And a frame's own pickle is read as plain data only (`_PlainUnpickler`: dicts, lists, strings,
numbers, bytes; no class or function is looked up), so even a corrupt or hostile frame can do
no more than fail to read: what it carries as code (a call, a return value) stays bytes until
the side that expects code loads it. A frame's sizes are claims, not facts: memory is taken as
the bytes arrive, and a frame past the caps below is a corrupt stream (ChannelClosed, naming it).
"""

from __future__ import annotations

import io
import pickle
import struct
import threading
from typing import Any, BinaryIO, Callable, NamedTuple, Protocol

HEADER = struct.Struct(">QIB")  # meta length, buffer count, flags
RELAY = 1  # flag: a node agent streams this frame on to its ranks as it arrives
# flag: a rank's frame for its own agent (SIGUSR2's notice). Every other frame a rank sends, its
# agent passes on to the controller as the same bytes, never unpickled there (see rank_process).
TO_AGENT = 2
RELAY_CHUNK = 1 << 20
LENGTH = struct.Struct(">Q")
# A buffer's length with this bit set: its bytes are not in the stream. A token follows, naming
# the memory file the node's agent handed the rank beside it (see node/relay.py).
BY_REF = 1 << 63
# A buffer larger than this is a corrupted stream, not a message: fail loudly instead of
# trying to allocate it. (A legitimate return value may be many GB; memory follows the bytes that
# actually arrive, see read_exact, so a lying length costs nothing before its bytes come.)
MAX_FRAME = 1 << 40
# A frame's own pickle (its fields; large payloads travel out of band) is small: past this, corrupt.
MAX_META = 1 << 30
# Out-of-band buffers in one frame: past this, corrupt (each is a payload of 64 KB or more).
MAX_BUFFERS = 1 << 16
# A read of more than this is taken in steps of this as its bytes arrive, never allocated at once
# on a length the stream claimed.
EAGER_BYTES = 64 << 20
# Byte payloads at least this large travel out of band (no copy into the pickle stream).
OUT_OF_BAND_BYTES = 64 * 1024
# A buffer this large gets memory of its own: a memory file a node's agent hands its ranks
# (node/relay.py), and where a rank reads it from its pipe, one of the rank's (serialization).
SHARED_BYTES = 1 << 20


PIPE_BYTES = 1 << 20  # Linux's default ceiling (/proc/sys/fs/pipe-max-size) for an unprivileged process


def widen_pipe(stream: Any) -> None:
    """A 1 MB pipe instead of the default 64 KB: a large argument or result then crosses in a
    sixteenth of the context switches. Linux only; elsewhere, or when refused, nothing changes."""
    try:
        import fcntl

        fcntl.fcntl(stream if isinstance(stream, int) else stream.fileno(), 1031, PIPE_BYTES)  # F_SETPIPE_SZ
    except (ImportError, OSError, ValueError):
        pass


class Readable(Protocol):
    """What frames are read from: a pipe, a socket file, or a HeardStream around one."""

    def readinto(self, buffer: Any, /) -> int | None: ...


class BlobRef(NamedTuple):
    """Stands in a call for a large argument that travels (and is cached) on its own."""

    slot: int  # into the call's blob references


def encoded_size(chunks: list[Any]) -> int:
    """The bytes an encoded frame puts on a stream."""
    return sum(len(c) if isinstance(c, (bytes, bytearray)) else c.nbytes for c in chunks)


class ChannelClosed(EOFError):
    """The other end of the stream has gone away."""


_LEAVES = frozenset({str, int, float, bool, type(None)})  # most of a message: nothing to look into


def _out_of_band(value: Any, depth: int = 0) -> Any:
    """Wrap large byte payloads (in dicts, lists and tuples) so pickle leaves them out of band."""
    if type(value) in _LEAVES:
        return value
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


def encode(msg: dict[str, Any], flags: int = 0) -> list[Any]:
    """The frame as a list of byte chunks, ready for writelines (no concatenation copies);
    `flags`: RELAY, TO_AGENT or none."""
    buffers: list[pickle.PickleBuffer] = []
    if type(msg["op"]) is not str:  # a protocol.Op: the wire carries its plain string
        msg = {**msg, "op": str(msg["op"])}
    meta = pickle.dumps(_out_of_band(msg), protocol=5, buffer_callback=buffers.append)
    chunks: list[Any] = [HEADER.pack(len(meta), len(buffers), flags), meta]
    for buf in buffers:
        view = buf.raw()
        chunks += [LENGTH.pack(view.nbytes), view]
    return chunks


class _PlainUnpickler(pickle.Unpickler):
    """A frame's pickle as plain data: no global is ever looked up, so nothing is imported or called."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a frame may carry plain data only, not {module}.{name}")


def _loads(meta: Any, buffers: list[Any]) -> dict[str, Any]:
    """The message in a frame's pickle; ChannelClosed, saying so, for anything else."""
    try:
        msg = _PlainUnpickler(io.BytesIO(meta), buffers=buffers).load()
    except Exception as exc:  # noqa: BLE001 - garbage fails in many ways (UnpicklingError, EOFError, ValueError, ...)
        raise ChannelClosed(f"a frame that is not a message ({type(exc).__name__}: {exc}): the stream is corrupt") \
            from None
    if type(msg) is not dict:
        raise ChannelClosed(f"a frame that is not a message (a {type(msg).__name__}): the stream is corrupt")
    return msg


def _check_sizes(meta_len: int, count: int) -> None:
    if meta_len > MAX_META:
        raise ChannelClosed(f"frame of {meta_len} bytes: the stream is corrupt")
    if count > MAX_BUFFERS:
        raise ChannelClosed(f"frame of {count} buffers: the stream is corrupt")


def read_exact(stream: Readable, n: int, into: Any = None) -> Any:
    if into is None and n > EAGER_BYTES:  # a length the stream claimed: memory as its bytes arrive
        grown = bytearray()
        while len(grown) < n:
            grown += read_exact(stream, min(EAGER_BYTES, n - len(grown)))
        return grown
    # readinto a preallocated buffer: one copy of a large payload, not a list of chunks.
    buf = bytearray(n) if into is None else into
    view = memoryview(buf).cast("B")
    got = 0
    while got < n:
        k = stream.readinto(view[got:])
        if not k:
            raise ChannelClosed(f"stream closed after {got} of {n} bytes")
        got += k
    return buf


def read_header(stream: Readable) -> tuple[int, int, int]:
    meta_len, count, flags = HEADER.unpack(read_exact(stream, HEADER.size))
    _check_sizes(meta_len, count)
    return meta_len, count, flags


def read_frame(stream: Readable, buffer_for: Callable[[int], Any] | None = None,
               by_ref: Callable[[int, int], Any] | None = None) -> dict[str, Any]:
    """Block until one whole message arrives; raise ChannelClosed at end of stream.
    `buffer_for(size)`, when given, may supply the memory a large buffer is read into;
    `by_ref(token, size)`, the memory of a buffer its sender handed over beside the stream."""
    return read_body(stream, *read_header(stream), buffer_for=buffer_for, by_ref=by_ref)


def read_body(stream: Readable, meta_len: int, count: int, flags: int = 0,
              buffer_for: Callable[[int], Any] | None = None,
              by_ref: Callable[[int, int], Any] | None = None) -> dict[str, Any]:
    _check_sizes(meta_len, count)
    meta = read_exact(stream, meta_len)
    buffers = []
    for _ in range(count):
        (size,) = LENGTH.unpack(read_exact(stream, LENGTH.size))
        if size & BY_REF and by_ref is not None:
            (token,) = LENGTH.unpack(read_exact(stream, LENGTH.size))
            buffers.append(by_ref(token, size & ~BY_REF))
            continue
        if size > MAX_FRAME:
            raise ChannelClosed(f"buffer of {size} bytes: the stream is corrupt")
        buffers.append(read_exact(stream, size, buffer_for(size) if buffer_for else None))
    return _loads(meta, buffers)


class FrameParser:
    """Frames out of a byte stream that arrives in pieces of any size (`wire`'s layout)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        # How far the first frame in the buffer has been measured: (where its next buffer's length
        # is, buffers still to measure). Kept across pieces, so a frame of many buffers arriving in
        # many pieces is measured once, not again at every piece.
        self._scan: tuple[int, int] | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[dict[str, Any]]:
        """The frames `data` completes, in order; the rest is kept for the next piece."""
        self._buf += data
        frames = []
        while (end := self._next_end()) is not None:
            frames.append(decode(self._buf))  # one copy of a large buffer, into its bytearray
            del self._buf[:end]  # cheap at the front of a bytearray
            self._scan = None
        return frames

    def feed_raw(self, data: bytes | bytearray | memoryview) -> list[tuple[int, bytearray]]:
        """The same frames as (flags, the frame's own bytes), not unpickled: a node agent passes
        its ranks' frames on as they are, so it never decodes and re-encodes a rank's result."""
        self._buf += data
        frames = []
        while (end := self._next_end()) is not None:
            frames.append((HEADER.unpack_from(self._buf, 0)[2], self._buf[:end]))
            del self._buf[:end]
            self._scan = None
        return frames

    def _next_end(self) -> int | None:
        """Where the first whole frame in the buffer ends; None until one is whole."""
        buf, have = self._buf, len(self._buf)
        if self._scan is None:
            if have < HEADER.size:
                return None
            meta_len, count, _flags = HEADER.unpack_from(buf, 0)
            _check_sizes(meta_len, count)
            self._scan = (HEADER.size + meta_len, count)
        pos, left = self._scan
        while left:
            if have < pos + LENGTH.size:
                self._scan = (pos, left)
                return None
            (size,) = LENGTH.unpack_from(buf, pos)
            if size > MAX_FRAME:
                raise ChannelClosed(f"buffer of {size} bytes: the stream is corrupt")
            pos += LENGTH.size + size
            left -= 1
        self._scan = (pos, 0)
        return pos if have >= pos else None


def decode(frame: bytes | bytearray) -> dict[str, Any]:
    """The message in the whole frame at the start of `frame` (as `FrameParser.feed_raw` gives
    them); its large buffers become bytearrays of their own."""
    meta_len, count, _flags = HEADER.unpack_from(frame, 0)
    pos = HEADER.size + meta_len
    buffers = []
    for _ in range(count):
        (size,) = LENGTH.unpack_from(frame, pos)
        pos += LENGTH.size
        buffers.append(frame[pos:pos + size] if isinstance(frame, bytearray) else bytearray(frame[pos:pos + size]))
        pos += size
    return _loads(bytes(frame[HEADER.size:HEADER.size + meta_len]), buffers)


class FrameWriter:
    """Thread-safe writer: several threads (heartbeat, log relays, results) share one stream."""

    def __init__(self, stream: BinaryIO):
        self._stream = stream
        self.lock = threading.Lock()

    def send(self, msg: dict[str, Any], flags: int = 0) -> None:
        self.send_encoded(encode(msg, flags=flags))

    def send_if_idle(self, msg: dict[str, Any]) -> None:
        """Send unless another frame is on its way (a heartbeat: that frame proves as much)."""
        if not self.lock.acquire(blocking=False):
            return
        self.lock.release()
        self.send(msg)

    def send_encoded(self, chunks: list[Any]) -> None:
        with self.lock:
            try:
                self._stream.writelines(chunks)
                self._stream.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise ChannelClosed(str(exc)) from exc

    def write_raw(self, chunk: Any) -> None:
        """Part of a frame; the caller holds `lock` for the whole frame (see relay_frame)."""
        try:
            self._stream.write(chunk)
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def flush_raw(self) -> None:
        try:
            self._stream.flush()
        except (BrokenPipeError, ValueError, OSError) as exc:
            raise ChannelClosed(str(exc)) from exc

    def close(self) -> None:
        with self.lock:
            try:
                self._stream.close()
            except OSError:
                pass
