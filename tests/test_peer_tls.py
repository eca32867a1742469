"""Node-to-node links are TLS with both ends authenticated by the pool (issue #47): a stranger
cannot connect, cannot listen in a member's place, and cannot read or alter a frame. Real sockets
on loopback; the pool's key as the controller makes it (controller/peer_tls.py)."""

from __future__ import annotations

import hashlib
import logging
import io
import os
import socket
import ssl
import threading
import time

import numpy as np
import pytest

from skytasks import DistributedTaskError, GPUPool, distributed_task, rank_info
from skytasks.controller.peer_tls import pool_tls
from skytasks.node.peer_links import DIGEST_BYTES, PeerListener, connect
from skytasks.node.peers import RelayNode, relay_tree
from skytasks.node.tls_link import PeerTLS
from skytasks.protocol import Op, message
from skytasks.wire import RELAY, ChannelClosed, FrameWriter, encode, read_frame, read_header

SECRET = b"s" * 32


def tls_of(pool=None) -> PeerTLS:
    pool = pool or pool_tls()
    return PeerTLS(pool.cert, pool.key)


def a_call(big: bytes) -> dict:
    """A CALL as the controller makes one, `big` in it (out of band): what a peer may relay."""
    return message(Op.CALL, call=1, head=b"head", refs=["1.1"], blobs={"1.1": big}, attempt=1)


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def pool_key():
    return pool_tls()


@pytest.fixture
def listener(pool_key):
    heard: list[dict] = []
    lst = PeerListener("127.0.0.1", SECRET, lambda stream: heard.append(read_frame(stream)), tls_of(pool_key))
    lst.heard = heard
    yield lst
    lst.close()


def test_a_member_connects_and_its_frame_arrives(listener, pool_key):
    writer = connect("127.0.0.1", listener.port, SECRET, tls=tls_of(pool_key))
    writer.send(message(Op.HEARTBEAT) | {"payload": b"hello"})
    writer.close()
    assert wait_for(lambda: listener.heard)
    assert listener.heard == [{"op": "heartbeat", "payload": b"hello"}] and listener.refused == 0


