"""Providers bring nodes up and start a node agent on each; that is all that differs between them.

Everything after the agent's stream exists (spawning ranks, calls, failures, teardown of rank
processes) is the shared rank lifecycle in `skytasks.controller`. A provider is the
`NodeProvider` protocol below, and reports what happens to its nodes through the `PoolReporter`
it is given (`skytasks.providers.reporting`); the controller asks it, never its name, what it can do.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Callable, Literal, Protocol

from skytasks.settings import settings

from skytasks.errors import PoolConfigError
from skytasks.providers.reporting import PoolReporter

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec
    from skytasks.workdir import WorkdirRequest


@dataclass
class NodeLink:
    """A running node agent and the byte stream to it."""

    # Its place in the pool now (NODE_RANK); the session renumbers nodes when one leaves an
    # elastic pool. `node_id` is the provider's own name for it, which never changes.
    node_rank: int
    address: str  # the node's address as its peers see it
    inbound: BinaryIO  # frames from the agent
    outbound: BinaryIO  # frames to the agent
    env: dict[str, str] = field(default_factory=dict)  # node-specific rank environment
    # The physical machine: GPU ids are only comparable between nodes on one machine (local
    # nodes all share this one; a remote node is a machine of its own).
    machine: str = ""
    close: Callable[[], None] = lambda: None  # release the transport (process, SSH channel)
    # Why the stream ended, in the provider's words (SLURM: the node's state and reason), asked
    # when the node is found lost; "" when the provider knows no more than the closed stream.
    loss_detail: Callable[[], str] = lambda: ""
    node_id: int = -1  # -1: the node_rank it was started as

    def __post_init__(self) -> None:
        if self.node_id < 0:
            self.node_id = self.node_rank


def agent_args(heartbeat_file: str | None = None, notice_file: str | None = None) -> list[str]:
    """The agent's command line: it is told its heartbeat, never left to a default of its own."""
    knobs = settings()
    interval, timeout = knobs.heartbeat
    args = ["-m", "skytasks.node.agent", "--heartbeat-seconds", f"{interval:g}", "--heartbeat-timeout", f"{timeout:g}",
            "--sample-seconds", f"{knobs.resource_sample_seconds:g}"]
    args += ["--heartbeat-file", heartbeat_file] if heartbeat_file else []
    return args + (["--notice-file", notice_file] if notice_file else [])


class NodeProvider(Protocol):
    # Whether a call may bring up its own pool of another shape (nodes, procs_per_node) beside
    # this one: cheap for local processes, never for machines someone pays for.
    reshape_is_cheap: bool
    # Whether the nodes are this machine (a workdir is used in place, not sent).
    runs_on_this_machine: bool
    # Whether the nodes have exactly the GPUs the pool's fields ask for (it launches or allocates
    # them), so a pool with no accelerator has none; ssh hosts have whatever they have.
    gpus_from_config: bool

    def start(self) -> list[NodeLink]:
        """Bring nodes up and start their agents: `spec.nodes` of them, or for an elastic pool as
        many as can be had down to `spec.min_nodes` (saying why not more through the reporter).
        Fewer than that is a PoolStartError, with everything started torn down."""

    def replace(self, node_id: int) -> NodeLink:
        """A working node in place of a lost one, with its agent started; raises PoolStartError
        naming the node when none can be had."""

    def grow(self, count: int) -> list[NodeLink]:
        """Up to `count` more nodes, agents started, with new node ids: what can be had now
        (maybe none, saying why through the reporter). Never raises for want of capacity."""

    def release(self, node_id: int) -> None:
        """A node the pool no longer uses (it was lost or is going, and is not replaced): end
        what holds it (its agent, its instance, its job) now rather than at `stop`."""

    def abort(self) -> None:
        """From another thread: cut a `start` in progress short (it tears down and raises)."""

    def free_port(self, head: int) -> int:
        """A port on the head node (by its node id) that the peers can rendezvous on."""

    def prepare_workdir(self, request: WorkdirRequest) -> tuple[str, str | None]:
        """Make the workdir present on every node: (its path there, a line saying what was sent)."""

    def stop(self) -> None:
        """Tear down everything `start` made. Idempotent, safe after a partial start. Raises
        PoolTeardownError (after trying every step) when something may be left behind."""


# Every provider, by the name a pool's `provider` field takes: "module:class", imported on first
# use (a local pool never imports boto3 or asyncssh). Adding a provider is one line here.
PROVIDERS: dict[str, str] = {
    "local": "skytasks.providers.local:LocalProvider",
    "ssh": "skytasks.providers.ssh:SSHProvider",
    "aws": "skytasks.providers.aws.provider:AWSProvider",
    "slurm": "skytasks.providers.slurm.provider:SlurmProvider",
}
# The `provider` field's type, from the table: the names are written once.
ProviderName = Literal[tuple(PROVIDERS)]  # type: ignore[valid-type]


def provider_class(name: str) -> type:
    where = PROVIDERS.get(name)
    if where is None:
        raise PoolConfigError(f"provider: unknown provider {name!r}; known: {', '.join(PROVIDERS)}")
    module, _, cls = where.partition(":")
    return getattr(importlib.import_module(module), cls)


def provider_for(spec: PoolSpec, reporter: PoolReporter | None = None) -> NodeProvider:
    return provider_class(spec.provider)(spec, reporter=reporter or PoolReporter(spec.name, spec.provider))
