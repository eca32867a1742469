"""A large argument leaves the controller once, down a relay tree of agents, and a node receives
it once, for all its ranks; the relay listeners admit only the pool's members (a per-pool secret
over the controller's channel, and TLS with the pool's own certificate: tests/test_peer_tls.py), on
the nodes' own address only."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import threading
import time

import numpy as np
import psutil
import pytest

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.controller.channel import bytes_sent
from skytasks.node.peer_links import DIGEST_BYTES, NONCE_BYTES, PeerListener, connect
from skytasks.node.peers import relay_tree
from skytasks.protocol import Op, message
from skytasks.node.control_channel import HandedFiles, serve_control_channel
from skytasks.serialization import SharedBuffer, mapped_buffer
from skytasks.node.relay import relay_frame
from skytasks.wire import RELAY, ChannelClosed, FrameWriter, encode, read_frame, read_header


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


def test_the_relay_trees_links_are_open_before_the_first_large_call_which_uses_them():
    """Once every agent's listener is open, the agents open the tree's links (LINKS): the first
    large call waits for no handshake and makes no connection of its own."""

    def peer_links(session) -> set[tuple]:
        ports = {n.peer_port for n in session.nodes}
        return {(n.link.node_rank, c.laddr, c.raddr) for n in session.nodes
                for c in psutil.Process(n.pid).net_connections("tcp")
                if c.status == psutil.CONN_ESTABLISHED and c.raddr and c.raddr[1] in ports}

    with GPUPool(nodes=4) as pool:
        task = distributed_task(digest, pool=pool, init_torch=False)
        task(np.zeros(1, dtype=np.uint8))  # small: straight to each node, no link used
        session = pool.runtime().session
        ports = [n.peer_port for n in session.nodes]
        want = {(0, ports[1]), (0, ports[2]), (1, ports[3])}  # node 0 -> 1, 2; node 1 -> 3
        deadline = time.monotonic() + 10
        while {(rank, raddr[1]) for rank, _, raddr in peer_links(session)} != want and time.monotonic() < deadline:
            time.sleep(0.05)
        before = peer_links(session)
        assert {(rank, raddr[1]) for rank, _, raddr in before} == want
        arg = np.random.default_rng(1).integers(0, 255, size=4 << 20, dtype=np.uint8)
        assert [d for _, d in task(arg)] == [hashlib.sha256(arg.tobytes()).hexdigest()] * 4
        assert peer_links(session) == before  # the same connections carried it: none opened, none lost


def test_a_stranger_is_refused_and_the_listener_is_on_the_nodes_address_only():
    with GPUPool(nodes=3) as pool:
        distributed_task(lambda: 1, pool=pool, init_torch=False)()
        session = pool.runtime().session
        node = session.nodes[1]
        assert node.peer_port
        listening = [c.laddr for c in psutil.Process(node.pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        assert listening == [(node.link.address, node.peer_port)]  # 127.0.0.1 here, never 0.0.0.0
        with socket.create_connection((node.link.address, node.peer_port), timeout=5) as stranger:
            stranger.sendall(b"\0" * DIGEST_BYTES)  # no pool certificate (TLS) and no secret: a guess
            try:
                said = stranger.recv(NONCE_BYTES)
            except ConnectionResetError:
                said = b""
            assert said == b""  # shut out, not even a challenge sent
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


def held_and_changed(a: np.ndarray) -> tuple[int, int, list[str], str]:
    """Which memory files this rank maps its argument from, after changing its copy in place."""
    files = sorted({line.split()[4] for line in open("/proc/self/maps") if "skytasks-argument" in line})
    a[:16] = 7
    return rank_info().rank, rank_info().node_rank, files, hashlib.sha256(a.tobytes()).hexdigest()


@pytest.mark.parametrize("nodes,per_node,start", [(2, 3, "fork"), (3, 2, "fork"), (2, 2, "exec")],
                         ids=["straight from the controller", "down the relay tree", "fresh interpreters"])
def test_a_node_receives_a_large_argument_once_for_all_its_ranks_and_each_may_change_its_own(
        nodes, per_node, start, monkeypatch):
    monkeypatch.setenv("SKYTASKS_RANK_START", start)
    arg = np.random.default_rng(1).integers(0, 255, size=4 << 20, dtype=np.uint8)
    changed = arg.copy()
    changed[:16] = 7
    with GPUPool(nodes=nodes, procs_per_node=per_node) as pool:
        task = distributed_task(held_and_changed, pool=pool, init_torch=False)
        task(np.zeros(1, dtype=np.uint8))
        first, again = task(arg), task(arg)  # the second: the ranks' cached copy, sent once
        after = distributed_task(digest, pool=pool, init_torch=False)(arg)
    for out in (first, again):
        assert [r for r, *_ in out] == list(range(nodes * per_node))
        assert {h for *_, h in out} == {hashlib.sha256(changed.tobytes()).hexdigest()}
        per_node_files = {n: {tuple(f) for _, node, f, _ in out if node == n} for n in range(nodes)}
        # one memory file per node, the same for each of its ranks; none shared across nodes
        assert all(len(files) == 1 and len(next(iter(files))) == 1 for files in per_node_files.values()), out
        assert len({next(iter(files)) for files in per_node_files.values()}) == nodes
    # what each rank changed was its own: the node's file, and the cache, kept the bytes as sent
    assert after == [(r, hashlib.sha256(arg.tobytes()).hexdigest()) for r in range(nodes * per_node)]


class _Rank:
    """A rank as the relay sees it: a pipe, and a control channel to hand it files on."""

    def __init__(self, refuse: bool = False):
        r, w = os.pipe()
        self.reads, self.to_rank = os.fdopen(r, "rb"), FrameWriter(os.fdopen(w, "wb"))
        self.agent_end, self.rank_end = socket.socketpair()
        self.refuse = refuse

    def hand_fd(self, token: int, fd: int) -> bool:
        if self.refuse:
            return False
        socket.send_fds(self.agent_end, [b"".join(bytes(c) for c in encode(message(Op.SHARED, token=token)))], [fd])
        return True


@pytest.mark.parametrize("refuse", [False, True], ids=["handed over", "one rank refuses: inline"])
def test_a_relayed_frame_names_a_handed_file_or_falls_back_to_its_bytes(refuse):
    from skytasks.node.peers import hand_over_to

    big, small = os.urandom(3 << 20), os.urandom(100 << 10)
    frame = b"".join(bytes(c) for c in encode(message(Op.HEARTBEAT) | {"big": big, "small": small}, flags=RELAY))
    ranks = [_Rank(), _Rank(refuse=refuse)]
    stream = io.BytesIO(frame)
    writer = threading.Thread(target=relay_frame, args=(stream, read_header(stream), [r.to_rank for r in ranks]),
                              kwargs={"hand_over": hand_over_to(ranks)}, daemon=True)
    got: dict[int, dict] = {}

    def rank_reads(i: int, rank: _Rank) -> None:  # each at once, as ranks do: a full pipe stalls the relay
        handed = HandedFiles(mapped_buffer)

        def control() -> None:
            with pytest.raises(ChannelClosed):  # until the agent's end closes, below
                serve_control_channel(rank.rank_end, handed, lambda m: None)

        threading.Thread(target=control, daemon=True).start()
        got[i] = read_frame(rank.reads, by_ref=handed.take)

    readers = [threading.Thread(target=rank_reads, args=(i, r)) for i, r in enumerate(ranks)]
    for t in readers + [writer]:
        t.start()
    for t in readers + [writer]:
        t.join(timeout=30)
    for rank in ranks:
        rank.agent_end.close()
    assert len(got) == 2
    for msg in got.values():
        assert bytes(msg["big"]) == big and bytes(msg["small"]) == small
        base = msg["big"].obj if isinstance(msg["big"], memoryview) else msg["big"]
        assert isinstance(base, SharedBuffer) is not refuse  # the handed file, mapped; or bytes read inline


def test_a_handed_file_is_taken_by_its_token_and_older_untaken_ones_are_closed():
    handed = HandedFiles(lambda fd, size: (fd, size))
    fds = [os.memfd_create("t") for _ in range(3)]
    for token, fd in enumerate(fds, start=1):
        handed.put(token, fd)
    assert handed.take(2, 10) == (fds[1], 10)
    with pytest.raises(OSError):
        os.fstat(fds[0])  # token 1 was never taken and never will be: closed
    assert handed.take(3, 5) == (fds[2], 5)
    os.close(fds[1])
    os.close(fds[2])
