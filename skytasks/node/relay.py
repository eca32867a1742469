"""An agent's cut-through relay of one frame: to its own ranks, and on to the next agents of a
relay tree (see peers.py), as the bytes arrive; no agent holds a large frame whole.

A large buffer reaches the node's ranks as one memory file handed to each of them (`hand_over`),
written once as it arrives, instead of through each rank's pipe into a copy of its own.
Standard library only, like the rest of the node side.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from skytasks.wire import (BY_REF, HEADER, LENGTH, MAX_BUFFERS, MAX_FRAME, MAX_META, RELAY, RELAY_CHUNK, SHARED_BYTES,
                           ChannelClosed, FrameWriter, Readable, read_exact)


def relay_frame(stream: Readable, header: tuple[int, int, int], targets: list[FrameWriter],
                onward: Sequence[FrameWriter] = (), hand_over: Callable[[int], int | None] | None = None,
                meta: Any = None) -> None:
    """Stream one frame from `stream` to every target as it arrives (cut-through): a large
    payload crosses the agent without waiting for its last byte.
    `onward` targets (the next agents of a relay tree) get it still marked RELAY, to pass on.
    A target that has gone away is dropped; its rank's exit is reported elsewhere.

    With `hand_over`, a buffer of SHARED_BYTES or more reaches the targets (a node's ranks) as one
    memory file, not through each one's pipe: it is written there once as it arrives (the
    onward agents still get it cut-through), `hand_over(fd)` gives that file to every target
    beside the stream and names it with a token, and each target reads the token where the bytes
    would be (BY_REF). A node of eight ranks then receives a large argument once and holds it
    once, where it was copied through eight pipes into eight copies. Where no memory file can be
    had, or `hand_over` says None, the bytes go inline as before.

    A frame's sizes are checked as `wire.read_frame` checks them (its pickle, its buffer count,
    each buffer's length): past them it is a corrupt stream, ChannelClosed. `meta`: the frame's
    own pickle when the caller read it already (`read_meta`, to check it first)."""
    meta_len, count, flags = header
    if meta is None:
        meta = read_meta(stream, header)
    every = list(targets) + list(onward)
    live = list(every)

    def fan_out(chunk: Any, to: Sequence[FrameWriter] = every) -> None:
        for t in [t for t in to if t in live]:
            try:
                t.write_raw(chunk)
            except ChannelClosed:
                live.remove(t)

    for t in every:
        t.lock.acquire()
    try:
        for t in list(live):  # the header: the ranks read a plain frame, the next agents relay it
            try:
                t.write_raw(HEADER.pack(meta_len, count, flags if t in onward else flags & ~RELAY))
            except ChannelClosed:
                live.remove(t)
        fan_out(meta)
        for _ in range(count):
            size_bytes = read_exact(stream, LENGTH.size)
            (left,) = LENGTH.unpack(size_bytes)
            if left > MAX_FRAME:  # also a BY_REF length: a stream never carries one, only a node's ranks get them
                raise ChannelClosed(f"a relayed buffer of {left} bytes: the stream is corrupt")
            fd = _memory_file(left) if hand_over is not None and targets and left >= SHARED_BYTES else None
            if fd is None:
                fan_out(size_bytes)
                _copy(stream, left, fan_out)
                continue
            fan_out(size_bytes, onward)

            def to_file_and_onward(chunk: Any, fd: int = fd) -> None:
                _write_all(fd, chunk)
                fan_out(chunk, onward)

            try:
                _copy(stream, left, to_file_and_onward)
                token = hand_over(fd)  # type: ignore[misc]  # not None: checked above
                if token is None:
                    fan_out(size_bytes, targets)
                    _copy_file(fd, left, lambda chunk: fan_out(chunk, targets))
                else:
                    fan_out(LENGTH.pack(left | BY_REF) + LENGTH.pack(token), targets)
            finally:
                os.close(fd)  # each target holds the file it was handed, as long as it needs it
        for t in live:
            try:
                t.flush_raw()
            except ChannelClosed:
                pass
    finally:
        for t in every:
            t.lock.release()


def read_meta(stream: Readable, header: tuple[int, int, int]) -> Any:
    """A relayed frame's own pickle (its fields; the large buffers follow it), within the caps."""
    meta_len, count, _flags = header
    if meta_len > MAX_META or count > MAX_BUFFERS:
        raise ChannelClosed(f"a relayed frame of {meta_len} bytes and {count} buffers: the stream is corrupt")
    return read_exact(stream, meta_len)


def _memory_file(size: int) -> int | None:
    try:
        return os.memfd_create("skytasks-argument", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux, or no memfd: the bytes go inline
        return None


def _copy(stream: Readable, left: int, out: Callable[[Any], Any]) -> None:
    """`left` bytes of `stream` to `out`, a chunk at a time through one buffer: every `out` is
    done with a chunk when it returns (it writes it, or copies it into a buffer of its own), so
    a large payload costs no fresh memory per chunk."""
    buffer = memoryview(bytearray(min(left, RELAY_CHUNK)))
    while left:
        n = min(left, RELAY_CHUNK)
        out(read_exact(stream, n, buffer[:n]))
        left -= n


def _write_all(fd: int, chunk: Any) -> None:
    view = memoryview(chunk)
    while view:
        view = view[os.write(fd, view):]


def _copy_file(fd: int, size: int, out: Callable[[Any], Any]) -> None:
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(RELAY_CHUNK, size - offset), offset)
        out(chunk)
        offset += len(chunk)
