"""The links of the relay tree, authenticated both ways: an agent's listener for its parent
(`PeerListener`), and its connections to its children (`connect`, kept in `PeerLinks`).

A peer link is code execution for whoever may write to it (the frames reach the ranks, which
unpickle them), and it carries the pool's arguments, so both ends prove themselves and every
byte is private and checked:
- the listener binds to the node's own address as its peers see it, never to every interface;
- every link is TLS 1.3 with both ends authenticated by the pool's certificate (tls_link.py). A
  stranger cannot connect, cannot listen in a member's place (a member sends nothing to a
  listener that does not prove the pool's key), and cannot read or alter a frame: a changed byte
  fails TLS's record check, the link breaks, and the node reports its call lost with that reason;
- inside the link, the listener still challenges the peer: a random nonce, answered with
  HMAC-SHA256(pool secret, nonce), compared in constant time. With SKYTASKS_PEER_TLS=0 (for
  measuring what TLS costs, nothing else) that challenge alone admits a peer, in the clear.

Standard library only (`hashlib` and `hmac` are imported when the relay first needs them, as
`ssl` is: see tls_link.py).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Callable, Sequence

from skytasks.node.tls_link import STREAM_BUFFER, LinkWriter, PeerTLS
from skytasks.wire import ChannelClosed, FrameWriter, Readable, read_exact

NONCE_BYTES = 16
DIGEST_BYTES = 32
HANDSHAKE_SECONDS = 10.0  # a member's connect and handshake to its child
# The listener's side, against strangers: how long a connection may take to prove itself (TLS
# and the challenge), how many may be doing so at once, and after how long a pending one is
# taken for a stall (a member's takes milliseconds) and gives way to a newcomer.
ADMIT_SECONDS = 5.0
PENDING_HANDSHAKES = 64
STALLED_SECONDS = 1.0
# A churn of new connections from one address (each newcomer pushing out the oldest) would keep
# every slot young: an address not yet known holds at most this many of them ...
PENDING_PER_ADDRESS = 8
# ... and an address a peer has proven itself from (the pool's members) goes first: when every
# slot is taken, its newcomer pushes out the oldest pending one from an address not known, however
# young. At most this many addresses are remembered (the pool's nodes, a few times over).
KNOWN_ADDRESSES = 1024
ACCEPT_PAUSE_SECONDS = 0.1  # after an accept that failed (too many open files): then again
# How long a call waits for a link another thread is opening: its connect and handshake, each
# bounded by HANDSHAKE_SECONDS, and a margin.
OPEN_WAIT_SECONDS = 3 * HANDSHAKE_SECONDS


def _proof(secret: bytes, nonce: bytes) -> bytes:
    import hashlib
    import hmac

    return hmac.new(secret, nonce, hashlib.sha256).digest()


def _same(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ChannelClosed("the peer closed the connection during the handshake")
        data += chunk
    return data


class _PlainLink:
    """The challenge on a link without TLS (SKYTASKS_PEER_TLS=0), within the handshake's deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def readinto(self, buffer: Any, /) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the peer's handshake took too long")
        self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class PeerListener:
    """The agent's door for its parent in the relay tree: one thread per accepted, proven peer,
    which hands the connection's frames to `serve(stream)`. `tls` None: no TLS (SKYTASKS_PEER_TLS=0).

    Anyone on the peers' network can reach it, so what a stranger can make it hold is bounded:
    at most PENDING_HANDSHAKES connections are proving themselves at once, each for at most
    ADMIT_SECONDS, on a small buffer (a peer's 1 MB one comes once it is admitted). When all are
    taken, the oldest gives way to a newcomer if it has stalled past STALLED_SECONDS (a member's
    handshake takes milliseconds), else the newcomer is closed: a stranger who opens connections
    and sends nothing cannot keep the pool's own peers out. Nor can one who churns new ones: an
    address holds at most PENDING_PER_ADDRESS pending handshakes until a peer has proven itself
    from it, and a newcomer from a proven address pushes out a stranger's (known peers first).
    Addresses do not tell apart the users of one machine (a local pool's peers are all on
    loopback): there, only the totals bound a stranger. Whatever fails while accepting (too
    many open files, a thread that cannot start) is said and waited out, never the listener's end.
    `refused` counts connections that failed to prove themselves, `shed` those closed unheard."""

    def __init__(self, address: str, secret: bytes, serve: Callable[[Readable], None], tls: PeerTLS | None = None):
        self._secret, self._serve, self._tls = secret, serve, tls
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, 0))  # this interface only, never 0.0.0.0
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self.refused = 0  # connections that failed the TLS handshake or the challenge
        self.shed = 0  # connections closed unheard: too many handshakes pending, or no thread for one
        # proving themselves, oldest first: (their address, since when)
        self._pending: dict[socket.socket, tuple[str, float]] = {}
        self._known: dict[str, None] = {}  # addresses peers proved themselves from, oldest first
        self._lock = threading.Lock()
        self._closed = False
        self._said_at: dict[str, float] = {}  # each kind of trouble, when last said
        threading.Thread(target=self._accept, daemon=True, name="skytasks-peers").start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, where = self._sock.accept()
            except OSError as exc:  # EMFILE, ENOBUFS, ...: wait it out, go on
                if self._closed:
                    return
                self._trouble("accept", f"accepting a peer failed ({exc}); trying again")
                continue
            try:
                if self._make_room(conn, where[0]):
                    threading.Thread(target=self._admit, args=(conn,), daemon=True, name="skytasks-peer-admit").start()
            except Exception as exc:  # noqa: BLE001 - a thread that cannot start, or anything else: the next one may
                with self._lock:
                    self._pending.pop(conn, None)
                    self.shed += 1
                conn.close()
                self._trouble("take", f"a peer's connection could not be taken ({exc}); it was closed")

    def _make_room(self, conn: socket.socket, address: str) -> bool:
        """Count `conn` among the pending handshakes, making room by cutting a stalled one (from
        its own address first when that address is at its cap) or, for a known address, a
        stranger's; False (`conn` closed) when there is no room."""
        now = time.monotonic()
        with self._lock:
            known = address in self._known
            if not known:
                own = [(c, since) for c, (a, since) in self._pending.items() if a == address]
                if len(own) >= PENDING_PER_ADDRESS and not self._give_way(own[0], now):
                    return self._shed(conn)
            if len(self._pending) >= PENDING_HANDSHAKES:
                stranger = next(((c, 0.0) for c, (a, _) in self._pending.items() if a not in self._known), None)
                oldest = next((c, since) for c, (_, since) in self._pending.items())
                if not ((known and stranger and self._give_way(stranger, now)) or self._give_way(oldest, now)):
                    return self._shed(conn)
            self._pending[conn] = (address, now)
        return True

    def _give_way(self, pending: tuple[socket.socket, float], now: float) -> bool:
        """Cut a pending handshake that has stalled (since 0.0: any); under the lock."""
        conn, since = pending
        if now - since < STALLED_SECONDS:
            return False
        del self._pending[conn]  # its own thread hears the cut and ends
        self.shed += 1
        _cut(conn)
        return True

    def _shed(self, conn: socket.socket) -> bool:
        self.shed += 1
        conn.close()
        return False

    def _trouble(self, kind: str, what: str) -> None:
        """Said at most every few seconds for each kind (a full table of files fails every accept), then a pause."""
        now = time.monotonic()
        if now - self._said_at.get(kind, -10.0) > 5.0:
            self._said_at[kind] = now
            print(f"skytasks agent: the relay listener: {what}", file=sys.stderr, flush=True)
        time.sleep(ACCEPT_PAUSE_SECONDS)

    def _admit(self, conn: socket.socket) -> None:
        stream = None
        try:
            stream = self._prove(conn, time.monotonic() + ADMIT_SECONDS)
        except (OSError, ChannelClosed):  # ssl.SSLError and TimeoutError are OSErrors
            pass
        with self._lock:
            pending = self._pending.pop(conn, None)  # None: cut meanwhile to make room
            mine = pending is not None
            if stream is None and mine:
                self.refused += 1
            elif pending is not None:
                self._remember(pending[0])
        if stream is None or not mine:
            conn.close()
            return
        try:
            self._serve(stream)
        finally:
            stream.close()
            conn.close()

    def _prove(self, conn: socket.socket, deadline: float) -> Any:
        """TLS and the challenge, all told by `deadline`: the admitted peer's stream, or None."""
        stream: Any
        conn.settimeout(ADMIT_SECONDS)
        if self._tls is not None:
            stream = self._tls.accept(conn, deadline)  # no pool certificate: refused here
        else:
            stream = _PlainLink(conn, deadline)
        nonce = os.urandom(NONCE_BYTES)
        stream.write(nonce)
        answer = bytes(read_exact(stream, DIGEST_BYTES))
        if not _same(answer, _proof(self._secret, nonce)):
            return None
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        stream.write(b"\x01")  # admitted
        conn.settimeout(None)
        if self._tls is None:
            return conn.makefile("rb", buffering=STREAM_BUFFER)
        stream.widen()  # only now a peer's 1 MB buffer
        return stream

    def _remember(self, address: str) -> None:
        """A peer proved itself from `address`: known from now on (the newest KNOWN_ADDRESSES)."""
        self._known.pop(address, None)
        self._known[address] = None
        while len(self._known) > KNOWN_ADDRESSES:
            del self._known[next(iter(self._known))]

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            pending = list(self._pending)
        for conn in pending:
            _cut(conn)


