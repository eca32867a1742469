"""Node to node: a large call relayed down a tree of agents, so it leaves the controller once.

At 128 nodes a 100 MB argument sent to every node by the controller is 12.8 GB through the
controller's one link. Instead the controller sends it to the first node with a ROUTE (the tree
below it), and each agent streams the frame on, as it arrives, to its ranks and to its children
in the tree over a TCP connection of their own (cut-through: no agent holds the frame whole).

A peer link is code execution for whoever may write to it (the frames reach the ranks, which
unpickle them), and it carries the pool's arguments, so both ends prove themselves and every
byte is private and checked:
- the listener binds to the node's own address as its peers see it, never to every interface;
- every link is TLS 1.3 with both ends authenticated: each agent presents the pool's certificate
  and trusts that one alone (`check_hostname` off: peers are addressed by IP, the certificate is
  pinned instead). The certificate and its key are made per pool by the controller
  (controller/peer_tls.py) and handed to each agent in its PEERS message over the controller's
  own channel (pipes, SSH with pinned host keys, srun, the Kubernetes API's exec), never put in a
  file that outlives loading it, a command line, the environment or a log. A stranger cannot
  connect, cannot listen in a member's place (a member sends nothing to a listener that does not
  prove the pool's key), and cannot read or alter a frame: a changed byte fails TLS's record
  check, the link breaks, and the node reports its call lost with that reason;
- inside the link, the listener still challenges the peer: a random nonce, answered with
  HMAC-SHA256(pool secret, nonce), compared in constant time. With SKYTASKS_PEER_TLS=0 (for
  measuring what TLS costs, nothing else) that challenge alone admits a peer, in the clear.

TLS costs what AES-GCM costs and little more: the receiving end reads TLS through memory
(`TLSReader`: many records per system call, each decrypted straight into the frame's buffer), the
sending end hands each 1 MB chunk to one SSL_write (`LinkWriter`), and a node opens the links to
its children side by side, so a first relayed call waits for one handshake per level of the tree.

Standard library only, like the rest of the node side (`ssl` and `hashlib` are imported at a
peer's first connection: OpenSSL is milliseconds of every agent's start otherwise).
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Protocol, Sequence

from skytasks.protocol import Op, message
from skytasks.node.relay import relay_frame
from skytasks.wire import RELAY, ChannelClosed, FrameWriter, Readable, read_body, read_exact, read_header

NONCE_BYTES = 16
DIGEST_BYTES = 32
HANDSHAKE_SECONDS = 10.0
SPAWN_WAIT_SECONDS = 60.0  # a CALL that came down the tree waits this long for its group's SPAWN
STREAM_BUFFER = 1 << 20


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
        self._raw = memoryview(bytearray(STREAM_BUFFER))
        self._ended = False

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
                if not self.fill():
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
        self._lock = threading.Lock()

    def writer(self, address: str, port: int) -> FrameWriter:
        key = (address, port)
        with self._lock:
            kept = self._writers.get(key)
        if kept is not None:
            return kept
        made = connect(address, port, self._secret, tls=self._tls)  # not under the lock: see open_all
        with self._lock:
            kept = self._writers.setdefault(key, made)
        if kept is not made:
            made.close()
        return kept

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


def relay_tree(peers: list[tuple[str, int]], fan_out: int = 2) -> list[dict[str, Any]]:
    """The relay tree below the first of `peers` ((address, port) pairs, in node order), as the
    ROUTE's children: each node sends to `fan_out` others (heap order), so 128 nodes are 7 hops."""

    def below(j: int) -> list[dict[str, Any]]:
        return [{"address": peers[c][0], "port": peers[c][1], "children": below(c)}
                for c in range(fan_out * j + 1, min(fan_out * j + 1 + fan_out, len(peers)))]

    return below(0)


class LocalRank(Protocol):
    """A rank of this node as the relay sees it (a `RankProcess`)."""

    to_rank: FrameWriter  # its pipe: the frames it reads between calls

    def hand_fd(self, token: int, fd: int) -> bool:
        """Give the rank `fd`, named `token`, beside its pipe; False if it could not be given."""
        ...


_tokens = itertools.count(1)


def hand_over_to(ranks: Sequence[LocalRank]) -> Callable[[int], int | None]:
    """`relay_frame`'s hand_over for these ranks: the memory file to each of them, one token for
    all; None (the bytes go inline) if a rank that is still there could not take it."""

    def hand_over(fd: int) -> int | None:
        token = next(_tokens)
        return token if all(rank.hand_fd(token, fd) for rank in ranks) else None  # past a refusal: inline, no more fds

    return hand_over


