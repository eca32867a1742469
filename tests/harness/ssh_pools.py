"""`GPUPool(provider="ssh")` as a user writes it for a test `SSHServer`: its hosts, its client key
and its host key, and this machine's Python on the "nodes"."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from skytasks import GPUPool
from tests.harness.sshd import SSHServer

# Two "machines" on one sshd: two loopback addresses (the node agents tell them apart by address).
LOOPBACK_HOSTS = ("127.0.0.1", "127.0.0.2")


def ssh_pool_fields(server: SSHServer, hosts: Sequence[str] | None = None) -> dict[str, Any]:
    """The keywords of a pool with one node per address of `hosts` (the server's own by default)."""
    hosts = list(hosts if hosts is not None else server.addresses)
    return dict(provider="ssh", nodes=len(hosts), hosts=[f"root@{h}:{server.port}" for h in hosts],
                ssh_private_key=server.client_key, known_hosts=server.known_hosts(), remote_python=sys.executable)


def ssh_pool(server: SSHServer, hosts: Sequence[str] | None = None, **overrides: Any) -> GPUPool:
    """A pool on `server`; `overrides` replace any of its keywords (nodes, procs_per_node...)."""
    return GPUPool(**{**ssh_pool_fields(server, hosts), **overrides})
