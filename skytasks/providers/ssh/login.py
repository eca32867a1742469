"""How a set of SSH nodes is reached (`SSHLogin`), shared by provider="ssh", the instances aws
launches and a SLURM login node: a host's spelling, its connection, and its known host keys
(always checked, never trusted blindly)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skytasks.errors import PoolConfigError, PoolStartError


def parse_host(spec: str, default_user: str | None) -> tuple[str | None, str, int]:
    user, _, rest = spec.rpartition("@") if "@" in spec else (default_user, "", spec)
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
    else:
        host, _, port = rest.partition(":")
    return user or default_user, host, int(port or 22)


@dataclass
class SSHLogin:
    """How to reach a set of nodes: shared by provider="ssh" and the instances aws launches."""

    targets: list[tuple[str | None, str, int]]  # (user, host, port), head first
    known_hosts: str  # known_hosts text or a path to one
    private_key: str | None = field(repr=False)  # a secret: never in a repr, a log line or a traceback
    python: str
    # Why `python` is what it is when remote_python was left unset (None: the user set it), so
    # that an error about it names what to set.
    python_default: str | None = None
    pip_packages: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict, repr=False)  # applies on the node, pip included; secret
    heartbeat_file: str | None = None
    notice_file: str | None = None  # where the node's watchdog writes a preemption notice
    timeout: float = 900.0
    # The nodes' addresses as their peers see them, where that is not the address SSH uses
    # (EC2: SSH to the public address, rendezvous on the private one inside the VPC).
    peer_addresses: list[str] | None = None
    min_nodes: int | None = None  # elastic: start with the targets that answer, at least this many


async def connect(login: SSHLogin, node_rank: int, user: str | None, host: str, port: int,
                  connect_timeout: float | None = None) -> Any:
    """One node's SSH connection, with the login's key and its host key checked against
    known_hosts; PoolStartError naming the node otherwise (a start's, and `skytasks check`'s)."""
    import asyncssh

    keys = None
    if login.private_key is not None:
        keys = [asyncssh.import_private_key(login.private_key)]
    try:
        return await asyncssh.connect(host, port=port, username=user, known_hosts=load_known_hosts(login.known_hosts, "ssh"),
                                      client_keys=keys, agent_path=None, keepalive_interval=10,
                                      keepalive_count_max=3, connect_timeout=connect_timeout)
    except asyncssh.HostKeyNotVerifiable as exc:
        raise PoolStartError(
            f"node {node_rank} ({host}:{port}): host key of {host}:{port} does not match known_hosts (or the "
            f"host is not in it): refused ({exc})"
        ) from None
    except (OSError, asyncssh.Error) as exc:
        raise PoolStartError(f"node {node_rank} ({host}:{port}): cannot connect over SSH: {exc}") from exc


def load_known_hosts(text: str | None, provider: str) -> Any:
    """known_hosts as asyncssh takes it, from its text or a path to it; never empty."""
    import asyncssh

    if not text:
        raise PoolConfigError(f"known_hosts: provider={provider!r} needs known_hosts (text or a path); host keys are "
                              "never trusted blindly")
    if "\n" not in text.strip() and os.path.exists(os.path.expanduser(text)):
        text = Path(os.path.expanduser(text)).read_text()
    return asyncssh.import_known_hosts(text)
