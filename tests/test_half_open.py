"""A node's relay listener is reachable by anyone on the peers' network (issue 53): strangers who
open connections and then stall cannot keep the pool's own peers out or swell the agent's memory,
and no failure while accepting (too many open files, a thread that cannot start) stops it."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.node.peer_links import PENDING_HANDSHAKES, connect
from skytasks.node.tls_link import PeerTLS
from skytasks.protocol import Op, message

STRANGERS = 500
# The start of a TLS ClientHello (a handshake record of 512 bytes), then nothing more.
PARTIAL_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x07" * 40


def digest(a: np.ndarray) -> tuple[int, int, str]:
    return rank_info().rank, os.getpid(), hashlib.sha256(a.tobytes()).hexdigest()


def test_500_half_open_connections_neither_keep_a_real_peer_out_nor_swell_the_agent():
    with GPUPool(nodes=3) as pool:
        task = distributed_task(digest, pool=pool, init_torch=False)
        before_ranks = {r: pid for r, pid, _ in task(np.zeros(1, dtype=np.uint8))}
        session = pool.runtime().session
        node = session.nodes[1]
        assert node.peer_port
        agent = psutil.Process(node.pid)
        rss_before, threads_before = agent.memory_info().rss, agent.num_threads()
        strangers = []
        try:
            for i in range(STRANGERS):
                s = socket.create_connection((node.link.address, node.peer_port), timeout=10)
                if i % 2:
                    s.sendall(PARTIAL_HELLO)
                strangers.append(s)
            peak_rss, peak_threads = 0, 0
            for _ in range(15):  # while they are all still held open
                peak_rss = max(peak_rss, agent.memory_info().rss)
                peak_threads = max(peak_threads, agent.num_threads())
                time.sleep(0.1)
            # a real peer, with the pool's key as its PEERS message carries it, still gets in,
            # well within a stranger's handshake deadline: a stalled stranger gives way to it
            keys = session.relay.peers_message(node.link.address)
            started = time.monotonic()
            writer = connect(node.link.address, node.peer_port, bytes.fromhex(keys["secret"]),
                             tls=PeerTLS(keys["cert"], keys["key"]))
            admitted_s = time.monotonic() - started
            writer.send(message(Op.LINKS, children=[]))  # a frame it serves: nothing to open
            writer.close()
        finally:
            for s in strangers:
                s.close()
        # a pending stranger costs a thread and a small buffer, not a megabyte: 500 would be 500 MB
        assert peak_rss - rss_before < 48 << 20, (rss_before, peak_rss)
        # Threads are bounded by the pending handshakes, not by the strangers: a handshake cut to make
        # room ends its thread a moment after the cut, so under load a few overlap the new ones.
        assert peak_threads - threads_before <= PENDING_HANDSHAKES + 16, (threads_before, peak_threads)
        assert admitted_s < 3.0, admitted_s
        # the pool's own relay (node 0 -> node 1 -> ...) goes on, on the same ranks
        arg = np.random.default_rng(3).integers(0, 255, size=4 << 20, dtype=np.uint8)
        out = task(arg)
        assert [h for *_, h in out] == [hashlib.sha256(arg.tobytes()).hexdigest()] * 3
        assert {r: pid for r, pid, _ in out} == before_ranks
        assert node.alive


# Run in a process of its own: it limits its own address space and open files.
_ACCEPT_FAILURES = textwrap.dedent("""
    import os, resource, socket, sys, threading, time
    from skytasks.node.peer_links import PeerListener, connect
    from skytasks.protocol import Op, message
    from skytasks.wire import read_frame

    def wait_for(predicate, seconds=10.0):
        deadline = time.monotonic() + seconds
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.02)
        return predicate()

    heard = []
    listener = PeerListener("127.0.0.1", b"s" * 32, lambda stream: heard.append(read_frame(stream)))

    def a_peer_gets_through():
        writer = connect("127.0.0.1", listener.port, b"s" * 32)
        writer.send(message(Op.HEARTBEAT))
        writer.close()
        ok = wait_for(lambda: len(heard) == 1)
        heard.clear()
        return ok

    # 1. a thread that cannot start: each new thread asks for a 1 GB stack, past the address space left
    threading.stack_size(1 << 30)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + (512 << 20), hard))
    doomed = socket.create_connection(("127.0.0.1", listener.port))
    assert wait_for(lambda: listener.shed == 1), listener.shed
    assert doomed.recv(1) == b""  # closed, not left hanging
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    threading.stack_size(0)
    assert a_peer_gets_through()

    # 2. too many open files: accept fails with EMFILE until one is free again
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    filler = []
    try:
        while True:
            filler.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    os.close(filler.pop())  # one left: the stranger's own end, so none for the listener's
    waiting = socket.create_connection(("127.0.0.1", listener.port))
    time.sleep(1.0)  # the listener meets EMFILE on every accept meanwhile
    for fd in filler:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    waiting.close()
    assert a_peer_gets_through()
    print("SERVED", listener.shed, listener.refused, flush=True)
""")


def test_the_accept_loop_survives_a_thread_that_cannot_start_and_too_many_open_files():
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # no fresh malloc arenas under the address-space limit
    done = subprocess.run([sys.executable, "-c", _ACCEPT_FAILURES], capture_output=True, text=True, timeout=60,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "SERVED" in done.stdout, done.stdout
    said = done.stderr
    assert "a peer's connection could not be taken" in said and "can't start new thread" in said, said
    assert "accepting a peer failed" in said and "Too many open files" in said, said
