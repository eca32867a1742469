"""The options of a distributed call, once: one frozen, validated `CallOptions` behind
`@distributed_task`, `.with_options`, `run_script` and `skytasks run`.

Validated at construction, naming the option: a bad option is refused when the task is
decorated (or the script called), before anything launches.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from skytasks.errors import PoolConfigError

BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
RANK_RUNS = ("rank", "node", "head")  # what a call records in Prefect: a task run per rank, per node, or the head's
RANK_RUNS_PER_RANK_UP_TO = 64  # the default: a run per rank up to this many ranks, a run per node above


def rank_runs_for(choice: str | None, world_size: int) -> str:
    """The `rank_runs` a call of `world_size` ranks records."""
    if choice is not None:
        return choice
    return "rank" if world_size <= RANK_RUNS_PER_RANK_UP_TO else "node"


@dataclass(frozen=True)
class CallOptions:
    name: str = "distributed_task"  # the parent task run's name, and every rank run's prefix
    pool: Any = None  # a GPUPool, a saved block's name, or None (the active pool, else a local one)
    nodes: int | None = None
    procs_per_node: int | None = None
    backend: str | None = None
    init_torch: bool = True
    runs_script: bool = False  # run_script of a file: each rank forks its script with the node's torch, where it can
    timeout_seconds: float | None = None  # per attempt, as a Prefect task's
    hang_timeout_seconds: float | None = None
    retries: int = 0  # the code's own failures (a rank raising or dying, a hang, a timeout)
    retry_delay_seconds: float = 0
    node_recoveries: int = 3  # restarts after a node lost or preempted: never charged to retries
    rank_runs: str | None = None  # "rank", "node" or "head"; None: "rank" up to 64 ranks, "node" above
    workdir: str | os.PathLike | None = None
    tags: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("nodes", "procs_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise PoolConfigError(f"{name}: must be an integer ≥ 1, got {value!r}")
        for name in ("timeout_seconds", "hang_timeout_seconds"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not value > 0):
                raise PoolConfigError(f"{name}: must be > 0 or None, got {value!r}")
        for name in ("retries", "node_recoveries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise PoolConfigError(f"{name}: must be an integer ≥ 0, got {value!r}")
        if not isinstance(self.retry_delay_seconds, (int, float)) or self.retry_delay_seconds < 0:
            raise PoolConfigError(f"retry_delay_seconds: must be ≥ 0, got {self.retry_delay_seconds!r}")
        if self.rank_runs is not None and self.rank_runs not in RANK_RUNS:
            raise PoolConfigError(f"rank_runs: expected one of {', '.join(map(repr, RANK_RUNS))} or None, "
                                  f"got {self.rank_runs!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise PoolConfigError(f"backend: unknown torch.distributed backend {self.backend!r}")
        if self.workdir is not None and not isinstance(self.workdir, (str, os.PathLike)):
            raise PoolConfigError(f"workdir: expected a directory path, got {type(self.workdir).__qualname__}")
        if isinstance(self.tags, str) or not all(isinstance(t, str) for t in self.tags):
            raise PoolConfigError(f"tags: expected a collection of strings, got {self.tags!r}")
        object.__setattr__(self, "tags", tuple(self.tags))
        object.__setattr__(self, "init_torch", bool(self.init_torch))
        object.__setattr__(self, "runs_script", bool(self.runs_script))

    @property
    def label(self) -> str:
        return self.name

    def replace(self, **changes: Any) -> CallOptions:
        known = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise TypeError(f"with_options: unknown option(s) {unknown}; known: {known}")
        return dataclasses.replace(self, **changes)
