"""Hosts in network namespaces, each a "machine" with an address of its own and a real sshd
on port 22 in it: what a multi-host pool needs that loopback cannot give (one address per host,
a link that can be pulled, a host that cannot reach another).

- `bridged_hosts`: two namespaces on one bridge of this machine; they reach each other and
  this machine, and their links to the bridge (`links`) can be set down.
- `split_hosts`: two namespaces, each on a link of its own to this machine: the controller
  reaches both, neither reaches the other (no route).

Both need root and iproute2 (the tests skip without them), and leave no namespace, link or
sshd behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from skytasks import GPUPool
from tests.harness.sshd import SSHServer

Folders = Callable[[str], Path]  # tmp_path_factory.mktemp: a fresh folder per sshd


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def skip_without_netns() -> None:
    """Skip the test where namespaces cannot be made: not root, no iproute2, or a sandbox that
    refuses `ip netns add`."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    probe = f"sktprobe{uuid.uuid4().hex[:4]}"
    try:
        ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc.stderr.decode().strip()}")
    ip("netns", "del", probe)


def _namespace_with_veth(made: list[tuple[str, str]], ns: str, outside: str, address: str) -> None:
    """Namespace `ns` whose eth0 (`address`/24) is the inside end of veth `outside`."""
    ip("netns", "add", ns)
    made.append(("netns", ns))
    ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
    made.append(("link", outside))
    for cmd in (["addr", "add", f"{address}/24", "dev", "eth0"], ["link", "set", "eth0", "up"],
                ["link", "set", "lo", "up"]):
        ip("-n", ns, *cmd)


def client_public_key(server: SSHServer) -> str:
    return subprocess.run(["ssh-keygen", "-y", "-f", str(server.folder / "client_key")], capture_output=True,
                          text=True, check=True).stdout


def _remove(servers: list[SSHServer], made: list[tuple[str, str]]) -> None:
    for server in servers:
        server.stop()
    for kind, name in reversed(made):
        subprocess.run(["ip", kind, "del", name], capture_output=True)


@contextmanager
def bridged_hosts(folders: Folders, subnet: str, prefix: str) -> Iterator[dict[str, Any]]:
    """Two hosts at `subnet`.2 and `subnet`.3 on a bridge at `subnet`.1, one client key for both.
    `prefix` (3-4 letters) names the namespaces and links, a random tag after it: two modules
    using different subnets may run at once. Yields addresses, links (this machine's veth ends),
    servers and netns (the namespaces' names)."""
    skip_without_netns()
    tag = uuid.uuid4().hex[:4]
    bridge, names = f"{prefix}b{tag}", [f"{prefix}{tag}n{i}" for i in range(2)]
    made: list[tuple[str, str]] = []
    servers: list[SSHServer] = []
    try:
        ip("link", "add", bridge, "type", "bridge")
        made.append(("link", bridge))
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        addresses, links = [], []
        for i, ns in enumerate(names):
            address, outside = f"{subnet}.{i + 2}", f"{prefix}{tag}v{i}"
            _namespace_with_veth(made, ns, outside, address)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            addresses.append(address)
            links.append(outside)
        first = SSHServer(folders("sshd0"), [addresses[0]], 22, netns=names[0])
        servers.append(first)
        servers.append(SSHServer(folders("sshd1"), [addresses[1]], 22, netns=names[1],
                                 authorized_key=client_public_key(first)))
        yield {"addresses": addresses, "links": links, "servers": servers, "netns": names}
    finally:
        _remove(servers, made)


@contextmanager
def split_hosts(folders: Folders, subnets: tuple[str, str], prefix: str) -> Iterator[dict[str, Any]]:
    """Two hosts at `subnets[i]`.2, each on a link of its own whose end here is `subnets[i]`.1:
    this machine reaches both, neither reaches the other. One client key for both. Yields
    addresses and servers."""
    skip_without_netns()
    tag = uuid.uuid4().hex[:4]
    made: list[tuple[str, str]] = []
    servers: list[SSHServer] = []
    try:
        addresses, names = [], []
        for i, subnet in enumerate(subnets):
            ns, outside = f"{prefix}{tag}n{i}", f"{prefix}{tag}v{i}"
            _namespace_with_veth(made, ns, outside, f"{subnet}.2")
            ip("addr", "add", f"{subnet}.1/24", "dev", outside)
            ip("link", "set", outside, "up")
            addresses.append(f"{subnet}.2")
            names.append(ns)
        first = SSHServer(folders("sshd-ns0"), [addresses[0]], 22, netns=names[0])
        servers.append(first)
        servers.append(SSHServer(folders("sshd-ns1"), [addresses[1]], 22, netns=names[1],
                                 authorized_key=client_public_key(first)))
        yield {"addresses": addresses, "servers": servers}
    finally:
        _remove(servers, made)


def netns_pool(hosts: dict[str, Any], **overrides: Any) -> GPUPool:
    """`GPUPool(provider="ssh")` on the two namespace hosts, with their one client key."""
    servers = hosts["servers"]
    fields = dict(provider="ssh", nodes=2, hosts=[f"root@{a}" for a in hosts["addresses"]],
                  ssh_private_key=servers[0].client_key, remote_python=sys.executable,
                  known_hosts="".join(s.known_hosts() for s in servers))
    return GPUPool(**{**fields, **overrides})
