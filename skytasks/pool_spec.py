"""What a pool is, frozen: the typed configuration providers and the runtime are built from.

`GPUPool` (the Prefect block) validates its fields once and gives a `PoolSpec`; nothing behind it
reads the block. Each provider gets the common part and its own `part`: the pool's settings model
(frozen; `skytasks/providers/<name>/spec.py`), never another provider's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, TypeVar

Part = TypeVar("Part")


@dataclass(frozen=True)
class PoolSpec:
    name: str  # the saved block's name, or "<provider>-pool": tags and events
    provider: str  # a name of skytasks.providers.PROVIDERS (the block checks it)
    nodes: int  # the most nodes the pool asks for
    procs_per_node: int
    accelerators_per_node: Optional[int]
    # Every rank's environment (AWS variables included): plain strings for the ranks, never in a
    # repr (the block holds them as secrets; a spec in a log or an error message must not show them).
    env: Mapping[str, str] = field(default_factory=dict, repr=False)
    # The provider's own part: the pool's settings model, checked against the rest of the pool
    # (`skytasks.providers.<name>.spec`: SSHSettings, AWSSettings, ...), read with `own`.
    part: object = None
    # The fewest nodes the pool runs on (elastic when below `nodes`): it starts with what it can
    # get between the two, a retry goes on with what is left, and it grows back between calls.
    min_nodes: Optional[int] = None
    # How long a node whose stream broke may take to be reached again (on a provider that can open
    # a new stream to a running agent) before it is a lost node; 0: a broken stream is a lost node.
    reattach_seconds: float = 60.0
    # A saved pool's nodes outlive the process that holds them for this long unheld (warm pools,
    # skytasks.controller.warm); 0: they end with the process, as without warm pools.
    keep_warm_minutes: float = 0.0
    # What every node must show before user code runs on it (skytasks.preflight): "off", "basic"
    # (ranks start, see the promised GPUs, one small all-reduce) or "full" (figures compared).
    preflight: str = "basic"
    preflight_timeout_seconds: float = 60.0
    preflight_min_ratio: float = 0.5  # "full": below this share of the pool's median figure is unhealthy
    preflight_min_tflops: Optional[float] = None  # "full": a floor for each rank's matmul
    preflight_min_gbps: Optional[float] = None  # "full": a floor for each link's collective bandwidth
    accelerator: Optional[str] = None  # the GPU product promised ("H100"), which "basic" checks
    # The credentials block the provider's client is made with (the pool's field its plugin names:
    # aws_credentials, kubernetes_credentials); None for a provider that takes none. Never in a repr.
    credentials: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.min_nodes is None:
            object.__setattr__(self, "min_nodes", self.nodes)
        if not 1 <= self.fewest <= self.nodes:
            raise ValueError(f"min_nodes: must be between 1 and nodes={self.nodes}, got {self.min_nodes}")
        if not self.reattach_seconds >= 0:
            raise ValueError(f"reattach_seconds: must be 0 or more, got {self.reattach_seconds!r}")
        if not self.keep_warm_minutes >= 0:
            raise ValueError(f"keep_warm_minutes: must be 0 or more, got {self.keep_warm_minutes!r}")
        _check_preflight(self)

    def own(self, kind: type[Part]) -> Part:
        """The provider's own part, as the type it expects: a pool built for another provider is
        refused here rather than read wrongly."""
        if not isinstance(self.part, kind):
            raise TypeError(f"provider={self.provider!r}: the pool's spec holds {type(self.part).__name__}, "
                            f"not {kind.__name__}")
        return self.part

    @property
    def fewest(self) -> int:
        """min_nodes, which is always set once the spec is made."""
        return self.nodes if self.min_nodes is None else self.min_nodes

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.nodes

    @property
    def node_count(self) -> str:
        """The count as people read it: "2", or "2-4" for an elastic pool."""
        return f"{self.min_nodes}-{self.nodes}" if self.elastic else str(self.nodes)


PREFLIGHT_LEVELS = ("off", "basic", "full")


def _check_preflight(spec: PoolSpec) -> None:
    """The preflight fields, each named when wrong (the block turns the ValueError into PoolConfigError)."""
    if spec.preflight not in PREFLIGHT_LEVELS:
        raise ValueError(f"preflight: must be one of {', '.join(map(repr, PREFLIGHT_LEVELS))}, got {spec.preflight!r}")
    if not _number(spec.preflight_timeout_seconds) or not spec.preflight_timeout_seconds > 0:
        raise ValueError(f"preflight_timeout_seconds: must be more than 0, got {spec.preflight_timeout_seconds!r}")
    if not _number(spec.preflight_min_ratio) or not 0 <= spec.preflight_min_ratio <= 1:
        raise ValueError(f"preflight_min_ratio: must be between 0 and 1 (a share of the pool's median), "
                         f"got {spec.preflight_min_ratio!r}")
    for name in ("preflight_min_tflops", "preflight_min_gbps"):
        value = getattr(spec, name)
        if value is not None and (not _number(value) or not value > 0):
            raise ValueError(f"{name}: must be more than 0, or None for no floor, got {value!r}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # NaN is no number