def _cut(conn: socket.socket) -> None:
    """End a connection another thread is reading: its read returns at once."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def connect(address: str, port: int, secret: bytes, timeout: float = HANDSHAKE_SECONDS,
            tls: PeerTLS | None = None) -> FrameWriter:
    """A proven connection to a peer's listener, as a frame writer; ChannelClosed if either end
    fails to prove itself (with TLS: nothing is sent to a listener without the pool's key)."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise ChannelClosed(f"cannot reach the peer at {address}:{port}: {exc}") from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            try:
                sock = tls.wrap(sock, server_side=False)
            except OSError as exc:
                raise ChannelClosed(f"the listener at {address}:{port} did not prove the pool's key, so nothing "
                                    f"was sent to it: {exc}") from exc
        nonce = _recv_exact(sock, NONCE_BYTES)
        sock.sendall(_proof(secret, nonce))
        if _recv_exact(sock, 1) != b"\x01":
            raise ChannelClosed(f"the peer at {address}:{port} refused the pool's secret")
        sock.settimeout(None)
    except (OSError, ChannelClosed) as exc:
        sock.close()
        raise ChannelClosed(f"the peer at {address}:{port} refused the connection: {exc}") from exc
    stream: Any = LinkWriter(sock)
    return FrameWriter(stream)


class _Opening:
    """A link being opened: done once it is kept, or failed (`error`)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: ChannelClosed | None = None


class PeerLinks:
    """The agent's connections to its children in the relay tree, kept across calls."""

    def __init__(self, secret: bytes, tls: PeerTLS | None = None):
        self._secret, self._tls = secret, tls
        self._writers: dict[tuple[str, int], FrameWriter] = {}
        self._opening: dict[tuple[str, int], _Opening] = {}  # a link being opened, by peer
        self._lock = threading.Lock()

    def writer(self, address: str, port: int) -> FrameWriter:
        """The kept link to a peer, opened now if there is none; ChannelClosed if it cannot be.
        One opener per peer at a time: a call that needs a link the LINKS warm-up is opening
        waits for that handshake rather than making a second, and hears its failure if it fails
        (asking again then opens anew)."""
        key = (address, port)
        with self._lock:
            kept = self._writers.get(key)
            if kept is not None:
                return kept
            opening = self._opening.get(key)
            mine = opening is None
            if opening is None:
                opening = self._opening[key] = _Opening()
        if not mine:
            if not opening.done.wait(OPEN_WAIT_SECONDS):
                raise ChannelClosed(f"the link to the peer at {address}:{port} was still opening after "
                                    f"{OPEN_WAIT_SECONDS:g}s")
            with self._lock:
                kept = self._writers.get(key)
            if kept is not None:
                return kept
            raise opening.error or ChannelClosed(f"the link to the peer at {address}:{port} closed as it opened")
        try:  # not under the lock: open_all opens several side by side
            made = connect(address, port, self._secret, tls=self._tls)
        except BaseException as exc:
            opening.error = exc if isinstance(exc, ChannelClosed) else ChannelClosed(
                f"the link to the peer at {address}:{port} could not be opened: {exc}")
            with self._lock:
                del self._opening[key]
            opening.done.set()
            raise
        with self._lock:  # only the opener keeps a link for this peer: none is made twice
            self._writers[key] = made
            del self._opening[key]
        opening.done.set()
        return made

    def open_all(self, peers: Sequence[tuple[str, int]]) -> dict[tuple[str, int], ChannelClosed]:
        """Links to those of `peers` that have none yet, opened side by side (each a TLS handshake
        at both ends, and on a node's first relayed call each child's own first use of TLS): a
        node's first relayed call waits for the slowest of its children, not for all of them in
        turn. What could not be opened, and why."""
        with self._lock:
            fresh = [peer for peer in peers if peer not in self._writers]
        failed: dict[tuple[str, int], ChannelClosed] = {}
        if len(fresh) < 2:
            return failed

        def open_one(peer: tuple[str, int]) -> None:
            try:
                self.writer(*peer)
            except ChannelClosed as exc:
                failed[peer] = exc

        threads = [threading.Thread(target=open_one, args=(peer,), daemon=True) for peer in fresh]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return failed

    def forget(self, address: str, port: int, writer: FrameWriter) -> None:
        """Close `writer`, the link to that peer, and keep it no more; a newer link to the same
        peer (opened since by another thread) stays."""
        with self._lock:
            if self._writers.get((address, port)) is writer:
                del self._writers[(address, port)]
        writer.close()
