"""Recovery figures: a lost node back to a running retry, and a hang detected to the caller's error.

Absolute seconds: torchrun has no counterpart for either (it cannot replace a lost node, and it
reports a hang only when the collective's own timeout fires, 10 to 30 minutes later).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

def lose_a_node(marker_dir: str) -> float:
    import torch.distributed as dist

    from skytasks import rank_info

    lost = os.path.join(marker_dir, "lost")
    if rank_info().rank == 1 and not os.path.exists(lost):
        with open(lost, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getppid(), signal.SIGKILL)  # the node agent: the node is gone
        time.sleep(60)
    dist.barrier()
    return time.time()


def go_quiet(marker_dir: str) -> None:
    import torch.distributed as dist

    from skytasks import rank_info

    with open(os.path.join(marker_dir, f"quiet{rank_info().rank}"), "w") as f:
        f.write(repr(time.time()))
    if rank_info().rank == 0:
        dist.barrier()
    time.sleep(600)


def skytasks_replace_s() -> float:
    from skytasks import GPUPool
    from skytasks import distributed_task

    pool = GPUPool(nodes=2)
    with tempfile.TemporaryDirectory() as out, pool:
        task = distributed_task(lose_a_node, pool=pool, retries=1)
        warm = Path(out, "warm")
        warm.mkdir()
        (warm / "lost").write_text("0")  # lost already: this call only warms the group
        task(str(warm))
        back = task(out)
        return min(back) - float(Path(out, "lost").read_text())


def hang_detect_to_error_s(hang_timeout: float = 4.0) -> float:
    from skytasks import GPUPool
    from skytasks import DistributedTaskError, distributed_task

    with tempfile.TemporaryDirectory() as out:
        try:
            distributed_task(go_quiet, pool=GPUPool(nodes=2), hang_timeout_seconds=hang_timeout)(out)
        except DistributedTaskError:
            seen = time.time()
        quiet = max(float(Path(out, f"quiet{r}").read_text()) for r in range(2))
        return seen - (quiet + hang_timeout)


def recovery(repeats: int) -> dict:
    replace = statistics.median(skytasks_replace_s() for _ in range(repeats))
    hang = statistics.median(hang_detect_to_error_s() for _ in range(repeats))
    return {"lost_node_to_retry_running_s": replace, "hang_detected_to_error_s": hang}


if __name__ == "__main__":
    print(json.dumps(recovery(1), indent=2))
