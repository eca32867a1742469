"""skytasks: multi-node PyTorch training as a normal Prefect task.

Names are imported on first use (PEP 562), so the node agent and rank processes, which import
`skytasks.node.agent` and `skytasks.node.worker`, do not pay for the controller's machinery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from skytasks.ephemeral_timeout import give_the_ephemeral_server_time

give_the_ephemeral_server_time()  # a first flow run on a small machine must not time out its server

_EXPORTS = {
    "GPUPool": "skytasks.blocks",
    "DistributedTask": "skytasks.task",
    "distributed_task": "skytasks.task",
    "DistributedTaskError": "skytasks.errors",
    "RankProcessDied": "skytasks.errors",
    "RemoteRankError": "skytasks.errors",
    "Checkpointer": "skytasks.checkpoint",
    "CheckpointError": "skytasks.errors",
    "HangError": "skytasks.errors",
    "PoolConfigError": "skytasks.errors",
    "PoolStartError": "skytasks.errors",
    "PoolTeardownError": "skytasks.errors",
    "RankFailure": "skytasks.errors",
    "ScriptFailed": "skytasks.errors",
    "ScriptResult": "skytasks.script",
    "run_script": "skytasks.script",
    "RankInfo": "skytasks.rank",
    "Preempted": "skytasks.preemption",
    "PreemptionNotice": "skytasks.preemption",
    "on_preemption": "skytasks.preemption",
    "rank_info": "skytasks.rank",
    "shard": "skytasks.sharding",
    "report": "skytasks.metrics",
    "stdout": "skytasks.output",
    "stderr": "skytasks.output",
    "silent": "skytasks.output",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from skytasks.blocks import GPUPool
    from skytasks.errors import (DistributedTaskError, HangError, PoolConfigError, PoolStartError, PoolTeardownError,
                                 RankFailure, RankProcessDied,
                                 RemoteRankError, ScriptFailed)
    from skytasks.checkpoint import Checkpointer
    from skytasks.errors import CheckpointError
    from skytasks.script import ScriptResult, run_script
    from skytasks.output import silent, stderr, stdout
    from skytasks.rank import RankInfo, rank_info
    from skytasks.preemption import Preempted, PreemptionNotice, on_preemption
    from skytasks.metrics import report
    from skytasks.sharding import shard
    from skytasks.task import DistributedTask, distributed_task


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'skytasks' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
