"""A large argument leaves the controller once, down a relay tree of agents; the relay listeners
admit only the pool's members (a per-pool secret over the controller's channel), on the nodes'
own address only."""

from __future__ import annotations

import hashlib
import socket

import numpy as np
import psutil
import pytest

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.controller.channel import bytes_sent
from skytasks.node.peers import DIGEST_BYTES, NONCE_BYTES, PeerListener, connect, relay_tree
from skytasks.protocol import Op, message
from skytasks.wire import ChannelClosed, read_frame


def digest(a: np.ndarray) -> tuple[int, str]:
    return rank_info().rank, hashlib.sha256(a.tobytes()).hexdigest()


def test_the_relay_tree_reaches_every_node_once_in_few_hops():
    def walk(tree, depth=1):
        for node in tree:
            yield node["port"], depth
            yield from walk(node["children"], depth + 1)

    for n in (3, 7, 128):
        reached = list(walk(relay_tree([("10.0.0.1", port) for port in range(n)])))
        assert sorted(p for p, _ in reached) == list(range(1, n))  # every node but the first, once
        assert max(d for _, d in reached) <= (n - 1).bit_length()  # 128 nodes: 7 hops
    assert relay_tree([("a", 1)]) == []


def test_a_large_argument_leaves_the_controller_once_and_reaches_every_rank():
    arg = np.random.default_rng(0).integers(0, 255, size=8 << 20, dtype=np.uint8)  # 8 MB
    want = hashlib.sha256(arg.tobytes()).hexdigest()
    with GPUPool(nodes=4) as pool:
        task = distributed_task(digest, pool=pool, init_torch=False)
        task(np.zeros(1, dtype=np.uint8))  # the group is up, every agent's relay listener too
        before = bytes_sent()
        out = task(arg)
        sent = bytes_sent() - before
        again = task(arg + 1)  # a new payload down the same, kept, peer connections
    assert out == [(r, want) for r in range(4)]
    assert [d for _, d in again] == [hashlib.sha256((arg + 1).tobytes()).hexdigest()] * 4
    assert arg.nbytes <= sent < 1.5 * arg.nbytes, sent  # once, not once per node (4x)


def test_a_stranger_is_refused_and_the_listener_is_on_the_nodes_address_only():
    with GPUPool(nodes=3) as pool:
        distributed_task(lambda: 1, pool=pool, init_torch=False)()
        session = pool.runtime().session
        node = session.nodes[1]
        assert node.peer_port
        listening = [c.laddr for c in psutil.Process(node.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert listening == [(node.link.address, node.peer_port)]  # 127.0.0.1 here, never 0.0.0.0
        with socket.create_connection((node.link.address, node.peer_port), timeout=5) as stranger:
            assert len(stranger.recv(NONCE_BYTES)) == NONCE_BYTES
            stranger.sendall(b"\0" * DIGEST_BYTES)  # no secret: a guess
            assert stranger.recv(1) == b""  # closed unread
        assert distributed_task(lambda: rank_info().rank, pool=pool, init_torch=False)() == [0, 1, 2]


def test_only_the_secret_opens_a_listener():
    heard = []
    listener = PeerListener("127.0.0.1", b"s" * 32, lambda stream: heard.append(read_frame(stream)))
    try:
        with pytest.raises(ChannelClosed):
            connect("127.0.0.1", listener.port, b"x" * 32)
        writer = connect("127.0.0.1", listener.port, b"s" * 32)
        writer.send(message(Op.HEARTBEAT))
        writer.close()
        for _ in range(100):
            if heard:
                break
            __import__("time").sleep(0.05)
        assert heard == [{"op": Op.HEARTBEAT}] and listener.refused == 1
    finally:
        listener.close()
