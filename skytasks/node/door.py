"""The agent's door: where a controller comes back in when its stream to the agent broke.

An AF_UNIX socket in the agent's private scratch folder (0700, tempfile.mkdtemp), reached through
the provider's own way in (a new SSH session, an srun step, a Kubernetes exec) running
node/attach.py's CLIENT. Only a process of the agent's own user may connect (SO_PEERCRED), and
only a controller that proves the pool's key is admitted (resume.py's HMAC challenge, mutual; the
key never crosses). Until a LEASE every connection is closed at once.

Like every listener strangers may reach (API.md, Security), it bounds its pending handshakes and
never stops accepting because one failed.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

from skytasks.node.agent_stream import AgentStream, socket_transport
from skytasks.protocol import Op, check, message
from skytasks.resume import ACK_BYTES, agent_proof, controller_proof, new_nonce, proof_matches
from skytasks.silence import HeardStream
from skytasks.wire import ChannelClosed, encode, read_frame

HANDSHAKE_SECONDS = 10.0
PENDING_HANDSHAKES = 4
MAX_ATTACH_BYTES = 64 << 10  # an ATTACH frame is a few hundred bytes: more is not one
_UCRED = struct.Struct("3i")  # pid, uid, gid
# Past the LEASE's reattach_seconds the agent waits this much more: the controller, noticing the
# break the same way, gives up first (a late re-attach would meet stopped ranks).
REATTACH_MARGIN_SECONDS = 2.0


class Reattach:
    """The agent's side of re-attaching: its door, the LEASE, and the acknowledgements of what
    arrived (HEARTBEAT `got`) both ways. `state()`: what ATTACHED tells of the agent."""

    def __init__(self, stream: AgentStream, inbound: HeardStream, scratch: str, state: Callable[[], dict[str, Any]]):
        self.stream, self._inbound, self._scratch = stream, inbound, scratch
        self.instance = secrets.token_hex(8)
        self.ack_due = threading.Event()  # much arrived since the last ack: send one now
        self._last_ack = 0
        stream.read_wake, stream.on_broke = self._maybe_ack, self._broke
        try:  # only open to a controller that proves the pool's key, after a LEASE
            self.door: Door | None = Door(scratch, self.instance, self._attach, state)
        except OSError as exc:  # e.g. a scratch path past AF_UNIX's 107 bytes: no re-attach for this agent
            print(f"skytasks agent: no door ({exc}); a broken stream will end this node", file=sys.stderr, flush=True)
            self.door = None

    def hello_fields(self) -> dict[str, Any]:
        return {"door": self.door.path, "instance": self.instance} if self.door else {}

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

    def lease(self, msg: dict[str, Any]) -> None:
        """LEASE: the agent now outlives a break of its stream for the window (0: it does not)."""
        if msg["reattach_seconds"] <= 0 or self.door is None:
            return
        _log_to(os.path.join(self._scratch, "agent.log"))  # a dead stream's stderr must not kill it
        self.stream.lease(msg["reattach_seconds"] + REATTACH_MARGIN_SECONDS)
        self.door.lease(bytes.fromhex(msg["key"]), msg["holder"])

    def _broke(self, why: str) -> None:
        print(f"skytasks agent: {why}; the ranks run on, waiting {self.stream.window:g}s for the controller "
              f"to come back through {self.door.path if self.door else '-'}", file=sys.stderr, flush=True)

    def _attach(self, conn: socket.socket, msg: dict[str, Any], greeting: Callable[[int], list[Any]]) -> int | None:
        """A proven controller came back through the door: the stream goes on through `conn`."""
        transport = socket_transport(conn)
        got = self.stream.swap(transport, msg["got"], greeting)
        if got is None:
            transport.close()
            os.close(transport.wake_r)  # it never carried the stream: nobody polls it
            return None
        self._inbound.last_heard = time.monotonic()
        print(f"skytasks agent: re-attached ({msg['who']}); resending from byte {msg['got']}, {got} read",
              file=sys.stderr, flush=True)
        return got

    def close(self) -> None:
        if self.door is not None:
            self.door.close()


class _SocketReader:
    """Exact reads from a socket for the handshake: nothing past the frame is taken from it."""

    def __init__(self, sock: socket.socket, limit: int):
        self.sock, self.left = sock, limit

    def readinto(self, buffer: Any, /) -> int:
        view = memoryview(buffer).cast("B")
        if self.left <= 0:
            raise ChannelClosed("the ATTACH frame is too large")
        n = self.sock.recv_into(view[:self.left])
        self.left -= n
        return n


class Door:
    """Listens at `<scratch>/door.sock`. `attach(conn, attach_msg, greeting)` is the agent's: it
    swaps the stream onto a descriptor of its own for `conn` (AgentStream.swap) and returns the
    count it gave, or None when it could not resume; `state()` is what ATTACHED tells of the agent."""

    def __init__(self, scratch: str, instance: str, attach: Callable[[socket.socket, dict[str, Any],
                 Callable[[int], list[Any]]], int | None], state: Callable[[], dict[str, Any]]):
        self.path = os.path.join(scratch, "door.sock")
        self.instance, self._attach, self._state = instance, attach, state
        self._key: bytes | None = None
        self._holder = ""
        self._held_since = 0.0
        self.refused = 0  # connections that failed the handshake, the key or the uid check
        self.admitted = 0
        self._pending = threading.BoundedSemaphore(PENDING_HANDSHAKES)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(16)
        threading.Thread(target=self._accept, daemon=True, name="skytasks-door").start()

    def lease(self, key: bytes, holder: str) -> None:
        """From now on, a controller that proves `key` for `holder` may attach."""
        self._key, self._holder, self._held_since = key, holder, time.time()

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as exc:
                if self._sock.fileno() < 0:
                    return  # closed
                print(f"skytasks agent: the door's accept failed: {exc}", file=sys.stderr, flush=True)
                time.sleep(0.1)  # e.g. EMFILE: try again, never stop accepting
                continue
            if self._key is None or not self._same_user(conn) or not self._pending.acquire(blocking=False):
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._admit, args=(conn,), daemon=True, name="skytasks-door-admit").start()

    def _same_user(self, conn: socket.socket) -> bool:
        try:
            _pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        except OSError:
            return False
        return uid == os.getuid()

    def _admit(self, conn: socket.socket) -> None:
        try:
            if self._handshake(conn):
                self.admitted += 1
        except (OSError, ChannelClosed, ValueError):
            self.refused += 1
        finally:
            self._pending.release()
            conn.close()  # an admitted stream has a descriptor of its own (the agent's `attach`)

    def _handshake(self, conn: socket.socket) -> bool:
        """CHALLENGE, ATTACH, then ATTACHED (the stream swapped) or REFUSED; whether the stream
        now goes on through `conn`."""
        key, holder = self._key, self._holder
        if key is None:
            return False
        conn.settimeout(HANDSHAKE_SECONDS)  # each step; the whole is bounded by the pending slots
        nonce = new_nonce()
        conn.sendall(_frame(message(Op.CHALLENGE, nonce=nonce, instance=self.instance)))
        msg = read_frame(_SocketReader(conn, MAX_ATTACH_BYTES))
        check(msg)
        if msg["op"] != Op.ATTACH:
            raise ValueError(f"{msg['op']} where ATTACH was due")
        expected = controller_proof(key, nonce, msg["nonce"], msg["holder"], msg["mode"], msg["got"])
        if not proof_matches(expected, msg["proof"]):
            self.refused += 1
            conn.sendall(_frame(message(Op.REFUSED, reason="the pool's key was not proven")))
            return False
        if msg["mode"] != "resume":
            conn.sendall(_frame(message(Op.REFUSED, reason=f"mode {msg['mode']!r} is not served by this agent",
                                        holder=holder, since=self._held_since)))
            return False
        if msg["holder"] != holder:
            conn.sendall(_frame(message(Op.REFUSED, reason="the node is held by another controller",
                                        holder=holder, since=self._held_since)))
            return False

        def greeting(got: int) -> list[Any]:
            return encode(message(Op.ATTACHED, proof=agent_proof(key, msg["nonce"], nonce, got), got=got,
                                  state={**self._state(), "instance": self.instance}))

        if self._attach(conn, msg, greeting) is None:
            conn.settimeout(HANDSHAKE_SECONDS)
            conn.sendall(_frame(message(Op.REFUSED, reason=f"cannot resume from byte {msg['got']}: no longer kept",
                                        holder=holder, since=self._held_since)))
            return False
        return True


def _log_to(path: str) -> None:
    """Point the agent's stderr (and its stray stdout) at a file: the stderr of a stream that broke
    (an SSH channel, an exec) would fail the next print with BrokenPipeError."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    os.close(fd)


def _frame(msg: dict[str, Any]) -> bytes:
    return b"".join(bytes(c) for c in encode(msg))