def why_broken(exc: BaseException) -> str:
    """A peer link that broke in the middle of a frame, in words."""
    import ssl

    if isinstance(exc, ssl.SSLError):
        return (f"a frame from its parent in the relay tree failed TLS's integrity check, so the link was cut "
                f"(the bytes were altered on the way, or the link is faulty): {exc}")
    return f"the link from its parent in the relay tree broke in the middle of a frame: {exc}"


def _say(reason: str) -> None:
    print(f"skytasks agent: {reason}", file=sys.stderr, flush=True)


class RelayNode:
    """An agent's part in the relay tree: its listener for its parent, its connections to its
    children, and the streaming of a CALL frame to its ranks and on down the tree.
    `broken(reason)` hears a peer link that broke in the middle of a frame: this node's ranks then
    hold part of a call, so the agent fails them and says why (AGENT_ERROR: a lost node)."""

    def __init__(self, ranks_of: Callable[[int | None, float], Sequence[LocalRank]],
                 broken: Callable[[str], None] = _say):
        self._ranks_of = ranks_of  # (group, wait) -> that group's ranks here
        self._broken = broken
        self._listener: PeerListener | None = None
        self._links: PeerLinks | None = None

    def open(self, secret: bytes, address: str, tls: PeerTLS | None = None) -> int:
        """Listen for this node's parent (once); the port."""
        if self._listener is None:
            self._links = PeerLinks(secret, tls)
            self._listener = PeerListener(address, secret, self.serve_peer, tls)
        return self._listener.port

    def serve_peer(self, stream: Readable) -> None:
        """Frames from the parent: a ROUTE, then the CALL frame it announces. The parent closing
        the link between frames is no news (the controller hears of a lost node on its own); the
        link breaking inside a frame, or a frame that is not a ROUTE or a CALL, is."""
        route: dict[str, Any] | None = None
        while True:
            try:
                header = read_header(stream)
            except ChannelClosed:
                return
            except Exception as exc:  # noqa: BLE001 - ssl.SSLError and the like: the link is not to be trusted
                self._broken(why_broken(exc))
                return
            try:
                if header[2] & RELAY:
                    self.relay_call(stream, header, route)
                    route = None
                    continue
                msg = read_body(stream, *header)
                if msg.get("op") != Op.ROUTE:
                    raise ValueError(f"a peer may send ROUTE and CALL frames only, not {msg.get('op')!r}")
                route = msg
            except Exception as exc:  # noqa: BLE001 - whatever it was, the link is done
                self._broken(why_broken(exc))
                return

    def relay_call(self, stream: Readable, header: tuple[int, int, int], route: dict[str, Any] | None) -> None:
        """Stream one CALL frame, as it arrives, to this node's ranks and (with a ROUTE) to its
        children, each told its own part of the tree first. A child whose frame could not be
        finished is let go: its link is closed, so it hears its frame broke off."""
        if route is None:  # straight from the controller, as every call on a small pool
            self._to_ranks(stream, header, self._ranks_of(None, 0.0))
            return
        onward: list[FrameWriter] = []
        children: list[tuple[str, int]] = []
        assert self._links is not None, "a ROUTE before PEERS"
        failed = self._links.open_all([(child["address"], child["port"]) for child in route["children"]])
        for child in route["children"]:
            announce = message(Op.ROUTE, group=route["group"], children=child["children"])
            for last_try in (False, True):  # a kept link the child has since cut (a broken frame): once more, anew
                try:
                    if not last_try and (child["address"], child["port"]) in failed:
                        raise failed[(child["address"], child["port"])]  # that was its first try
                    writer = self._links.writer(child["address"], child["port"])
                    writer.send(announce)
                    onward.append(writer)
                    children.append((child["address"], child["port"]))
                    break
                except ChannelClosed as exc:  # the controller hears of that node's loss on its own
                    self._links.forget(child["address"], child["port"])
                    if last_try:
                        _say(f"relay to {child['address']}: {exc}")
        try:
            self._to_ranks(stream, header, self._ranks_of(route["group"], SPAWN_WAIT_SECONDS), onward)
        except BaseException:
            for address, port in children:
                self._links.forget(address, port)
            raise

    @staticmethod
    def _to_ranks(stream: Readable, header: tuple[int, int, int], ranks: Sequence[LocalRank],
                  onward: list[FrameWriter] | None = None) -> None:
        relay_frame(stream, header, [r.to_rank for r in ranks], onward=onward or (), hand_over=hand_over_to(ranks))
