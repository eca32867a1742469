"""The agent's stream to its controller, made to outlive its transport (design 52, B.3).

Before a LEASE it is today's stream: blocking reads and writes on the agent's stdin and stdout,
an end or an error is the controller gone. It counts the bytes each way all along (`got`, `sent`)
and keeps a copy of the last few it sent, because the controller counts from the first byte.

After a LEASE with a re-attach window, an end of stdin, a write error, or silence (the agent's
watcher) is a *break*: the transport's descriptors are closed (so the far end sees the break
too), what the ranks send is kept in an `Outbox` (bounded: past the cap, senders wait), and a
read waits until a new transport is swapped in (node/door.py, after the pool's key was proven).
Then each side resends from the other's count and frames go on where they were cut. Writes never
block on a dead transport: they are non-blocking and poll a wake pipe as well, which a swap or a
break closes (closing a descriptor does not end a `write` blocked on it in another thread).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any, Callable

from skytasks.resume import OUTBOX_CAP, Outbox

READ_BUFFER = 64 << 10
# Bytes of the stream sent before the LEASE that are kept (copied): enough for what the
# controller may not have read yet when it sent LEASE (HELLO, PEER_READY, a heartbeat).
TAIL_BYTES = 256 << 10
IOV_MAX = 512
_HUP = select.POLLHUP | select.POLLERR | select.POLLNVAL


class _Abandoned(Exception):
    """The transport was given up (a break or a newer one) while a write waited on it."""


class Transport:
    """One way to the controller: a descriptor to read, one to write (the same for a socket),
    and a wake pipe whose write end is closed when the transport is given up."""

    def __init__(self, read_fd: int, write_fd: int, owned: list[int]):
        self.read_fd, self.write_fd, self.owned = read_fd, write_fd, owned
        self.wake_r, self._wake_w = os.pipe()
        self.gone = False

    def abandon(self) -> None:
        """Wake whoever polls this transport (its wake pipe reads as ended from now on)."""
        if not self.gone:
            self.gone = True
            os.close(self._wake_w)

    def close(self) -> None:
        self.abandon()
        for fd in self.owned:
            try:
                os.close(fd)
            except OSError:
                pass
        self.owned = []  # wake_r stays open a while: a thread may be about to poll it (see retire)

    def retire(self, retired: list[Transport]) -> None:
        """Closed for good: its wake pipe is closed once a few newer transports came and went
        (a thread that took this transport polls it at once, never that late)."""
        self.close()
        retired.append(self)
        while len(retired) > 4:
            os.close(retired.pop(0).wake_r)

    def poll(self, fd: int, events: int) -> None:
        """Wait until `fd` is ready for `events` (or ended); _Abandoned if the transport was given up."""
        poller = select.poll()
        poller.register(fd, events)
        poller.register(self.wake_r, select.POLLIN)
        while not poller.poll():
            pass
        if self.gone:
            raise _Abandoned()


def nonblocking_writer(fd: int) -> tuple[int, list[int]]:
    """A descriptor to write `fd`'s pipe or socket without blocking, and the descriptors made for
    it. A pipe is opened anew through /proc, so O_NONBLOCK is this agent's alone, not set on a
    description it may share; where that is refused, the flag is set on `fd` itself."""
    try:
        fresh = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        return fresh, [fresh]
    except OSError:
        os.set_blocking(fd, False)
        return fd, []


class AgentStream:
    """Both directions of the agent's stream: `readinto`/`fileno` for the frame reader,
    `writelines`/`flush`/`close` for the `FrameWriter`. `on_broke(why)` is called once per break
    (the agent logs it); `gone(why)` when a break ends the agent (no LEASE, or a window of 0)."""

    def __init__(self, read_fd: int, write_fd: int, gone: Callable[[str], None]):
        self._gone = gone
        self.on_broke: Callable[[str], None] = lambda why: None
        self._first = Transport(read_fd, write_fd, [read_fd, write_fd])
        self._transport: Transport | None = self._first
        self._state = threading.Condition()  # transport, broken_at, window
        self._rlock = threading.Lock()  # a read and its count, against a swap
        self._wlock = threading.Lock()  # a write to the transport, against a swap
        self.got = 0  # bytes read from the controller
        self.sent = 0  # bytes written (before LEASE) or kept (after)
        self._buf = bytearray()
        self._retired: list[Transport] = []
        self._tail = bytearray()  # the last TAIL_BYTES sent before the LEASE
        self.outbox: Outbox | None = None  # from the LEASE on
        self.window: float | None = None  # reattach seconds (+ margin); None: no LEASE
        self.broken_at: float | None = None  # when the current break was noticed
        self.cap = OUTBOX_CAP
        self.read_wake: Callable[[int], None] = lambda got: None  # each read's new count (early acks)

    # -- the LEASE ---------------------------------------------------------------------------

    def lease(self, window: float) -> None:
        """From now on a break waits `window` seconds for a new transport (0: a break ends the
        agent, as before any LEASE)."""
        with self._wlock, self._state:
            if self.outbox is None:
                self.outbox = Outbox(start=self.sent - len(self._tail))
                self.outbox.append([bytes(self._tail)])
                self._tail = bytearray()
                t = self._transport
                if t is not None and t is self._first:  # stdin/stdout: its writes become non-blocking
                    fd, made = nonblocking_writer(t.write_fd)
                    t.write_fd, t.owned = fd, t.owned + made
            self.window = window

    @property
    def leased(self) -> bool:
        return self.window is not None and self.window > 0

    @property
    def detached(self) -> bool:
        return self.broken_at is not None

    def expired(self) -> bool:
        """A break that no new transport mended within the window."""
        with self._state:
            return self.broken_at is not None and time.monotonic() > self.broken_at + (self.window or 0.0)

    # -- breaks and swaps --------------------------------------------------------------------

    def broke(self, why: str, transport: Transport | None = None) -> None:
        """The transport (`transport`, or the current one) ended, failed or fell silent."""
        with self._state:
            t = self._transport if transport is None else transport
            if t is None or t is not self._transport:
                return  # already given up, or superseded
            waits = self.leased
            if waits:
                self._transport = None
                self.broken_at = time.monotonic()
                t.abandon()  # a writer polling it lets go of the write lock
        if not waits:
            self._gone(why)
            return
        with self._wlock, self._rlock:  # nobody is in a read or write on its descriptors
            t.retire(self._retired)  # the far end sees the break too
        self.on_broke(why)

    def swap(self, transport: Transport, peer_got: int, greeting: Callable[[int], list[Any]]) -> int | None:
        """Make `transport` the stream's (a proven new stream from the door): the old one, if
        any, is given up; `greeting(got)` (ATTACHED, with this side's count) is written first,
        then everything from `peer_got` on. The count given, or None (nothing swapped) when
        `peer_got` asks for bytes no longer kept."""
        outbox = self.outbox
        if outbox is None or not (outbox.acked <= peer_got <= outbox.sent):
            return None
        with self._state:
            old = self._transport
            if old is not None:
                old.abandon()  # a writer or reader polling it lets go of its lock
        got: int | None = None
        with self._wlock:
            if outbox.acked <= peer_got <= outbox.sent:  # still kept (no ack came on the old stream)
                with self._rlock, self._state:  # the count and the switch at one moment
                    if self._transport is not None:  # `old`, or one a parallel re-attach swapped in
                        self._transport.retire(self._retired)
                    self._transport = transport
                    self.broken_at = None
                    got = self.got
                    self._state.notify_all()
                # The reader may read the new transport already: the controller resends only after
                # ATTACHED, and reads ours while it writes (both resends may exceed a pipe's room).
                try:
                    self._write_all(transport, [*greeting(got), *outbox.since(peer_got)])
                except (OSError, _Abandoned) as exc:
                    self._after_write_error(transport, exc)
        if got is None and old is not None:  # it was woken for nothing: a break, as any other
            self.broke(f"a re-attach asked for byte {peer_got}, no longer kept", old)
        return got

    # -- reading -----------------------------------------------------------------------------

    def fileno(self) -> int:
        t = self._transport
        if t is None:
            raise OSError("no transport: the stream is broken")
        return t.read_fd

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        if self._buf:
            n = min(len(view), len(self._buf))
            view[:n] = self._buf[:n]
            del self._buf[:n]
            return n
        while True:
            t = self._current_or_wait()
            if t is None:
                return 0  # ended: ChannelClosed for the reader
            if self.outbox is not None:
                try:
                    t.poll(t.read_fd, select.POLLIN)
                except _Abandoned:
                    with self._state:  # given up: a swap or a break replaces it in a moment
                        if self._transport is t:
                            self._state.wait(0.05)
                    continue
            with self._rlock:
                if t is not self._transport:
                    continue
                try:
                    n = self._read(t.read_fd, view)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    n, why = -1, f"reading the controller's stream failed: {exc}"
                else:
                    why = "the controller's stream ended"
            if n > 0:
                self.read_wake(self.got)
                return min(n, len(view))
            if not self.leased:
                return 0  # before a LEASE (or with no window): the end of the stream, as always
            self.broke(why, t)

    def _read(self, fd: int, view: memoryview) -> int:
        if len(view) >= READ_BUFFER:
            n = os.readv(fd, [view])
        else:
            data = os.read(fd, READ_BUFFER)
            n = len(data)
            k = min(n, len(view))
            view[:k] = data[:k]
            self._buf += data[k:]
        self.got += n
        return n

    def _current_or_wait(self) -> Transport | None:
        with self._state:
            while self._transport is None:
                if not self.leased:
                    return None
                self._state.wait()
            return self._transport

    # -- writing -----------------------------------------------------------------------------

    def writelines(self, chunks: list[Any]) -> None:
        with self._wlock:
            outbox, t = self.outbox, self._transport
            if outbox is None:  # before any LEASE: today's blocking write
                self._write_before_lease(chunks)
                return
            self.sent = outbox.append(chunks)
            if t is not None:
                try:
                    self._write_all(t, chunks)
                except (OSError, _Abandoned) as exc:
                    self._after_write_error(t, exc)
        while self._transport is None and outbox.size > self.cap:  # broken and full: the ranks wait
            outbox.wait_room(self.cap, time.monotonic() + 0.5)  # until acked, or a new transport came

    def _write_before_lease(self, chunks: list[Any]) -> None:
        t = self._transport
        if t is None:
            raise BrokenPipeError("the stream to the controller is closed")
        views = [memoryview(c).cast("B") for c in chunks]
        _writev_all(t.write_fd, views)
        for v in views:
            self.sent += v.nbytes
            self._tail += v[-TAIL_BYTES:]
        del self._tail[:-TAIL_BYTES]

    def _write_all(self, t: Transport, chunks: list[Any]) -> None:
        views = [v for v in (memoryview(c).cast("B") for c in chunks) if v.nbytes]
        while views:
            t.poll(t.write_fd, select.POLLOUT)
            try:
                n = os.writev(t.write_fd, views[:IOV_MAX])
            except BlockingIOError:
                continue
            views = _advance(views, n)

    def _after_write_error(self, t: Transport, exc: BaseException) -> None:
        if not isinstance(exc, _Abandoned):
            threading.Thread(target=self.broke, args=(f"writing to the controller failed: {exc}", t),
                             daemon=True).start()  # not under the write lock: broke may end the agent

    def flush(self) -> None:
        pass

    def close(self) -> None:
        with self._state:
            t, self._transport = self._transport, None
        if t is not None:
            t.close()


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    while n and views:
        if n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        else:
            views = [views[0][n:], *views[1:]]
            n = 0
    return views


def _writev_all(fd: int, views: list[memoryview]) -> None:
    views = [v for v in views if v.nbytes]
    while views:
        views = _advance(views, os.writev(fd, views[:IOV_MAX]))


def socket_transport(sock: socket.socket) -> Transport:
    """A door connection as a transport: a descriptor of its own, both ways, non-blocking."""
    fd = os.dup(sock.fileno())
    os.set_blocking(fd, False)
    return Transport(fd, fd, [fd])
