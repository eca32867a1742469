"""skytasks: multi-node PyTorch training as a normal Prefect task."""

from skytasks.errors import DistributedTaskError, RankProcessDied, RemoteRankError
from skytasks.output import silent, stderr, stdout
from skytasks.rank import RankInfo, rank_info
from skytasks.shard import shard
from skytasks.task import DistributedTask, distributed_task

__all__ = [
    "DistributedTask",
    "DistributedTaskError",
    "RankInfo",
    "RankProcessDied",
    "RemoteRankError",
    "distributed_task",
    "rank_info",
    "shard",
    "silent",
    "stderr",
    "stdout",
]
