"""Node to node: a large call relayed down a tree of agents, so it leaves the controller once.

At 128 nodes a 100 MB argument sent to every node by the controller is 12.8 GB through the
controller's one link. Instead the controller sends it to the first node with a ROUTE (the tree
below it), and each agent streams the frame on, as it arrives, to its ranks and to its children
in the tree over a TCP connection of their own (cut-through: no agent holds the frame whole).

A peer listener is code execution for whoever may write to it (the frames reach the ranks, which
unpickle them), so it is held shut to everyone but the pool's members:
- it binds to the node's own address as its peers see it, never to every interface;
- a connection is accepted only after a challenge: the listener sends a random nonce, the peer
  answers HMAC-SHA256(pool secret, nonce), compared in constant time. The secret is made per pool
  by the controller and handed to each agent over the controller's own channel (pipes, or SSH
  with pinned host keys), never logged. A stranger's connection is closed unread.

Standard library only, like the rest of the node side.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
from typing import Any, Callable, Protocol, Sequence

from skytasks.protocol import Op, message
from skytasks.node.relay import relay_frame
from skytasks.wire import RELAY, ChannelClosed, FrameWriter, Readable, read_body, read_header

NONCE_BYTES = 16
DIGEST_BYTES = 32
HANDSHAKE_SECONDS = 10.0
SPAWN_WAIT_SECONDS = 60.0  # a CALL that came down the tree waits this long for its group's SPAWN


def _proof(secret: bytes, nonce: bytes) -> bytes:
    # Imported here, at a peer's first connection (a large call on 3 nodes or more): OpenSSL's
    # hashlib is 5-15 ms of CPU in every agent's start otherwise, 128 times over at 128 nodes.
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
    which hands the connection's frames to `serve(stream)`."""

    def __init__(self, address: str, secret: bytes, serve: Callable[[Readable], None]):
        self._secret, self._serve = secret, serve
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((address, 0))  # this interface only, never 0.0.0.0
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self.refused = 0  # connections that failed the challenge
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
            nonce = os.urandom(NONCE_BYTES)
            conn.sendall(nonce)
            answer = _recv_exact(conn, DIGEST_BYTES)
            if not _same(answer, _proof(self._secret, nonce)):
                self.refused += 1
                conn.close()
                return
            conn.sendall(b"\x01")  # admitted
            conn.settimeout(None)
        except (OSError, ChannelClosed):
            self.refused += 1
            conn.close()
            return
        stream: Any = conn.makefile("rb", buffering=1 << 20)
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


def connect(address: str, port: int, secret: bytes, timeout: float = HANDSHAKE_SECONDS) -> FrameWriter:
    """A proven connection to a peer's listener, as a frame writer; ChannelClosed if refused."""
    try:
        sock = socket.create_connection((address, port), timeout=timeout)
    except OSError as exc:
        raise ChannelClosed(f"cannot reach the peer at {address}:{port}: {exc}") from exc
    try:
        nonce = _recv_exact(sock, NONCE_BYTES)
        sock.sendall(_proof(secret, nonce))
        if _recv_exact(sock, 1) != b"\x01":
            raise ChannelClosed(f"the peer at {address}:{port} refused the pool's secret")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, ChannelClosed) as exc:
        sock.close()
        raise ChannelClosed(f"the peer at {address}:{port} refused the connection: {exc}") from exc
    stream: Any = sock.makefile("wb", buffering=1 << 20)
    return FrameWriter(stream)


class PeerLinks:
    """The agent's connections to its children in the relay tree, kept across calls."""

    def __init__(self, secret: bytes):
        self._secret = secret
        self._writers: dict[tuple[str, int], FrameWriter] = {}
        self._lock = threading.Lock()

    def writer(self, address: str, port: int) -> FrameWriter:
        key = (address, port)
        with self._lock:
            if key not in self._writers:
                self._writers[key] = connect(address, port, self._secret)
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


class RelayNode:
    """An agent's part in the relay tree: its listener for its parent, its connections to its
    children, and the streaming of a CALL frame to its ranks and on down the tree."""

    def __init__(self, ranks_of: Callable[[int | None, float], Sequence[LocalRank]]):
        self._ranks_of = ranks_of  # (group, wait) -> that group's ranks here
        self._listener: PeerListener | None = None
        self._links: PeerLinks | None = None

    def open(self, secret: bytes, address: str) -> int:
        """Listen for this node's parent (once); the port."""
        if self._listener is None:
            self._links = PeerLinks(secret)
            self._listener = PeerListener(address, secret, self.serve_peer)
        return self._listener.port

    def serve_peer(self, stream: Readable) -> None:
        """Frames from the parent: a ROUTE, then the CALL frame it announces."""
        route: dict[str, Any] | None = None
        try:
            while True:
                header = read_header(stream)
                if header[2] & RELAY:
                    self.relay_call(stream, header, route)
                    route = None
                elif (msg := read_body(stream, *header))["op"] == Op.ROUTE:
                    route = msg
        except ChannelClosed:
            pass

    def relay_call(self, stream: Readable, header: tuple[int, int, int], route: dict[str, Any] | None) -> None:
        """Stream one CALL frame, as it arrives, to this node's ranks and (with a ROUTE) to its
        children, each told its own part of the tree first."""
        if route is None:  # straight from the controller, as every call on a small pool
            self._to_ranks(stream, header, self._ranks_of(None, 0.0))
            return
        onward = []
        for child in route["children"]:
            assert self._links is not None, "a ROUTE before PEERS"
            try:
                writer = self._links.writer(child["address"], child["port"])
                writer.send(message(Op.ROUTE, group=route["group"], children=child["children"]))
                onward.append(writer)
            except ChannelClosed as exc:  # the controller hears of that node's loss on its own
                self._links.forget(child["address"], child["port"])
                print(f"skytasks agent: relay to {child['address']}: {exc}", file=sys.stderr, flush=True)
        self._to_ranks(stream, header, self._ranks_of(route["group"], SPAWN_WAIT_SECONDS), onward)

    @staticmethod
    def _to_ranks(stream: Readable, header: tuple[int, int, int], ranks: Sequence[LocalRank],
                  onward: list[FrameWriter] | None = None) -> None:
        relay_frame(stream, header, [r.to_rank for r in ranks], onward=onward or (), hand_over=hand_over_to(ranks))
