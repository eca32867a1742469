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

Standard library only (`hashlib` is imported at a peer's first connection).
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


class PeerLinks:
    """The agent's connections to its children in the relay tree, kept across calls."""

    def __init__(self, secret: bytes, tls: PeerTLS | None = None):
        self._secret, self._tls = secret, tls
        self._writers: dict[tuple[str, int], FrameWriter] = {}
        self._opening: dict[tuple[str, int], threading.Event] = {}  # a handshake under way, by peer
        self._lock = threading.Lock()

    def writer(self, address: str, port: int) -> FrameWriter:
        """The kept link to a peer, opened now if there is none. One opener at a time per peer: a
        call that needs a link the LINKS warm-up is opening waits for that handshake rather than
        making a second (and tries itself if that one failed)."""
        key = (address, port)
        waited = False
        while True:
            with self._lock:
                kept = self._writers.get(key)
                if kept is not None:
                    return kept
                opening = self._opening.get(key)
                if opening is None or waited:
                    mine = self._opening[key] = threading.Event()
            if opening is not None and not waited:
                opening.wait(HANDSHAKE_SECONDS)
                waited = True
                continue
            break
        try:  # not under the lock: open_all opens several side by side
            made = connect(address, port, self._secret, tls=self._tls)
            with self._lock:
                self._writers[key] = made
            return made
        finally:
            with self._lock:
                if self._opening.get(key) is mine:
                    del self._opening[key]
            mine.set()

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

    def forget(self, address: str, port: int) -> None:
        with self._lock:
            w = self._writers.pop((address, port), None)
        if w is not None:
            w.close()
