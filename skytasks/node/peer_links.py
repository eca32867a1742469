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
import threading
import time
from typing import Any, Callable, Sequence

from skytasks.node.tls_link import STREAM_BUFFER, LinkWriter, PeerTLS
from skytasks.wire import ChannelClosed, FrameWriter, Readable, read_exact

NONCE_BYTES = 16
DIGEST_BYTES = 32
HANDSHAKE_SECONDS = 10.0
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
    """The challenge on a link without TLS (SKYTASKS_PEER_TLS=0)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def write(self, data: bytes) -> None:
        self.sock.sendall(data)

    def readinto(self, buffer: Any, /) -> int:
        return self.sock.recv_into(buffer)


class PeerListener:
    """The agent's door for its parent in the relay tree: one thread per accepted, proven peer,
    which hands the connection's frames to `serve(stream)`. `tls` None: no TLS (SKYTASKS_PEER_TLS=0)."""

    def __init__(self, address: str, secret: bytes, serve: Callable[[Readable], None], tls: PeerTLS | None = None):
        self._secret, self._serve, self._tls = secret, serve, tls
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, 0))  # this interface only, never 0.0.0.0
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self.refused = 0  # connections that failed the TLS handshake or the challenge
        threading.Thread(target=self._accept, daemon=True, name="skytasks-peers").start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + HANDSHAKE_SECONDS  # TLS and the challenge, all told
        stream: Any
        try:
            conn.settimeout(HANDSHAKE_SECONDS)
            if self._tls is not None:
                stream = self._tls.accept(conn, deadline)  # no pool certificate: refused here
            else:
                stream = _PlainLink(conn)
            nonce = os.urandom(NONCE_BYTES)
            stream.write(nonce)
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            answer = bytes(read_exact(stream, DIGEST_BYTES))
            if not _same(answer, _proof(self._secret, nonce)):
                self.refused += 1
                conn.close()
                return
            stream.write(b"\x01")  # admitted
            conn.settimeout(None)
        except (OSError, ChannelClosed):  # ssl.SSLError is an OSError
            self.refused += 1
            conn.close()
            return
        if self._tls is None:
            stream = conn.makefile("rb", buffering=STREAM_BUFFER)
        try:
            self._serve(stream)
        finally:
            stream.close()
            conn.close()

    def close(self) -> None:
        try:
            self._sock.close()
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
