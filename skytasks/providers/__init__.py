"""Providers bring nodes up and start a node agent on each; that is all that differs between them.

Everything after the agent's stream exists (spawning ranks, calls, failures, teardown of rank
processes) is the shared rank lifecycle in `skytasks.controller`. A provider is the
`NodeProvider` protocol below, and reports what happens to its nodes through the `PoolReporter`
it is given (`skytasks.event_bus`); the controller asks it, never its name, what it can do.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, ClassVar, Mapping, Optional, Protocol, runtime_checkable

from skytasks.errors import NodeGone, PoolConfigError
from skytasks.settings import settings

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec
    from skytasks.event_bus import PoolReporter
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
    # The same for a node found lost, whose agent cannot answer: no waiting for it to end on its
    # own (SLURM's srun would wait until SLURM declares the node down). None: `close`.
    close_lost: Callable[[], None] | None = None
    # Why the stream ended, in the provider's words (SLURM: the node's state and reason), asked
    # when the node is found lost; "" when the provider knows no more than the closed stream.
    loss_detail: Callable[[], str] = lambda: ""
    node_id: int = -1  # -1: the node_rank it was started as
    # Where the node runs, as a person finds it ("pod P on node K"), shown beside its address in
    # the rank table and a rank's failure; "" when the address says it all.
    where: str = ""
    # When the node goes, as its provider knows it better than the node itself (epoch seconds;
    # Kubernetes: the deletion's own grace period), asked when the node gives a preemption notice.
    notice_deadline: Callable[[], Optional[float]] = lambda: None

    def __post_init__(self) -> None:
        if self.node_id < 0:
            self.node_id = self.node_rank

    def let_go_lost(self) -> None:
        (self.close_lost or self.close)()


def agent_args(heartbeat_file: str | None = None, notice_file: str | None = None) -> list[str]:
    """The agent's command line: it is told its heartbeat, never left to a default of its own."""
    knobs = settings()
    interval, timeout = knobs.heartbeat
    args = ["-m", "skytasks.node.agent", "--heartbeat-seconds", f"{interval:g}", "--heartbeat-timeout", f"{timeout:g}",
            "--sample-seconds", f"{knobs.resource_sample_seconds:g}", "--rank-start", knobs.rank_start]
    args += ["--heartbeat-file", heartbeat_file] if heartbeat_file else []
    return args + (["--notice-file", notice_file] if notice_file else [])


@dataclass(frozen=True)
class Capabilities:
    """What a provider can do, asked by the controller (never the provider's name)."""

    # Whether a call may bring up its own pool of another shape (nodes, procs_per_node) beside
    # this one: cheap for local processes, never for machines someone pays for.
    reshape_is_cheap: bool = False
    # Whether the nodes are this machine (a workdir is used in place, not sent).
    runs_on_this_machine: bool = False
    # Whether the nodes have exactly the GPUs the pool's fields ask for (it launches or allocates
    # them), so a pool with no accelerator has none; ssh hosts have whatever they have.
    gpus_from_config: bool = False
    # Whether `reattach` can open a new stream to a node's running agent: a stream that breaks
    # (an SSH connection reset, an exec cut by an API server restart) is then re-attached within
    # the pool's reattach_seconds instead of being a lost node.
    reattaches: bool = False
    # Whether a replacement node comes from elsewhere (a new instance, pod or allocation), so a
    # node the preflight found unhealthy can be replaced rather than only dropped.
    replaces_elsewhere: bool = False


CAPABILITIES = tuple(Capabilities.__dataclass_fields__)


def capabilities_of(provider: object) -> Capabilities:
    """A provider's (or its class's) capabilities; a stand-in that is no NodeProvider (a test's)
    says them as attributes of the same names, each False unless it says so."""
    given = getattr(provider, "capabilities", None)
    if isinstance(given, Capabilities):
        return given
    return Capabilities(**{name: bool(getattr(provider, name, False)) for name in CAPABILITIES})


