"""Stand-in doors for the re-attach contracts: a unix socket that greets and echoes, where the
node's processes can reach it (on this machine for ssh, aws and slurm nodes; exec'd into the pod
for kubernetes), so `provider.reattach(node_id, door, timeout)` is checked through each provider's
own way in without an agent behind it."""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

GREETING = b"door says hello\n"


class StandInDoor:
    """A unix socket that says GREETING to whoever connects, then echoes what it is sent."""

    def __init__(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="skytasks-door-test-"))
        os.chmod(folder, 0o755)  # reached from the node's own user and namespace
        self.path = str(folder / "door.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.accepted: int | None = 0  # who came through it
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted = (self.accepted or 0) + 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            conn.sendall(GREETING)
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def close(self) -> None:
        self.sock.close()
        os.unlink(self.path)
        os.rmdir(os.path.dirname(self.path))


# The same door inside a pod: a process exec'd there, as the agent is.
POD_DOOR = r"""
import socket, sys, threading
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(4)
print("listening", flush=True)
def echo(c):
    with c:
        c.sendall(b"door says hello\n")
        while True:
            d = c.recv(65536)
            if not d:
                break
            c.sendall(d)
while True:
    c, _ = s.accept()
    threading.Thread(target=echo, args=(c,), daemon=True).start()
"""


class PodDoor:
    """The stand-in door exec'd into a kubernetes node's pod; who came through it is not counted."""

    accepted = None

    def __init__(self, provider, node_id: int, path: str = "/tmp/stand-in-door.sock"):
        from skytasks.providers.kubernetes import exec_stream
        from skytasks.providers.kubernetes.pods import CONTAINER

        self.path = path
        self.stream = exec_stream.PodExec(provider._cfg, provider.namespace, provider.nodes[node_id], CONTAINER,
                                          [sys.executable, "-c", POD_DOOR, path])
        assert self.stream.inbound.readline() == b"listening\n", self.stream.last_words()

    def close(self) -> None:
        self.stream.close()


def read_exactly(stream, n: int, timeout: float = 20) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        chunk = os.read(stream.fileno(), n - len(got))
        if not chunk:
            break
        got += chunk
    return got


def round_trip(link) -> None:
    """The stream reaches the door and back: its greeting first, then an echo of what we send."""
    assert read_exactly(link.inbound, len(GREETING)) == GREETING
    link.outbound.write(b"ping 123\n")
    link.outbound.flush()
    assert read_exactly(link.inbound, 9) == b"ping 123\n"


def lease(link, window: float = 30.0) -> None:
    """A LEASE to the link's agent (as a controller sends it), then wait for the agent's first
    heartbeat that acknowledges it: from then on the agent outlives a break of its stream."""
    from skytasks.protocol import Op, message
    from skytasks.wire import FrameParser, encode

    link.outbound.write(b"".join(bytes(c) for c in encode(message(
        Op.LEASE, key=os.urandom(32).hex(), reattach_seconds=window, keep_warm_seconds=0.0, holder="test"))))
    link.outbound.flush()
    parser, deadline = FrameParser(), time.monotonic() + 20
    while time.monotonic() < deadline:
        data = link.inbound.read1(1 << 16)  # after what read_frame left in its buffer
        assert data, "the agent's stream ended"
        if any(f["op"] == Op.HEARTBEAT and "got" in f for f in parser.feed(data)):
            return
    raise AssertionError("the agent never acknowledged its LEASE")
