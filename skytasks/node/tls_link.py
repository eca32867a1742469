"""One end of a relay link as TLS: the pool's certificate and key as contexts (`PeerTLS`), the
receiving end read through memory (`TLSReader`), the sending end in large writes (`LinkWriter`).

Each agent presents the pool's certificate and trusts that one alone (`check_hostname` off: peers
are addressed by IP, the certificate is pinned instead). The certificate and its key are made per
pool by the controller (skytasks/tls/pool_identity.py) and handed to each agent in its PEERS
message over the controller's own channel (pipes, SSH with pinned host keys, srun, the Kubernetes
API's exec), never put in a file that outlives loading it, a command line, the environment or a
log.

TLS costs what AES-GCM costs and little more: the receiving end reads TLS through memory (many
records per system call, each decrypted straight into the frame's buffer), and the sending end
hands each 1 MB chunk to one SSL_write.

Standard library only, like the rest of the node side. `ssl` is imported when the relay first
needs it (LINKS, or a large call), so an agent whose pool never relays does not load OpenSSL; the
local agents' fork server imports it once for all of them.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from typing import Any, Sequence

from skytasks.wire import ChannelClosed

STREAM_BUFFER = 1 << 20
# What a listener reads a handshake through: a TLS record is at most 16 KB and a little. The
# STREAM_BUFFER comes only once the peer is admitted (`widen`), so a stranger who connects and
# stalls costs this much, not a megabyte.
HANDSHAKE_BUFFER = 17 * 1024

class PeerTLS:
    """The pool's certificate and key (PEM), as TLS contexts for either end of a peer link, made
    at first use. Both ends require the other's certificate and trust only the pool's."""

    def __init__(self, cert: str, key: str):
        self._cert, self._key = cert, key
        self._contexts: dict[bool, Any] = {}
        self._lock = threading.Lock()

    def context(self, server_side: bool) -> Any:
        with self._lock:
            if server_side not in self._contexts:
                self._contexts[server_side] = self._make(server_side)
            return self._contexts[server_side]

    def _make(self, server_side: bool) -> Any:
        import ssl

        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.check_hostname = False  # peers are addressed by IP: the pool's certificate is pinned instead
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: a listener admits, and a peer sends to, members only
        ctx.load_verify_locations(cadata=self._cert)
        _load_chain(ctx, self._cert + self._key)
        return ctx

    def wrap(self, sock: socket.socket, server_side: bool) -> socket.socket:
        """`sock` as a TLS link, its handshake done (within the socket's timeout); ssl.SSLError
        (an OSError) if the other end does not prove the pool's key. (A peer's sending end.)"""
        wrapped: socket.socket = self.context(server_side).wrap_socket(sock, server_side=server_side)
        return wrapped

    def accept(self, sock: socket.socket, deadline: float) -> TLSReader:
        """The listener's end of a TLS link on `sock`, its handshake done by `deadline`
        (time.monotonic()); ssl.SSLError (an OSError) if the peer does not prove the pool's key,
        TimeoutError past the deadline, ChannelClosed if the peer hangs up."""
        import ssl

        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        link = TLSReader(sock, self.context(True).wrap_bio(incoming, outgoing, server_side=True), incoming, outgoing)
        link.deadline = deadline  # until PeerListener admits the peer (`widen`)
        while True:
            try:
                link.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                link.send_pending()
                link.fill(deadline)
            except ssl.SSLError:
                try:
                    link.send_pending()  # the alert that says why, as an SSLSocket would send it
                except OSError:
                    pass
                raise
        link.send_pending()  # the handshake's last words (TLS 1.3's session tickets)
        return link


class TLSReader:
    """The receiving end of a peer link, TLS read through memory (`ssl.MemoryBIO`) rather than
    an SSLSocket: an SSLSocket takes one 16 KB record per call, two system calls each (its
    header, then its body), each through a buffered file's copy; here one recv takes whatever the
    socket holds (many records) and each record is decrypted straight into the reader's buffer.
    What TLS checks is unchanged: a record that fails its check raises ssl.SSLError."""

    def __init__(self, sock: socket.socket, tls: Any, incoming: Any, outgoing: Any):
        import ssl

        self.sock, self.tls = sock, tls
        self._incoming, self._outgoing = incoming, outgoing
        self._want_read = ssl.SSLWantReadError
        self._raw = memoryview(bytearray(HANDSHAKE_BUFFER))
        self._ended = False
        # Until the peer is admitted every read keeps to the handshake's deadline (time.monotonic()),
        # also the challenge's answer inside TLS: a peer that trickles its bytes is cut off all the same.
        self.deadline: float | None = None

    def widen(self) -> None:
        """The peer is admitted: reads from now on take many records at a time, with no deadline."""
        self.deadline = None
        if len(self._raw) < STREAM_BUFFER:
            self._raw = memoryview(bytearray(STREAM_BUFFER))

    def fill(self, deadline: float | None = None) -> bool:
        """More of the peer's bytes from the socket (one recv, as many as are there); False at
        its end. With `deadline` (time.monotonic()): TimeoutError past it."""
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the peer's TLS handshake took too long")
            self.sock.settimeout(left)
        n = self.sock.recv_into(self._raw)
        if not n:
            if deadline is not None:
                raise ChannelClosed("the peer closed the connection during the handshake")
            return False
        self._incoming.write(self._raw[:n])
        return True

    def send_pending(self) -> None:
        if self._outgoing.pending:
            self.sock.sendall(self._outgoing.read())

    def write(self, data: bytes) -> None:
        """A few bytes to the peer (the challenge's nonce and its verdict), sent at once."""
        self.tls.write(data)
        self.send_pending()

    def readinto(self, buffer: Any, /) -> int:
        """Fill `buffer` (a byte memoryview or bytearray); fewer bytes only at the link's end."""
        view = buffer if isinstance(buffer, memoryview) else memoryview(buffer)
        want = view.nbytes
        got = 0
        read, want_read = self.tls.read, self._want_read
        while got < want and not self._ended:
            try:
                n = read(want - got, view[got:] if got else view)
            except want_read:
                if not self.fill(self.deadline):
                    self._ended = True  # no close_notify: a frame cut short is the reader's to name
                continue
            if not n:  # the peer's close_notify
                self._ended = True
            got += n
        return got

    def close(self) -> None:
        self.sock.close()


class LinkWriter:
    """The sending end of a peer link, as FrameWriter's stream: small writes (a frame's header,
    a ROUTE) gathered into one send, a large chunk sent from its own memory with one call (one
    SSL_write of all its records with TLS), never copied through a buffered file first."""

    GATHER = 64 * 1024

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self._gathered = bytearray()

    def write(self, chunk: Any) -> None:
        size = len(chunk) if isinstance(chunk, (bytes, bytearray)) else memoryview(chunk).nbytes
        if len(self._gathered) + size <= self.GATHER:
            self._gathered += chunk
            return
        self.flush()
        if size < self.GATHER:
            self._gathered += chunk
        else:
            self._sock.sendall(chunk)

    def writelines(self, chunks: Sequence[Any]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        if self._gathered:
            self._sock.sendall(self._gathered)
            self._gathered.clear()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self._sock.close()


def _load_chain(ctx: Any, pem: str) -> None:
    """OpenSSL reads a certificate chain from a file only: a memory file (Linux), read through its
    /proc path and closed at once, so the key never touches a disk; elsewhere a 0600 file in a
    private directory, removed as soon as it is read."""
    data = pem.encode()
    try:
        fd = os.memfd_create("skytasks-peer", os.MFD_CLOEXEC)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            _write_all(fd, data)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
            return
        except OSError:
            pass  # no /proc: a file, below
        finally:
            os.close(fd)
    folder = tempfile.mkdtemp(prefix="skytasks-peer-")  # 0700
    path = os.path.join(folder, "pool.pem")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _write_all(fd, data)
        finally:
            os.close(fd)
        ctx.load_cert_chain(path)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
        os.rmdir(folder)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