class NodeProvider:
    """The seam every provider implements: a subclass states what it can do as its `capabilities`
    (a frozen Capabilities), and is read by them. Each capability is also a class attribute of
    the same name (`provider.reattaches`), set from them, for code that reads it so; a subclass
    that sets such an attribute itself (a test's variant of a provider) gets capabilities to match."""

    capabilities: ClassVar[Capabilities] = Capabilities()
    reshape_is_cheap: ClassVar[bool] = False
    runs_on_this_machine: ClassVar[bool] = False
    gpus_from_config: ClassVar[bool] = False
    reattaches: ClassVar[bool] = False
    replaces_elsewhere: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "capabilities" not in cls.__dict__:  # said as attributes (here or by a base): gathered
            cls.capabilities = Capabilities(**{name: bool(getattr(cls, name)) for name in CAPABILITIES})
        for name in CAPABILITIES:
            setattr(cls, name, getattr(cls.capabilities, name))

    def start(self) -> list[NodeLink]:
        """Bring nodes up and start their agents: `spec.nodes` of them, or for an elastic pool as
        many as can be had down to `spec.min_nodes` (saying why not more through the reporter).
        Fewer than that is a PoolStartError, with everything started torn down."""
        raise NotImplementedError

    def replace(self, node_id: int) -> NodeLink:
        """A working node in place of a lost one, with its agent started; raises PoolStartError
        naming the node when none can be had."""
        raise NotImplementedError

    def grow(self, count: int) -> list[NodeLink]:
        """Up to `count` more nodes, agents started, with new node ids: what can be had now
        (maybe none, saying why through the reporter). Never raises for want of capacity."""
        raise NotImplementedError

    def release(self, node_id: int) -> None:
        """A node the pool no longer uses (it was lost or is going, and is not replaced): end
        what holds it (its agent, its instance, its job) now rather than at `stop`."""

    def abort(self) -> None:
        """From another thread: cut a `start` in progress short (it tears down and raises)."""

    def reattach(self, node_id: int, door: str, timeout: float) -> NodeLink:
        """A new stream to the agent of node `node_id`, which still runs, through its door (the
        socket its HELLO named): `skytasks.node.attach.CLIENT` run on the node with `door` as its
        argument, its stdin and stdout the link's `outbound` and `inbound` (a descriptor, read by
        the reactor). The controller does the door's handshake; the link's `close`/`close_lost`
        end this stream only. Within about `timeout` seconds. Raises NodeGone (why, in the
        provider's words) when the node itself is gone, so trying again is no use; anything else
        raised is tried again, until reattach_seconds from the break. Only asked of a provider
        that `reattaches`."""
        raise NodeGone("this provider cannot reach a running agent again")

    # Warm pools (keep_warm_minutes): the nodes outlive the process that started them, and a later
    # process's provider takes them over. A provider that cannot keeps these defaults.

    def handle(self) -> dict[str, Any]:
        """Where this pool's nodes are, for another process's provider to `adopt`: plain JSON
        (str/int/float/bool/None, lists, dicts with str keys), never a credential (keys and tokens
        stay in the pool's own fields). Asked after `start` and after every replace/grow/release
        while the pool is warm; it names every node the provider now holds, by node id."""
        raise PoolConfigError(f"keep_warm_minutes: provider {type(self).__name__} cannot keep nodes warm")

    def adopt(self, handle: dict[str, Any]) -> None:
        """Instead of `start`: take over the nodes a `handle` names, already running (their agents
        too), so `reattach`, `replace`, `grow`, `release`, `leave_running` and `stop` work on them
        as on nodes this process started. Starts nothing and opens no stream (the controller
        reaches each agent with `reattach`); a node found gone is the controller's to find then
        (`reattach` raises NodeGone), not an error here. Raises PoolStartError only when the whole
        pool cannot be taken over (its allocation or owner is gone: the controller starts afresh)."""
        raise PoolConfigError(f"keep_warm_minutes: provider {type(self).__name__} cannot keep nodes warm")

    def leave_running(self) -> None:
        """Instead of `stop`, when the pool stays warm: let go of what this process holds (its
        streams' processes and connections, watches, lease-renewing threads) and leave the nodes,
        their agents and whatever keeps them (instances, pods, the allocation) running. The
        nodes' own keep-warm clock ends them later. `stop` is not called afterwards."""
        raise PoolConfigError(f"keep_warm_minutes: provider {type(self).__name__} cannot keep nodes warm")

    def free_port(self, head: int) -> int:
        """A port on the head node (by its node id) that the peers can rendezvous on."""
        raise NotImplementedError

    def prepare_workdir(self, request: WorkdirRequest) -> tuple[str, str | None]:
        """Make the workdir present on every node: (its path there, a line saying what was sent)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Tear down everything `start` made. Idempotent, safe after a partial start. Raises
        PoolTeardownError (after trying every step) when something may be left behind."""