def _client_context(own=None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # a stranger trusts anyone
    if own is not None:
        ctx.load_cert_chain(*own)
    return ctx


def _stranger_says_something(port: int, ctx: ssl.SSLContext | None) -> bytes:
    """What a stranger gets back after trying to speak to the listener: b"" when it was shut out."""
    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        if ctx is None:  # plain TCP: the old challenge's answer, a guess
            raw.sendall(b"\0" * DIGEST_BYTES)
            return raw.recv(100)
        try:
            conn = ctx.wrap_socket(raw)
            conn.sendall(b"\0" * DIGEST_BYTES + b"\x01" * 64)
            return conn.recv(100)
        except (ssl.SSLError, ConnectionError):
            return b""
    except ConnectionError:
        return b""
    finally:
        raw.close()


def test_a_stranger_is_refused_with_no_certificate_or_another_pools(listener, tmp_path):
    other = pool_tls()  # a key of the right shape, made the same way, but not this pool's
    (tmp_path / "cert.pem").write_text(other.cert)
    (tmp_path / "key.pem").write_text(other.key)
    tries = [None, _client_context(), _client_context((tmp_path / "cert.pem", tmp_path / "key.pem"))]
    for ctx in tries:
        assert _stranger_says_something(listener.port, ctx) == b""  # no nonce, nothing at all
    assert wait_for(lambda: listener.refused == len(tries)), listener.refused
    assert listener.heard == []


class Impostor:
    """A listener in a member's place: TLS with a key that is not the pool's (or plain TCP that
    plays the challenge), admitting anyone and recording what it is sent."""

    def __init__(self, tmp_path, tls: bool):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.got = bytearray()
        self.ctx = None
        if tls:
            other = pool_tls()
            (tmp_path / "imp.pem").write_text(other.cert + other.key)
            self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            self.ctx.load_cert_chain(tmp_path / "imp.pem")
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        conn.settimeout(10)
        try:
            if self.ctx is not None:
                conn = self.ctx.wrap_socket(conn, server_side=True)
            conn.sendall(os.urandom(16))  # the nonce of the challenge
            while chunk := conn.recv(1 << 16):
                self.got += chunk
                conn.sendall(b"\x01")  # "admitted"
        except (OSError, ssl.SSLError):
            pass
        finally:
            conn.close()


@pytest.mark.parametrize("tls", [True, False], ids=["another key", "plain TCP"])
def test_a_node_sends_nothing_to_a_listener_without_the_pools_key(tmp_path, pool_key, tls):
    impostor = Impostor(tmp_path, tls)
    with pytest.raises(ChannelClosed, match="did not prove the pool's key|refused the connection"):
        connect("127.0.0.1", impostor.port, SECRET, timeout=5, tls=tls_of(pool_key))
    time.sleep(0.2)
    if tls:
        assert bytes(impostor.got) == b""  # not the challenge's answer, not a frame
    else:  # all it heard is a TLS hello, and the alert that ended it
        assert _record_types(bytes(impostor.got)) <= {0x15, 0x16}, impostor.got[:64]


def _record_types(data: bytes) -> set[int]:
    """The TLS record types in `data` (22: handshake, 21: alert), which must be whole records."""
    types, pos = set(), 0
    while pos < len(data):
        assert pos + 5 <= len(data)
        types.add(data[pos])
        pos += 5 + int.from_bytes(data[pos + 3:pos + 5], "big")
    assert pos == len(data)
    return types


class ManInTheMiddle:
    """Forwards every connection to `target` and records what a member sends; with `flip_at`, the
    first connection's byte at that offset (member to listener) is flipped on the way."""

    def __init__(self, target: tuple[str, int], flip_at: int | None = None):
        self.target, self.flip_at = target, flip_at
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sent = bytearray()  # member -> listener, as it crossed the wire
        self.flipped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        try:
            while chunk := src.recv(1 << 16):
                if forward:
                    start = len(self.sent)
                    self.sent += chunk
                    if self.flip_at is not None and not self.flipped and start <= self.flip_at < len(self.sent):
                        chunk = bytearray(chunk)
                        chunk[self.flip_at - start] ^= 0x01
                        self.flipped = True
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


MARKER = b"the-plaintext-argument-nobody-else-may-read:"


def test_the_bytes_on_the_wire_are_not_the_frame(listener, pool_key):
    mitm = ManInTheMiddle(("127.0.0.1", listener.port))
    try:
        writer = connect("127.0.0.1", mitm.port, SECRET, tls=tls_of(pool_key))
        small, big = MARKER * 10, MARKER * (200_000 // len(MARKER))  # in the pickle, and out of band
        writer.send(message(Op.HEARTBEAT) | {"small": small, "big": big})
        writer.close()
        assert wait_for(lambda: listener.heard)
        assert listener.heard[0]["small"] == small and bytes(listener.heard[0]["big"]) == big
        assert len(mitm.sent) > len(big)
        assert MARKER[:16] not in mitm.sent and b"heartbeat" not in mitm.sent
    finally:
        mitm.close()


def test_the_same_recorder_sees_the_frame_when_tls_is_off():
    """What the test above proves rests on the recorder seeing plaintext where there is some."""
    heard: list[dict] = []
    lst = PeerListener("127.0.0.1", SECRET, lambda stream: heard.append(read_frame(stream)), None)
    mitm = ManInTheMiddle(("127.0.0.1", lst.port))
    try:
        writer = connect("127.0.0.1", mitm.port, SECRET)
        writer.send(message(Op.HEARTBEAT) | {"small": MARKER})
        writer.close()
        assert wait_for(lambda: heard)
        assert MARKER in mitm.sent
    finally:
        mitm.close()
        lst.close()


def test_a_flipped_byte_breaks_the_link_and_says_why(pool_key):
    broken: list[str] = []
    relay = RelayNode(lambda group, wait: [], broken=broken.append)
    port = relay.open(SECRET, "127.0.0.1", tls_of(pool_key))
    mitm = ManInTheMiddle(("127.0.0.1", port), flip_at=60_000)  # past the handshake, inside the frame
    try:
        writer = connect("127.0.0.1", mitm.port, SECRET, tls=tls_of(pool_key))
        try:
            writer.send(message(Op.ROUTE, group=1, children=[]))
            writer.send(a_call(os.urandom(1 << 20)), flags=RELAY)
        except ChannelClosed:
            pass  # the listener may have cut the link before the last byte
        assert wait_for(lambda: broken)
        assert mitm.flipped
        assert "integrity" in broken[0] and "altered" in broken[0], broken
    finally:
        mitm.close()


def digest(a: np.ndarray) -> tuple[int, str]:
    return rank_info().rank, hashlib.sha256(a.tobytes()).hexdigest()


def _through(pool, mitm_for) -> ManInTheMiddle:
    """Node 0's link to node 1 in the relay tree goes through a man in the middle from now on."""
    node = pool.runtime().session.nodes[1]
    mitm = mitm_for((node.link.address, node.peer_port))
    node.peer_port = mitm.port
    return mitm


def test_a_relayed_argument_crosses_between_nodes_encrypted():
    arg = np.frombuffer(MARKER * ((4 << 20) // len(MARKER)), dtype=np.uint8)
    with GPUPool(nodes=3) as pool:
        task = distributed_task(digest, pool=pool, init_torch=False)
        task(np.zeros(1, dtype=np.uint8))
        mitm = _through(pool, ManInTheMiddle)
        try:
            out = task(arg)
        finally:
            mitm.close()
    assert out == [(r, hashlib.sha256(arg.tobytes()).hexdigest()) for r in range(3)]
    assert len(mitm.sent) > arg.nbytes  # the argument went node 0 -> node 1 through it
    assert MARKER[:16] not in mitm.sent


def test_a_flipped_byte_between_nodes_fails_the_call_as_a_lost_node_saying_so():
    arg = np.random.default_rng(0).integers(0, 255, size=4 << 20, dtype=np.uint8)
    with GPUPool(nodes=3) as pool:
        task = distributed_task(digest, pool=pool, init_torch=False, node_recoveries=0)
        task(np.zeros(1, dtype=np.uint8))
        mitm = _through(pool, lambda target: ManInTheMiddle(target, flip_at=1 << 20))
        try:
            started = time.monotonic()
            with pytest.raises(DistributedTaskError) as failed:
                task(arg)
            assert time.monotonic() - started < 30
        finally:
            mitm.close()
        assert mitm.flipped
        text = " ".join(str(e) for e in failed.value.exceptions)
        assert "lost the agent of node 1" in text or "the agent of node 1 failed" in text, text
        assert "integrity" in text, text
        # the pool goes on: the next call is whole again
        node = pool.runtime().session.nodes[1]
        node.peer_port = mitm.target[1]
        again = distributed_task(digest, pool=pool, init_torch=False)(arg)
    assert [d for _, d in again] == [hashlib.sha256(arg.tobytes()).hexdigest()] * 3


def test_frames_of_many_sizes_arrive_whole_through_tls(pool_key):
    """The listener reads TLS through memory, many records a read: frames of small and large
    buffers, one after another, arrive byte for byte (and the link's end is no frame)."""
    heard: list[dict] = []

    def serve(stream) -> None:
        while True:
            try:
                heard.append(read_frame(stream))
            except ChannelClosed:
                return

    lst = PeerListener("127.0.0.1", SECRET, serve, tls_of(pool_key))
    try:
        frames = [message(Op.HEARTBEAT) | {"big": os.urandom((3 << 20) + 17), "small": os.urandom(70_000),
                                           "tiny": b"x", "n": i} for i in range(3)]
        frames.insert(1, message(Op.HEARTBEAT))
        writer = connect("127.0.0.1", lst.port, SECRET, tls=tls_of(pool_key))
        for frame in frames:
            writer.send(frame)
        writer.close()
        assert wait_for(lambda: len(heard) == len(frames))
        assert [{k: bytes(v) if isinstance(v, (bytearray, memoryview)) else v for k, v in h.items()}
                for h in heard] == frames
    finally:
        lst.close()


def test_a_peer_that_trickles_its_handshake_is_cut_off_at_the_deadline(pool_key, monkeypatch):
    """A byte at a time, each well within a read's timeout, still ends at the handshake's deadline
    (the listener does its TLS through memory: the deadline is its own, as an SSLSocket's was)."""
    import skytasks.node.peer_links as peer_links

    monkeypatch.setattr(peer_links, "ADMIT_SECONDS", 0.5)
    lst = PeerListener("127.0.0.1", SECRET, lambda stream: None, tls_of(pool_key))
    raw = socket.create_connection(("127.0.0.1", lst.port), timeout=10)
    try:
        started = time.monotonic()
        hello = b"\x16\x03\x01\x02\x00" + b"\x01" * 0x200  # a ClientHello's record header, then its "body"
        for byte in hello:
            try:
                raw.sendall(bytes([byte]))
            except OSError:
                break  # cut off
            if lst.refused:
                break
            time.sleep(0.05)
        assert lst.refused == 1
        assert time.monotonic() - started < 5
    finally:
        raw.close()
        lst.close()


class _Held(PeerListener):
    """A listener that holds each connection until `barrier` passes: only links opened side by
    side get past it."""

    def __init__(self, barrier: threading.Barrier, tls: PeerTLS):
        self.barrier = barrier
        super().__init__("127.0.0.1", SECRET, lambda stream: None, tls)

    def _admit(self, conn) -> None:
        try:
            self.barrier.wait(timeout=10)
        except threading.BrokenBarrierError:
            conn.close()
            return
        super()._admit(conn)


def test_a_node_opens_its_childrens_links_side_by_side(pool_key):
    from skytasks.node.peer_links import PeerLinks

    barrier = threading.Barrier(2)
    children = [_Held(barrier, tls_of(pool_key)) for _ in range(2)]
    links = PeerLinks(SECRET, tls_of(pool_key))
    try:
        assert links.open_all([("127.0.0.1", c.port) for c in children]) == {}
        assert [c.refused for c in children] == [0, 0]
    finally:
        for c in children:
            c.close()


def test_a_child_that_cannot_be_reached_is_tried_twice_and_its_sibling_gets_the_frame(pool_key, monkeypatch):
    import skytasks.node.peer_links as peer_links

    heard: list[dict] = []

    def serve(stream) -> None:
        heard.append(read_frame(stream))  # the ROUTE
        heard.append(read_frame(stream))  # the CALL frame, still marked RELAY: read as a plain frame here

    live = PeerListener("127.0.0.1", SECRET, serve, tls_of(pool_key))
    dead = socket.create_server(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there
    tries: list[int] = []

    def counted(address, port, *args, **kwargs):
        tries.append(port)
        return connect(address, port, *args, **kwargs)

    monkeypatch.setattr(peer_links, "connect", counted)
    relay = RelayNode(lambda group, wait: [])
    relay.open(SECRET, "127.0.0.1", tls_of(pool_key))
    frame = b"".join(bytes(c) for c in encode(message(Op.HEARTBEAT) | {"big": os.urandom(2 << 20)}, flags=RELAY))
    stream = io.BytesIO(frame)
    route = {"group": 1, "children": [{"address": "127.0.0.1", "port": dead_port, "children": []},
                                      {"address": "127.0.0.1", "port": live.port, "children": []}]}
    try:
        relay.relay_call(stream, read_header(stream), route)
        assert wait_for(lambda: len(heard) == 2)
        assert heard[0]["op"] == Op.ROUTE and heard[0]["children"] == []
        assert bytes(heard[1]["big"]) == bytes(frame[-(2 << 20):])
        assert tries.count(dead_port) == 2 and tries.count(live.port) == 1
    finally:
        live.close()


class _Rank:
    """A rank as the relay sees it: its pipe is one end of a socket pair, read by the test."""

    def __init__(self):
        self.ours, theirs = socket.socketpair()
        self.to_rank = FrameWriter(self.ours.makefile("wb"))
        self.reader = theirs.makefile("rb")

    def hand_fd(self, token: int, fd: int) -> bool:
        return False  # the bytes go inline


def test_links_open_down_the_whole_tree_before_the_first_call_and_the_call_opens_none(pool_key, monkeypatch):
    """LINKS to the first node opens every link of the tree (the first node's to its children,
    each child's to its own), so the first large call makes no connection of its own."""
    import skytasks.node.peer_links as peer_links

    opened: list[int] = []

    def counted(address, port, *args, **kwargs):
        opened.append(port)
        return connect(address, port, *args, **kwargs)

    monkeypatch.setattr(peer_links, "connect", counted)
    ranks = [_Rank() for _ in range(4)]
    nodes = [RelayNode(lambda group, wait, r=r: [r]) for r in ranks]
    ports = [node.open(SECRET, "127.0.0.1", tls_of(pool_key)) for node in nodes]
    tree = relay_tree([("127.0.0.1", port) for port in ports])  # 0 -> 1, 2; 1 -> 3
    nodes[0].open_links(tree)
    assert wait_for(lambda: sorted(opened) == sorted(ports[1:]))
    time.sleep(0.2)
    assert sorted(opened) == sorted(ports[1:])  # each link once, not again
    payload = os.urandom(64 << 10)
    frame = b"".join(bytes(c) for c in encode(a_call(payload), flags=RELAY))
    stream = io.BytesIO(frame)
    nodes[0].relay_call(stream, read_header(stream), {"group": 1, "children": tree})
    for rank in ranks:  # every node's rank got the frame, down links opened before it
        assert bytes(read_frame(rank.reader)["blobs"]["1.1"]) == payload
    assert sorted(opened) == sorted(ports[1:])


@pytest.mark.parametrize("children, says", [
    ("127.0.0.1", "children"),  # not a tree at all
    ([{"address": "127.0.0.1", "port": "80", "children": []}], "port"),
    ([{"address": "127.0.0.1", "port": 1, "children": [{"address": "127.0.0.1", "port": 2}]}], "address, port and children"),
    ([{"address": "127.0.0.1", "port": 70000, "children": []}], "1-65535"),
], ids=["not-a-list", "port-as-text", "a-grandchild-without-children", "port-out-of-range"])
def test_a_peer_that_sends_a_malformed_tree_is_cut_off_saying_what_was_wrong(pool_key, children, says):
    said: list[str] = []
    broken: list[str] = []
    relay = RelayNode(lambda group, wait: [], broken=broken.append, refused=said.append)
    port = relay.open(SECRET, "127.0.0.1", tls_of(pool_key))
    w = connect("127.0.0.1", port, SECRET, tls=tls_of(pool_key))
    w.send(message(Op.LINKS, children=[]))  # nothing to open: fine
    w.send({"op": Op.LINKS, "children": children})
    assert wait_for(lambda: said)
    assert says in said[0], said
    assert broken == []  # refused before anything reached the ranks: they run on
    w.close()


def test_a_tree_whose_branches_share_a_node_is_refused_at_once():
    """A pickle may make every branch of a tree the same object: 60 levels of two branches each
    are 2**60 paths, which a walk of the branches would never finish. Each node is seen once."""
    from skytasks.node.peers import check_tree

    shared: list = []
    for level in range(60):
        node = {"address": "127.0.0.1", "port": level + 1, "children": shared}
        shared = [node, node]
    cycle: dict = {"address": "127.0.0.1", "port": 9, "children": []}
    cycle["children"].append(cycle)
    twice = [{"address": "10.0.0.1", "port": 5, "children": []}, {"address": "10.0.0.1", "port": 5, "children": []}]
    for tree in (shared, [cycle], twice):
        started = time.monotonic()
        with pytest.raises(ValueError, match="twice"):
            check_tree(tree)
        assert time.monotonic() - started < 0.5
    check_tree(relay_tree([("127.0.0.1", port) for port in range(1, 200)]))  # a real tree of 199 nodes passes


def test_two_threads_that_need_one_link_make_one_and_a_failure_reaches_both(pool_key, monkeypatch):
    import skytasks.node.peer_links as peer_links
    from skytasks.node.peer_links import PeerLinks

    opened: list[int] = []
    refuse = threading.Event()

    def slow(address, port, *args, **kwargs):
        opened.append(port)
        time.sleep(0.3)  # both threads are asking by now
        if refuse.is_set():
            raise ChannelClosed("refused for the test")
        return connect(address, port, *args, **kwargs)

    monkeypatch.setattr(peer_links, "connect", slow)
    lst = PeerListener("127.0.0.1", SECRET, lambda stream: None, tls_of(pool_key))
    links = PeerLinks(SECRET, tls_of(pool_key))

    def both() -> list:
        got: list = []

        def ask() -> None:
            try:
                got.append(links.writer("127.0.0.1", lst.port))
            except ChannelClosed as exc:
                got.append(exc)

        threads = [threading.Thread(target=ask) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    try:
        got = both()
        assert len(opened) == 1 and got[0] is got[1]  # one connection, kept, for both
        other = FrameWriter(io.BytesIO())
        links.forget("127.0.0.1", lst.port, other)  # another link's forgetting leaves this one kept
        assert links.writer("127.0.0.1", lst.port) is got[0] and len(opened) == 1
        links.forget("127.0.0.1", lst.port, got[0])
        refuse.set()
        got = both()
        assert len(opened) == 2 and all(isinstance(g, ChannelClosed) for g in got)  # one try, heard by both
        refuse.clear()
        assert links.writer("127.0.0.1", lst.port) and len(opened) == 3  # asked again: opened anew
    finally:
        lst.close()


class _Heard(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.said.append(record.getMessage())


def _keys_of_a_start(pool) -> tuple[str, str]:
    with pool:
        distributed_task(lambda: 1, pool=pool, init_torch=False)()
        keys = pool.runtime().session.relay.peers_message("127.0.0.1")
        return keys["secret"], keys["cert"]


def test_every_pool_start_makes_a_fresh_key_and_warns_when_tls_is_off(monkeypatch):
    heard = _Heard()
    logging.getLogger("skytasks").addHandler(heard)
    try:
        pool = GPUPool(nodes=1)
        first, again, other = _keys_of_a_start(pool), _keys_of_a_start(pool), _keys_of_a_start(GPUPool(nodes=1))
        assert len({first[0], again[0], other[0]}) == 3 and len({first[1], again[1], other[1]}) == 3
        assert not [s for s in heard.said if "SKYTASKS_PEER_TLS" in s]  # TLS on: nothing to say
        monkeypatch.setenv("SKYTASKS_PEER_TLS", "0")
        for _ in range(2):
            secret, cert = _keys_of_a_start(pool)
            assert cert == "" and secret not in (first[0], again[0])
        warned = [s for s in heard.said if "SKYTASKS_PEER_TLS=0" in s]
        assert len(warned) == 2 and "in the clear" in warned[0], heard.said  # at each start, not once
    finally:
        logging.getLogger("skytasks").removeHandler(heard)
