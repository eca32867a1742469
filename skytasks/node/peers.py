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
from typing import Any, Callable, Protocol, Sequence

from skytasks.protocol import Op, message
from skytasks.node.relay import relay_frame
from skytasks.wire import RELAY, ChannelClosed, FrameWriter, Readable, read_body, read_header

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
        (an OSError) if the other end does not prove the pool's key."""
        wrapped: socket.socket = self.context(server_side).wrap_socket(sock, server_side=server_side)
        return wrapped


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
        try:
            conn.settimeout(HANDSHAKE_SECONDS)
            if self._tls is not None:
                conn = self._tls.wrap(conn, server_side=True)  # no pool certificate: refused here
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(nonce)
            answer = _recv_exact(conn, DIGEST_BYTES)
            if not _same(answer, _proof(self._secret, nonce)):
                self.refused += 1
                conn.close()
                return
            conn.sendall(b"\x01")  # admitted
            conn.settimeout(None)
        except (OSError, ChannelClosed):  # ssl.SSLError is an OSError
            self.refused += 1
            conn.close()
            return
        stream: Any = conn.makefile("rb", buffering=STREAM_BUFFER)
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
    stream: Any = sock.makefile("wb", buffering=STREAM_BUFFER)
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
            if key not in self._writers:
                self._writers[key] = connect(address, port, self._secret, tls=self._tls)
            return self._writers[key]

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
        for child in route["children"]:
            assert self._links is not None, "a ROUTE before PEERS"
            announce = message(Op.ROUTE, group=route["group"], children=child["children"])
            for last_try in (False, True):  # a kept link the child has since cut (a broken frame): once more, anew
                try:
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
                self._links.forget(address, port)  # type: ignore[union-attr]  # set with the ROUTE
            raise

    @staticmethod
    def _to_ranks(stream: Readable, header: tuple[int, int, int], ranks: Sequence[LocalRank],
                  onward: list[FrameWriter] | None = None) -> None:
        relay_frame(stream, header, [r.to_rank for r in ranks], onward=onward or (), hand_over=hand_over_to(ranks))
