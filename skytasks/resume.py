"""A stream that survives a change of transport: what each side keeps, and how two sides prove the
pool's key to each other before a new transport joins the stream (design 52, B.1).

Each direction between a controller and a node's agent is one logical byte stream, counted from
the agent's first frame (HELLO) and from the controller's first frame. The sender keeps every byte
the other side has not acknowledged in an `Outbox` (references to the chunks `wire.encode` made,
never copies); the receiver counts what it read (`got`) and says so on HEARTBEAT. When a transport
breaks and a new one is attached (node/door.py, the agent's side), each side resends from the
other's `got`: nothing is lost, nothing arrives twice, and a frame cut in half goes on where it was
cut (a relayed CALL's head already sits in the ranks' pipes: it cannot be sent again whole).

The handshake (protocol: CHALLENGE, ATTACH, ATTACHED) proves the pool's key both ways and never
sends it: k = the pool key's door subkey (HKDF, `subkey`), the controller's proof binds both nonces, the
holder, the mode and its count, the agent's proof binds both nonces and its count.

Standard library only: the node side imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import deque
from typing import Any

# An ack (HEARTBEAT `got`) goes out early once this much arrived since the last one, so a burst
# of large results is not held in memory until the next heartbeat.
ACK_BYTES = 8 << 20
NONCE_BYTES = 16


def outbox_cap() -> int:
    """Bytes a side may keep unacknowledged while its stream is broken before the senders wait
    (ranks get back-pressure; nothing is dropped): SKYTASKS_REATTACH_BUFFER_MB, default 1024."""
    try:
        return max(1, int(float(os.environ.get("SKYTASKS_REATTACH_BUFFER_MB", "1024")) * (1 << 20)))
    except ValueError:
        return 1024 << 20


OUTBOX_CAP = outbox_cap()


def _nbytes(chunk: Any) -> int:
    return len(chunk) if isinstance(chunk, (bytes, bytearray)) else memoryview(chunk).nbytes


class Outbox:
    """The bytes of one direction that the other side has not acknowledged yet: `[acked, sent)`.

    `append` keeps references to the chunks (a frame's header, pickle and out-of-band buffers):
    a chunk must not change after it was appended. Thread-safe."""

    def __init__(self, start: int = 0) -> None:
        """`start`: the stream offset of the first byte kept (bytes before it are not kept)."""
        self._chunks: deque[memoryview] = deque()
        self._first = start  # stream offset of _chunks[0]
        self.sent = start  # bytes appended since the stream began
        self.acked = start  # bytes the other side said it read (or were never kept)
        self._changed = threading.Condition()

    @property
    def size(self) -> int:
        """Bytes kept (sent, not acknowledged)."""
        return self.sent - self.acked

    def append(self, chunks: list[Any]) -> int:
        """Keep these chunks (one frame or part of one); the stream offset after them."""
        with self._changed:
            for chunk in chunks:
                n = _nbytes(chunk)
                if n:
                    self._chunks.append(memoryview(chunk).cast("B"))
                    self.sent += n
            return self.sent

    def ack(self, got: int) -> None:
        """The other side read `got` bytes of this stream: drop what it read. An ack below an
        earlier one is stale (it crossed a newer one) and changes nothing; past `sent` is a bug
        of the other side: ValueError."""
        with self._changed:
            if got > self.sent:
                raise ValueError(f"acknowledged {got} bytes of a stream of {self.sent}")
            if got <= self.acked:
                return
            self.acked = got
            while self._chunks and self._first + self._chunks[0].nbytes <= got:
                self._first += self._chunks.popleft().nbytes
            self._changed.notify_all()

    def since(self, offset: int) -> list[memoryview]:
        """The chunks from stream offset `offset` to `sent` (the first one sliced), for a resend
        to a side that read `offset` bytes. ValueError when those bytes are no longer kept
        (`offset` < acked: it acknowledged more before) or were never sent."""
        with self._changed:
            if offset > self.sent or offset < self._first:
                raise ValueError(f"bytes from {offset} on are not kept (kept: {self._first} to {self.sent})")
            out, pos = [], self._first
            for chunk in self._chunks:
                end = pos + chunk.nbytes
                if end > offset:
                    out.append(chunk[max(0, offset - pos):])
                pos = end
            return out

    def wait_room(self, cap: int, deadline: float | None = None) -> bool:
        """Wait until at most `cap` bytes are kept (acks make room) or `deadline` (monotonic)
        passes; whether there is room."""
        with self._changed:
            while self.size > cap:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(left if left is None else min(left, 1.0))
            return True

    def wake(self) -> None:
        """Wake whoever waits in `wait_room` (the stream gave up: they should look again)."""
        with self._changed:
            self._changed.notify_all()


# -- proving the pool's key over a new transport --------------------------------------------------

# Each use of the pool's key has a subkey of its own, named by a label: the relay's peer challenge
# (node/peer_links.py, handed its subkey in PEERS) and the door's handshake. A party that can make
# one of them compute a MAC of its choosing learns nothing about the other's key, whatever the
# lengths of labels and nonces.
DOOR_LABEL = b"skytasks door handshake v1"
RELAY_LABEL = b"skytasks relay peers v1"
_SALT = b"skytasks pool key"


def subkey(pool_key: bytes, label: bytes) -> bytes:
    """HKDF-SHA256 (RFC 5869, one block) of the pool's key for the use `label` names."""
    prk = hmac.new(_SALT, pool_key, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


def attach_key(pool_key: bytes) -> bytes:
    """The key the door handshake uses: the pool key's door subkey (never the pool's key itself)."""
    return subkey(pool_key, DOOR_LABEL)


def new_nonce() -> str:
    """A fresh nonce for one handshake (hex, as CHALLENGE and ATTACH carry it)."""
    return os.urandom(NONCE_BYTES).hex()


def _mac(pool_key: bytes, *parts: bytes) -> str:
    body = b"\x00".join(parts)
    return hmac.new(attach_key(pool_key), body, hashlib.sha256).hexdigest()


def controller_proof(pool_key: bytes, agent_nonce: str, controller_nonce: str, holder: str, mode: str,
                     got: int) -> str:
    """ATTACH's `proof`: the controller knows the pool's key, for this challenge, holder, mode and count."""
    return _mac(pool_key, b"C", agent_nonce.encode(), controller_nonce.encode(), holder.encode(), mode.encode(),
                str(got).encode())


def agent_proof(pool_key: bytes, controller_nonce: str, agent_nonce: str, got: int) -> str:
    """ATTACHED's `proof`: the agent knows the pool's key too (a controller never resends its
    stream to an impostor that only relays the challenge)."""
    return _mac(pool_key, b"A", controller_nonce.encode(), agent_nonce.encode(), str(got).encode())


def proof_matches(expected: str, given: Any) -> bool:
    """Whether a proof from the other side is the expected one (constant time; anything else: no)."""
    return type(given) is str and hmac.compare_digest(expected.encode(), given.encode())
