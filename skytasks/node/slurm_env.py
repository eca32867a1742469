"""SLURM's task variables, per rank, as `srun` with one task per rank would set them.

A node agent on a slurm pool runs as one SLURM step task (`srun --overlap -w NODE`), so every rank
it starts would inherit that task's `SLURM_PROCID=0`, `SLURM_NTASKS=1`, `SLURM_LOCALID=0`. SLURM-aware
code reads those before torchrun's variables: Lightning's `SLURMEnvironment` then made every rank
rank 0 of 1, each training alone. Here each rank gets the task variables of its own place in the
call, and the step's shape is the pool's (its nodes, its ranks per node). Job-level variables
(`SLURM_JOB_ID`, `SLURM_JOB_NODELIST`, ...) stay as SLURM set them: they describe the allocation.
Standard library only: the agent imports this.
"""

from __future__ import annotations

from collections.abc import Mapping

from skytasks.rank import ENV_NUM_NODES


def slurm_task_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The SLURM task variables for the rank whose environment is `env` (the agent's own, with the
    rank's on top); nothing when the agent does not run inside a SLURM job."""
    if "SLURM_JOB_ID" not in env or "RANK" not in env:
        return {}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    local, per_node = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    node = int(env["NODE_RANK"])
    nodes = int(env.get(ENV_NUM_NODES) or max(1, world // max(1, per_node)))
    first = rank - local  # ranks are placed node by node: this node holds first .. first + per_node - 1
    tasks_per_node = f"{per_node}(x{nodes})" if nodes > 1 else str(per_node)
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(world),
        "SLURM_NPROCS": str(world),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": tasks_per_node,
        "SLURM_NNODES": str(nodes),
        "SLURM_STEP_NUM_TASKS": str(world),
        "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": tasks_per_node,
        "SLURM_GTIDS": ",".join(str(r) for r in range(first, first + per_node)),
    }
