"""`skytasks run`'s rank 0 keeps the TCPStore it hosts until every script's connection to it has
closed, told by the kernel's socket tables (no rank imports torch after its script to say so)."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

from skytasks.node.ports import free_port
from skytasks.script import _scripts_connected

CLIENT = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print("connected", flush=True)
time.sleep(60)
"""


def _until(port: int, count: int, timeout: float = 10) -> int | None:
    deadline = time.monotonic() + timeout
    while (seen := _scripts_connected(port)) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_the_store_hosts_count_is_the_scripts_connections_not_its_own():
    from torch.distributed import TCPStore

    port = free_port("127.0.0.1")
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    clients = []
    try:
        assert _until(port, 0) == 0  # the master store's own connection to its daemon is not a script's
        for expected in (1, 2):
            proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
            clients.append(proc)
            assert proc.stdout.readline().strip() == "connected"
            assert _until(port, expected) == expected
        clients[0].kill()
        clients[0].wait()
        assert _until(port, 1) == 1
        clients[1].kill()
        clients[1].wait()
        assert _until(port, 0) == 0
    finally:
        for proc in clients:
            proc.kill()
            proc.wait()
        del store
