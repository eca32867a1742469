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
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable

from skytasks.protocol import Op, check, message
from skytasks.resume import agent_proof, controller_proof, new_nonce, proof_matches
from skytasks.wire import ChannelClosed, encode, read_frame

HANDSHAKE_SECONDS = 10.0
PENDING_HANDSHAKES = 4
MAX_ATTACH_BYTES = 64 << 10  # an ATTACH frame is a few hundred bytes: more is not one
_UCRED = struct.Struct("3i")  # pid, uid, gid
# Past the LEASE's reattach_seconds the agent waits this much more: the controller, noticing the
# break the same way, gives up first (a late re-attach would meet stopped ranks).
REATTACH_MARGIN_SECONDS = 2.0


class _SocketReader:
    """Exact reads from a socket for the handshake: nothing past the frame is taken from it, and
    nothing after `deadline` (a client trickling a byte at a time holds its slot no longer)."""

    def __init__(self, sock: socket.socket, limit: int, deadline: float):
        self.sock, self.left, self.deadline = sock, limit, deadline

    def readinto(self, buffer: Any, /) -> int:
        view = memoryview(buffer).cast("B")
        if self.left <= 0:
            raise ChannelClosed("the ATTACH frame is too large")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the door's handshake took too long")
        self.sock.settimeout(left)
        n = self.sock.recv_into(view[:self.left])
        self.left -= n
        return n


class Door:
    """Listens at `<scratch>/door.sock`. Once leased (`lease(key)`), a controller that proves the
    key is passed to `attach(conn, attach_msg, greeting)`, the agent's (node/reattach.py): it
    decides by the ATTACH's mode and holder, and returns None when it served the controller (a
    probe answered, or the stream swapped onto a descriptor of its own for `conn`), else the
    REFUSED to send. `greeting(got)` is the ATTACHED frame, with `state()` and the agent's proof."""

    def __init__(self, scratch: str, instance: str, attach: Callable[[socket.socket, dict[str, Any],
                 Callable[[int], list[Any]]], dict[str, Any] | None], state: Callable[[], dict[str, Any]],
                 rekeyed: Callable[[], dict[str, Any]] | None = None):
        self.path = os.path.join(scratch, "door.sock")
        self.instance, self._attach, self._state = instance, attach, state
        self._rekeyed = rekeyed  # what a REFUSED for an unproven key says of the holder (a warm pool's)
        self._key: bytes | None = None
        self.refused = 0  # connections that failed the handshake, the key or the uid check
        self.admitted = 0
        self._said_at = 0.0  # when a failure to admit was last said (once a minute at most)
        self._pending = threading.BoundedSemaphore(PENDING_HANDSHAKES)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(16)
        threading.Thread(target=self._accept, daemon=True, name="skytasks-door").start()

    def lease(self, key: bytes) -> None:
        """From now on, a controller that proves `key` may attach (as the agent decides)."""
        self._key = key

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
            try:
                threading.Thread(target=self._admit, args=(conn,), daemon=True, name="skytasks-door-admit").start()
            except Exception as exc:  # noqa: BLE001 - no thread to be had now (memory): refuse this one, go on
                self._pending.release()
                self.refused += 1
                conn.close()
                if time.monotonic() - self._said_at > 60:
                    self._said_at = time.monotonic()
                    print(f"skytasks agent: the door could not admit a connection: {exc}", file=sys.stderr, flush=True)
                time.sleep(0.1)

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
        """CHALLENGE, ATTACH, then ATTACHED (the agent served it) or REFUSED; whether a stream
        now goes on through `conn`."""
        key = self._key
        if key is None:
            return False
        deadline = time.monotonic() + HANDSHAKE_SECONDS  # the whole handshake, not each step
        conn.settimeout(HANDSHAKE_SECONDS)
        nonce = new_nonce()
        conn.sendall(_frame(message(Op.CHALLENGE, nonce=nonce, instance=self.instance)))
        msg = read_frame(_SocketReader(conn, MAX_ATTACH_BYTES, deadline))
        conn.settimeout(HANDSHAKE_SECONDS)  # for what the agent writes back
        check(msg)
        if msg["op"] != Op.ATTACH:
            raise ValueError(f"{msg['op']} where ATTACH was due")
        expected = controller_proof(key, nonce, msg["nonce"], msg["holder"], msg["mode"], msg["got"])
        if not proof_matches(expected, msg["proof"]):
            self.refused += 1
            # A warm pool's key changes at every new hold: a past holder (only a process of the
            # agent's own user reaches this door) hears who holds the pool now, in words, as
            # `skytasks pools` says it; never the holder's id.
            held = self._rekeyed() if self._rekeyed else {}
            conn.sendall(_frame(message(Op.REFUSED, reason="the pool's key was not proven", **held)))
            return False

        def greeting(got: int) -> list[Any]:
            return encode(message(Op.ATTACHED, proof=agent_proof(key, msg["nonce"], nonce, got), got=got,
                                  state=self._state()))

        refusal = self._attach(conn, msg, greeting)
        if refusal is not None:
            conn.settimeout(HANDSHAKE_SECONDS)
            conn.sendall(_frame(refusal))
            return False
        return msg["mode"] != "probe"


def _frame(msg: dict[str, Any]) -> bytes:
    return b"".join(bytes(c) for c in encode(msg))
