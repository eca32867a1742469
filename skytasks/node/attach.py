"""The way back in to a running agent: `python -c CLIENT DOOR` joins its stdin and stdout to the
agent's door (node/door.py, an AF_UNIX socket in the agent's private scratch folder).

A provider runs it through its own way in (a new SSH session, an srun step in the same
allocation, a Kubernetes exec) when the stream to an agent broke, and speaks to the agent through
its stdin and stdout as it did through the first stream: the door's handshake (protocol CHALLENGE,
ATTACH, ATTACHED), then the resumed frames. The snippet imports nothing of skytasks, so it runs on
any Python 3 of the node, before or without the package on its path. It ends when either side
ends: its stdin closing (the controller let go) closes the socket for writing, so the agent sees
the break; the agent closing the socket ends it.

Exit status 3: the door could not be reached (no such agent: it ended, or never was).
"""

from __future__ import annotations

CLIENT = r"""
import os, socket, sys, threading
door = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
try:
    s.connect(door)
except OSError as e:
    sys.stderr.write("skytasks attach: cannot reach the agent's door %s: %s\n" % (door, e))
    sys.stderr.flush()
    os._exit(3)
def up():
    try:
        while True:
            b = os.read(0, 1 << 20)
            if not b:
                break
            s.sendall(b)
    except OSError:
        pass
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=up, daemon=True).start()
try:
    while True:
        b = s.recv(1 << 20)
        if not b:
            break
        v = memoryview(b)
        while v:
            v = v[os.write(1, v):]
except OSError:
    pass
os._exit(0)
"""


def argv(python: str, door: str) -> list[str]:
    """The command that attaches to the agent whose door is `door`, run with the node's `python`."""
    return [python, "-c", CLIENT, door]