@runtime_checkable
class PreloadsImports(Protocol):
    """A provider whose agents can start with what the session's ranks will import already
    imported (the local provider's fork server): asked before `start`."""

    def preload(self, modules: tuple[str, ...]) -> None:
        """`modules`: "torch", and "torchrun" when the ranks run torchrun scripts (torch imported
        with torchrun's OMP_NUM_THREADS default)."""


class ProviderClass(Protocol):
    """A provider's class, as the registry hands it out: what it can do is asked of the class
    before any pool starts, and `Provider(spec, reporter=...)` makes one."""

    reshape_is_cheap: bool
    runs_on_this_machine: bool
    gpus_from_config: bool

    def __call__(self, spec: PoolSpec, reporter: PoolReporter | None = None) -> NodeProvider: ...


@dataclass(frozen=True)
class ProviderPlugin:
    """What a provider's folder declares in its `__init__` (kept light: no cloud SDK, client or
    Prefect integration is imported until a pool of that provider is made or loaded, and not even
    its fields until a pool is checked). The registry (`skytasks.providers.registry`) lists them."""

    name: str  # the block's `provider` value
    provider: str  # "module:Class" of its NodeProvider, imported on first use
    # "module:Class" of its settings model (a ProviderSettingsModel, in its `spec.py`): the form's
    # tab, the `settings` of a pool of it and, as it is, its part of the PoolSpec. The block's Union
    # of them is made from the table (blocks/pool_settings.py).
    settings: str
    # "module:function" of its pre-flight checks (`skytasks check`, skytasks.providers.checks):
    # given the pool's spec, it yields a Check per question. None: it has none.
    check: str | None = None
    # Its Optional fields that hold a Prefect block of a package it alone needs, each with the
    # "module:Class" of that block: the field's own type names it lazily (imported when a value is
    # given), and the block's schema is made with the real class (blocks/gpu_pool.py), so a saved
    # pool refers to a saved block. Until then no pool of another provider imports the package.
    block_fields: Mapping[str, str] = field(default_factory=dict)
    # The pool's field whose block its client is made with (a pool's own field, not a setting: Prefect
    # keeps a reference to a saved block only at the block's top level), handed over as
    # `PoolSpec.credentials`. None: it takes none.
    credentials: str | None = None
    # "module:function" of its `skytasks gc` sweep, given the command line's arguments (cli.py),
    # returning the exit code. None: nothing of its pools can outlive their controller.
    gc: str | None = None

    @property
    def settings_model(self) -> Any:
        """Its settings model's class, imported now."""
        return imported(self.settings)

    @property
    def reads(self) -> tuple[str, ...]:
        """The block fields it reads beyond the pool's shape (`SHAPE_FIELDS`): its settings' fields
        and its own block fields. A field only others read, set on its pool, is a PoolConfigError."""
        return (*self.block_fields, *(name for name in self.settings_model.model_fields if name != "provider"))


def imported(target: str) -> Any:
    """What a "module:name" names, imported now."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


# The fields every provider takes: how many nodes and ranks, their accelerators and environment
# (the AWS credentials become every rank's AWS variables, for S3 checkpoints on any provider),
# and what every node must show before user code runs (skytasks.preflight).
SHAPE_FIELDS = ("provider", "nodes", "min_nodes", "procs_per_node", "accelerator", "accelerators_per_node", "env",
                "reattach_seconds", "keep_warm_minutes", "aws_credentials", "preflight", "preflight_limits")
