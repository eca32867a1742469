"""A rank's control channel from its agent (a socket both ways), read on a thread of its own,
even mid-call: preemption notices, and the memory files of large arguments.

A large argument reaches a node's ranks as one memory file that the agent wrote once (see
`node/relay.py`): the agent hands each rank the file's descriptor here (a SHARED frame with
the fd beside it, SCM_RIGHTS), then writes the CALL frame on the rank's pipe with a token where
the bytes would be. The rank's main thread, reading that frame, takes the file by its token
(`HandedFiles.take`) and maps it. Standard library only, as the rest of the node side.
"""

from __future__ import annotations

import array
import collections
import os
import socket
import threading
from typing import Any, Callable

from skytasks.protocol import Op
from skytasks.wire import ChannelClosed, FrameParser

# A CALL names a file its agent handed over just before writing the frame; this is only the
# bound on a broken agent, never a wait an ordinary call sees.
HANDED_WAIT_SECONDS = 60.0
_MAX_FDS = 64  # per read: one per SHARED frame, far more than one call's large arguments


class HandedFiles:
    """The files the agent handed this rank, by token, until the frame that names them is read."""

    def __init__(self, map_file: Callable[[int, int], Any]):
        self._map_file = map_file  # (fd, size) -> the buffer the frame's reader gets
        self._fds: dict[int, int] = {}
        self._arrived = threading.Condition()

    def put(self, token: int, fd: int) -> None:
        with self._arrived:
            self._fds[token] = fd
            self._arrived.notify_all()

    def take(self, token: int, size: int) -> Any:
        """The buffer of the file named `token` (`size` bytes), mapped; for `wire.read_frame`."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: token in self._fds, timeout=HANDED_WAIT_SECONDS):
                raise ChannelClosed(f"the agent named memory file {token} but never handed it over")
            fd = self._fds.pop(token)
            # Tokens only grow: an older file no frame took (its call went inline) is never wanted.
            for stale in [t for t in self._fds if t < token]:
                os.close(self._fds.pop(stale))
        return self._map_file(fd, size)


def serve_control_channel(sock: socket.socket, handed: HandedFiles, on_message: Callable[[dict[str, Any]], None]) -> None:
    """Read the channel until it closes: SHARED frames give their fd to `handed`, every other
    frame goes to `on_message`. A descriptor arrives with the first byte of the frame it was sent
    beside (Linux never joins a read across it), so pairing them in order is exact."""
    parser = FrameParser()
    fds: collections.deque[int] = collections.deque()
    while True:
        data, ancillary, _flags, _addr = sock.recvmsg(1 << 16, socket.CMSG_SPACE(_MAX_FDS * 4), socket.MSG_CMSG_CLOEXEC)
        if not data:
            raise ChannelClosed("the agent closed the control channel")
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[:len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        for msg in parser.feed(data):
            if msg["op"] == Op.SHARED:
                handed.put(msg["token"], fds.popleft())
            else:
                on_message(msg)
