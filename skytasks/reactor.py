"""One thread reading many streams, each chunk handed on as it arrives: the controller's node
streams, and an agent's rank pipes (`wire.FrameParser` makes frames of the chunks).

Why not a thread per stream: at 1,024 ranks on 128 nodes that was 128 reader threads in the
controller and 3,072 relay threads in the agents (three per rank), each started with its rank and
each waking, and taking its process's GIL, for every frame and line. One epoll and one thread per
process read them all.

The same thread hears processes end (a pidfd each, Linux 5.3+) and runs short timers, where
otherwise an agent would hold two threads per rank, one blocked in `waitpid` and one waiting to
report the exit. Starting and ending a thread costs about 0.4 ms of CPU, so 16 of them a node per
group would be most of what an agent spends on a failure's stop.

Standard library only.
"""

from __future__ import annotations

import heapq
import io
import itertools
import os
import queue
import selectors
import threading
import time
import traceback
from typing import Any, Callable

from skytasks.wire import ChannelClosed

CHUNK = 1 << 18  # bytes read from a ready stream at a time


OnData = Callable[[bytes], None]
OnEnd = Callable[[str], None]
Later = Callable[[], None]
ENDED = "the process ended"  # what on_end gets for a watched process


class StreamReactor:
    """One daemon thread and one epoll for every stream added. `on_data` gets each chunk as it
    arrives and `on_end` the reason once the stream ends (closed, an error, or `on_data`
    raising); both run on the reactor's thread, so they must not block. So do a watched process's
    `on_end` and what `call_later` runs."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        # Our duplicates (see add), and pidfds (on_data None: see watch_exit).
        self._added: queue.SimpleQueue[tuple[int, OnData | None, OnEnd]] = queue.SimpleQueue()
        self._timers: list[tuple[float, int, Later]] = []  # a heap of (when, order, what), under _lock
        self._order = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, stream: Any, on_data: OnData, on_end: OnEnd) -> None:
        """Read `stream` (a file with a descriptor) from now on, until its writer closes it. What
        a buffered reader already holds is handed over first, so nothing read before the hand-over
        is lost.

        The reactor reads its own duplicate of the descriptor, which only its thread closes, after
        the stream's end. The owner may close the stream whenever it likes (a provider lets a lost
        node go): its number, free again, is then soon a new node's pipe. Had the reactor watched
        that number, a wake-up already taken for the old stream would read the new node's first
        bytes (its hello) into the old node's parser, and the new node would never be heard."""
        os.set_blocking(stream.fileno(), False)  # a spurious wake-up must never block every other stream
        if isinstance(stream, io.BufferedReader):
            held = stream.read1(CHUNK)  # only what it buffered: a non-blocking pipe has no more yet
            if held:
                try:
                    on_data(held)
                except Exception as exc:  # noqa: BLE001 - as for any chunk (see _read)
                    on_end(f"{type(exc).__name__}: {exc}")
                    return
        self._added.put((os.dup(stream.fileno()), on_data, on_end))
        self._wake()

    def watch_exit(self, pid: int, on_end: OnEnd) -> bool:
        """`on_end(ENDED)` once process `pid` has ended (it is not reaped here: its owner does
        that, and may wait on it elsewhere too). False where no pidfd can be had (an older
        kernel, a process already reaped): the caller then waits in a thread of its own."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return False
        self._added.put((fd, None, on_end))
        self._wake()
        return True

    def call_later(self, delay: float, what: Later) -> None:
        """Run `what` on the reactor's thread `delay` seconds from now (a bounded wait that must not
        hold a thread: a rank's exit report waiting for its streams to drain)."""
        with self._lock:
            heapq.heappush(self._timers, (time.monotonic() + delay, next(self._order), what))
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="skytasks-reactor")
                self._thread.start()
        os.write(self._wake_w, b"+")

    def _register_added(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                fd, on_data, on_end = self._added.get_nowait()
            except queue.Empty:
                return
            try:
                self._selector.register(fd, selectors.EVENT_READ, (on_data, on_end))
            except (OSError, ValueError) as exc:
                os.close(fd)
                on_end(f"the stream could not be watched: {exc}")

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select(self._run_due_timers()):
                if key.data is None:
                    self._register_added()
                    continue
                on_data, on_end = key.data
                if on_data is None:  # a watched process ended: its pidfd is readable
                    self._end(key.fd, on_end, ENDED)
                else:
                    self._read(key.fd, on_data, on_end)

    def _run_due_timers(self) -> float | None:
        """Run every timer that is due; how long until the next one (None: there is none)."""
        while True:
            with self._lock:
                if not self._timers:
                    return None
                when, _, what = self._timers[0]
                wait = when - time.monotonic()
                if wait > 0:
                    return wait
                heapq.heappop(self._timers)
            try:
                what()
            except Exception:  # noqa: BLE001 - one timer's bug must not stop every stream's reader
                traceback.print_exc()

    def _read(self, fd: int, on_data: OnData, on_end: OnEnd) -> None:
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError as exc:
            self._end(fd, on_end, str(exc))
            return
        if not data:
            self._end(fd, on_end, "the stream closed")
            return
        try:
            on_data(data)
        except Exception as exc:  # noqa: BLE001 - a corrupt or malformed stream ends, named
            self._end(fd, on_end, f"{type(exc).__name__}: {exc}" if not isinstance(exc, ChannelClosed) else str(exc))

    def _end(self, fd: int, on_end: OnEnd, why: str) -> None:
        self._selector.unregister(fd)
        os.close(fd)  # ours (see add): only now may its number be used again
        on_end(why)


_shared: StreamReactor | None = None
_shared_lock = threading.Lock()


def shared_reactor() -> StreamReactor:
    """This process's reactor, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = StreamReactor()
        return _shared


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: its streams need a reactor of its own."""
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
