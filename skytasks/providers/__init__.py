"""Providers bring nodes up and start a node agent on each; that is all that differs between them.

Everything after the agent's stream exists (spawning ranks, calls, failures, teardown of rank
processes) is the shared rank lifecycle in `skytasks.lifecycle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Protocol


@dataclass
class NodeLink:
    """A running node agent and the byte stream to it."""

    node_rank: int
    address: str  # the node's address as its peers see it
    inbound: BinaryIO  # frames from the agent
    outbound: BinaryIO  # frames to the agent
    env: dict[str, str] = field(default_factory=dict)  # node-specific rank environment
    accelerators: int = 0
    close: Callable[[], None] = lambda: None  # release the transport (process, SSH channel)


class NodeProvider(Protocol):
    def start(self) -> list[NodeLink]:
        """Bring every node up and start its agent; all or nothing."""

    def free_port(self) -> int:
        """A port on the head node that the peers can rendezvous on."""

    def stop(self) -> None:
        """Tear down everything `start` made. Idempotent, safe after a partial start."""


def provider_for(pool) -> NodeProvider:
    if pool.provider == "local":
        from skytasks.providers.local import LocalProvider

        return LocalProvider(pool)
    if pool.provider == "ssh":
        from skytasks.providers.ssh import SSHProvider

        return SSHProvider(pool)
    raise NotImplementedError(
        f"provider={pool.provider!r} is declared but not implemented in this version of skytasks"
    )
