"""Where a rank stands: the environment a rank process is given and `rank_info()` that reads it.

The torch names (MASTER_ADDR, RANK, ...) are what `init_process_group(init_method="env://")`
and ordinary DDP code read; the SKYTASKS_* names carry the rest of `RankInfo`. Everything is
plain environment so that code which shells out (or a torchrun-style script) sees the same.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping

from skytasks.preemption import preemption

ENV_RANK = "SKYTASKS_RANK"
ENV_NUM_NODES = "SKYTASKS_NUM_NODES"
ENV_PEERS = "SKYTASKS_PEERS"
ENV_ACCELERATORS = "SKYTASKS_ACCELERATORS"
ENV_ATTEMPT = "SKYTASKS_ATTEMPT"
ENV_DEVICE = "SKYTASKS_DEVICE"


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    head_addr: str
    head_port: int
    peers: tuple[str, ...]
    accelerators: int
    attempt: int
    device: str = "cpu"  # "cuda:<i>" when this rank has a GPU (its own or shared), else "cpu"
    # A node of the pool will be taken away soon (skytasks.preemption): save, the attempt ends.
    preempted: bool = False

    @property
    def is_head(self) -> bool:
        return self.rank == 0


def rank_environment(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    peers: tuple[str, ...],
    head_port: int,
    accelerators: int,
) -> dict[str, str]:
    """The environment one rank process starts with (the attempt is set per call)."""
    return {
        "MASTER_ADDR": peers[0],
        "MASTER_PORT": str(head_port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
        # torchrun's name for the node rank; some libraries read it.
        "GROUP_RANK": str(node_rank),
        ENV_RANK: str(rank),
        ENV_NUM_NODES: str(len(peers)),
        ENV_PEERS: json.dumps(list(peers)),
        ENV_ACCELERATORS: str(accelerators),
        ENV_ATTEMPT: "1",
    }


def in_rank(environ: Mapping[str, str] | None = None) -> bool:
    return ENV_RANK in (os.environ if environ is None else environ)


def rank_info() -> RankInfo:
    """This process's place in the distributed call. Only valid inside a rank."""
    env = os.environ
    if not in_rank(env):
        raise RuntimeError(
            "rank_info() was called outside a skytasks rank: it only works inside a function "
            "that @distributed_task runs on a rank (for example in the body of your train function)."
        )
    peers = tuple(json.loads(env[ENV_PEERS]))
    return RankInfo(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env["LOCAL_RANK"]),
        local_world_size=int(env["LOCAL_WORLD_SIZE"]),
        node_rank=int(env["NODE_RANK"]),
        num_nodes=int(env[ENV_NUM_NODES]),
        head_addr=env["MASTER_ADDR"],
        head_port=int(env["MASTER_PORT"]),
        peers=peers,
        accelerators=int(env[ENV_ACCELERATORS]),
        attempt=int(env.get(ENV_ATTEMPT, "1")),
        device=env.get(ENV_DEVICE, "cpu"),
        preempted=preemption() is not None,
    )
