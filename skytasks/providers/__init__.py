"""Providers bring nodes up and start a node agent on each; that is all that differs between them.

Everything after the agent's stream exists (spawning ranks, calls, failures, teardown of rank
processes) is the shared rank lifecycle in `skytasks.controller.rank_group`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Callable, Protocol

from skytasks.settings import settings

from skytasks.errors import PoolConfigError

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec
    from skytasks.workdir import WorkdirRequest


@dataclass
class NodeLink:
    """A running node agent and the byte stream to it."""

    node_rank: int
    address: str  # the node's address as its peers see it
    inbound: BinaryIO  # frames from the agent
    outbound: BinaryIO  # frames to the agent
    env: dict[str, str] = field(default_factory=dict)  # node-specific rank environment
    # The physical machine: GPU ids are only comparable between nodes on one machine (local
    # nodes all share this one; a remote node is a machine of its own).
    machine: str = ""
    close: Callable[[], None] = lambda: None  # release the transport (process, SSH channel)


def agent_args(heartbeat_file: str | None = None) -> list[str]:
    """The agent's command line: it is told its heartbeat, never left to a default of its own."""
    interval, timeout = settings().heartbeat
    args = ["-m", "skytasks.node.agent", "--heartbeat-seconds", f"{interval:g}", "--heartbeat-timeout", f"{timeout:g}"]
    return args + (["--heartbeat-file", heartbeat_file] if heartbeat_file else [])


class NodeProvider(Protocol):
    def start(self) -> list[NodeLink]:
        """Bring every node up and start its agent; all or nothing."""

    def free_port(self) -> int:
        """A port on the head node that the peers can rendezvous on."""

    def prepare_workdir(self, request: WorkdirRequest) -> tuple[str, str | None]:
        """Make the workdir present on every node: (its path there, a line saying what was sent)."""

    def stop(self) -> None:
        """Tear down everything `start` made. Idempotent, safe after a partial start."""


def provider_for(spec: PoolSpec) -> NodeProvider:
    if spec.provider == "local":
        from skytasks.providers.local import LocalProvider

        return LocalProvider(spec)
    if spec.provider == "ssh":
        from skytasks.providers.ssh import SSHProvider

        return SSHProvider(spec)
    if spec.provider == "aws":
        from skytasks.providers.aws.provider import AWSProvider

        return AWSProvider(spec)
    raise PoolConfigError(f"provider: unknown provider {spec.provider!r}")
