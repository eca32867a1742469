"""The agent's side of being reached again: its LEASE, its holder, and what comes through its door.

`Reattach` glues the agent's stream (`WarmStream`), its door (node/door.py) and its holding
clocks (node/holding.py): a broken holder may resume within its window; on a warm pool (LEASE
`keep_warm_seconds` > 0) the agent then stays up, unheld, for the next process to hold on a fresh
stream, until nobody held it for keep_warm_seconds. Probes are answered with the agent's state.
"""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable

from skytasks.node.agent_stream import AgentStream, Transport, socket_transport
from skytasks.node.door import Door
from skytasks.node.holding import DETACHED, HELD, UNHELD, Holding
from skytasks.protocol import Op, message
from skytasks.resume import ACK_BYTES, Outbox
from skytasks.silence import HeardStream
from skytasks.wire import ChannelClosed

# Past the LEASE's reattach_seconds the agent waits this much more: the controller, noticing the
# break the same way, gives up first (a late re-attach would meet stopped ranks).
REATTACH_MARGIN_SECONDS = 2.0
# A warm lease without a re-attach window (local pools): a break lets go of the holder at once.
NO_WINDOW_SECONDS = 0.01


class StreamRestarted(ChannelClosed):
    """A new holder's fresh stream replaced the old one: a frame half read from the old one is
    dropped, and reading starts again at the new stream's first frame."""


class WarmStream(AgentStream):
    """The agent's stream, which a holder can let go of (RELEASE) and a new holder take up
    afresh, counted from 0 both ways (ATTACH "hold")."""

    def __init__(self, read_fd: int, write_fd: int, gone: Callable[[str], None]):
        super().__init__(read_fd, write_fd, gone)
        self._restarted = False

    def let_go(self, why: str) -> None:
        """The holder let go: its transport is closed (its end is no break) and reads wait for the next."""
        self.broke(why)

    def fresh(self, transport: Transport, greeting: list[Any]) -> None:
        """A new holder's stream: nothing of the old one is kept or resent; `greeting` (ATTACHED)
        goes first, uncounted."""
        with self._state:
            if self._transport is not None:
                self._transport.abandon()
        with self._wlock:
            with self._rlock, self._state:
                if self._transport is not None:
                    self._transport.retire(self._retired)
                self._transport, self.broken_at = transport, None
                self.got = self.sent = 0
                self._buf.clear()
                self.outbox = Outbox(0)
                self._restarted = True
                self._state.notify_all()
            try:
                self._write_all(transport, greeting)
            except Exception as exc:  # noqa: BLE001 - _Abandoned or OSError: a break, as any other
                self._after_write_error(transport, exc)

    def readinto(self, buffer: Any) -> int:
        if self._restarted:
            self._restarted = False
            raise StreamRestarted("a new holder took the node")
        n = super().readinto(buffer)
        if self._restarted and n:  # read from the new stream: kept for the frame read anew
            self._restarted = False
            self._buf[:0] = memoryview(buffer).cast("B")[:n]
            raise StreamRestarted("a new holder took the node")
        return n


class Reattach:
    """The agent's door, its LEASE and holder, and the acknowledgements of what arrived (HEARTBEAT
    `got`) both ways. `state()`: what the agent says of itself to whoever attaches."""

    def __init__(self, stream: WarmStream, inbound: HeardStream, scratch: str, state: Callable[[], dict[str, Any]]):
        self.stream, self._inbound, self._scratch, self._agent_state = stream, inbound, scratch, state
        self.instance = secrets.token_hex(8)
        self.holding: Holding | None = None  # from the first LEASE with a window or keep-warm time
        self._lock = threading.RLock()  # the holding's decisions
        self.ack_due = threading.Event()  # much arrived since the last ack: send one now
        self._last_ack = 0
        self._logging = False
        stream.read_wake, stream.on_broke = self._maybe_ack, self._broke
        try:  # only open to a controller that proves the pool's key, after a LEASE
            self.door: Door | None = Door(scratch, self.instance, self._attach, self.state, self._holder_now)
        except OSError as exc:  # e.g. a scratch path past AF_UNIX's 107 bytes: no re-attach for this agent
            print(f"skytasks agent: no door ({exc}); a broken stream will end this node", file=sys.stderr, flush=True)
            self.door = None

    def _holder_now(self) -> dict[str, Any]:
        """Who holds a warm node now, for a controller whose key is no longer the pool's (a new
        holder gave the pool a fresh one): it learns it was evicted. Nothing on a pool that is
        not warm (its key never changes: a wrong key is a stranger's), never the holder's id."""
        with self._lock:
            h = self.holding
            if h is None or h.keep_warm <= 0 or h.state not in (HELD, DETACHED):
                return {}
            return {"holder": h.who or "another controller", "since": _epoch(h.held_since)}

    def hello_fields(self) -> dict[str, Any]:
        return {"door": self.door.path, "instance": self.instance} if self.door else {}

    def state(self) -> dict[str, Any]:
        with self._lock:
            held = self.holding.describe(time.monotonic(), time.time()) if self.holding else {}
        return {**self._agent_state(), **held, "instance": self.instance, "door": self.door.path if self.door else ""}

    # -- acknowledgements --------------------------------------------------------------------

    def heartbeat(self) -> dict[str, Any]:
        """A heartbeat; after a LEASE with what arrived so far (an ack)."""
        if self.stream.outbox is None:
            return message(Op.HEARTBEAT)
        self._last_ack = got = self.stream.got
        return message(Op.HEARTBEAT, got=got)

    def _maybe_ack(self, got: int) -> None:
        if self.stream.outbox is not None and got - self._last_ack >= ACK_BYTES:
            self.ack_due.set()

    def acked(self, msg: dict[str, Any]) -> None:
        """The controller's heartbeat: it read `got` bytes of ours, which need not be kept any more."""
        if "got" in msg and self.stream.outbox is not None:
            try:
                self.stream.outbox.ack(msg["got"])
            except ValueError as exc:
                print(f"skytasks agent: {exc}", file=sys.stderr, flush=True)

    # -- the holder --------------------------------------------------------------------------

    def lease(self, msg: dict[str, Any]) -> None:
        """LEASE: the agent now outlives a break of its stream for the window (0: it does not),
        and, with keep_warm_seconds, its holder too."""
        reattach, keep_warm = msg["reattach_seconds"], msg["keep_warm_seconds"]
        if (reattach <= 0 and keep_warm <= 0) or self.door is None:
            return
        if not self._logging:
            _log_to(os.path.join(self._scratch, "agent.log"))  # a dead stream's stderr must not kill it
            self._logging = True
        window = reattach + REATTACH_MARGIN_SECONDS if reattach > 0 else NO_WINDOW_SECONDS
        self.stream.lease(window)
        self.door.lease(bytes.fromhex(msg["key"]))
        with self._lock:
            if self.holding is None:
                self.holding = Holding()
            self.holding.lease(msg["holder"], msg.get("who", ""), window, keep_warm, time.monotonic())

    def release(self) -> None:
        """RELEASE: the holder lets go; the node waits, unheld, for the next (its end is no break)."""
        with self._lock:
            if self.holding is None:
                return
            self.holding.released(time.monotonic())
            left = self.holding.keep_warm
        print(f"skytasks agent: released by its holder; up for the next one for {left:g}s", file=sys.stderr, flush=True)
        self.stream.let_go("released by its holder")

    def tick(self) -> str:
        """The holding clocks' verdict now (holding.UNHOLD, END, EXPIRE, or "")."""
        with self._lock:
            return self.holding.tick(time.monotonic()) if self.holding else ""

    @property
    def unheld(self) -> bool:
        return self.holding is not None and self.holding.state == UNHELD

    @property
    def leased(self) -> bool:
        return self.holding is not None

    def _broke(self, why: str) -> None:
        with self._lock:
            if self.holding is None or self.holding.state != HELD:
                return  # released: the holder's end of the stream is no break
            self.holding.broke(time.monotonic())
            window, warm = self.holding.window, self.holding.keep_warm
        then = f"then stays up unheld for {warm:g}s" if warm > 0 else "then ends"
        print(f"skytasks agent: {why}; the ranks run on, waiting {window:g}s for the controller to come back "
              f"through {self.door.path if self.door else '-'}, {then}", file=sys.stderr, flush=True)

    def _attach(self, conn: socket.socket, msg: dict[str, Any],
                greeting: Callable[[int], list[Any]]) -> dict[str, Any] | None:
        """A controller proved the pool's key at the door: None when it was served (probe) or
        the stream now goes on through `conn`; else the REFUSED to send it."""
        mode, now = msg["mode"], time.monotonic()
        if mode == "probe":
            conn.sendall(b"".join(bytes(c) for c in greeting(0)))
            return None
        with self._lock:
            holding = self.holding
            if holding is None:
                return message(Op.REFUSED, reason="the node has no lease")
            if mode == "hold":
                refusal = holding.ask_hold(msg["holder"], msg["who"], now)
                if refusal is not None:
                    return message(Op.REFUSED, reason=f"the node is held by {refusal[0]}", holder=refusal[0],
                                   since=_epoch(refusal[1]))
            elif mode != "resume":
                return message(Op.REFUSED, reason=f"mode {mode!r} is not served by this agent")
            elif holding.state not in (HELD, DETACHED):
                return message(Op.REFUSED, reason="its holder let the node go (it was not re-attached in time)")
            elif not hmac.compare_digest(holding.holder.encode(), str(msg["holder"]).encode()):
                return message(Op.REFUSED, reason=f"the node is held by {holding.who}", holder=holding.who,
                               since=_epoch(holding.held_since))
        transport = socket_transport(conn)
        if mode == "hold":
            self._last_ack = 0
            self.stream.fresh(transport, greeting(0))
            self._inbound.last_heard = time.monotonic()
            print(f"skytasks agent: held by {msg['who']}", file=sys.stderr, flush=True)
            return None
        got = self.stream.swap(transport, msg["got"], greeting)
        if got is None:
            transport.close()
            os.close(transport.wake_r)  # it never carried the stream: nobody polls it
            return message(Op.REFUSED, reason=f"cannot resume from byte {msg['got']}: no longer kept")
        with self._lock:
            holding.resumed(time.monotonic())
        self._inbound.last_heard = time.monotonic()
        print(f"skytasks agent: re-attached ({msg['who']}); resending from byte {msg['got']}, {got} read",
              file=sys.stderr, flush=True)
        return None

    def close(self) -> None:
        if self.door is not None:
            self.door.close()


def _epoch(monotonic: float) -> float:
    return round(time.time() - (time.monotonic() - monotonic), 3)


def _log_to(path: str) -> None:
    """Point the agent's stderr (and its stray stdout) at a file: the stderr of a stream that broke
    (an SSH channel, an exec) would fail the next print with BrokenPipeError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)
