"""Preemption figures on an elastic local pool (2 nodes x 2 ranks, min_nodes=1): from a node's
notice (SIGUSR2 to its agent, as SLURM's `--signal=USR2@...` or the spot watchdog gives it) to
every rank knowing, to the head's checkpoint on disk (`save_if_preempted`), and to the retry's
ranks running on the node that is left.

Absolute seconds: torchrun has no notice at all. Its agent hears SIGTERM when the node is already
going, and a restart waits for the rendezvous' last-call timeout (30 s by default) before it runs
on fewer nodes. The notice itself is two minutes on EC2 spot and `--signal`'s lead on SLURM: every
figure here is spent out of that.
"""

from __future__ import annotations

import os
import signal
import statistics
import tempfile
import time
from pathlib import Path


def train_until_noticed(ckpt_dir: str, marker_dir: str, steps: int = 400) -> dict:
    import torch
    import torch.distributed as dist

    from skytasks import Checkpointer, rank_info
    from skytasks.preemption import on_preemption

    info = rank_info()
    # When this rank knows: a hook runs at once on a thread of its own, whatever the loop is doing.
    on_preemption(lambda notice: Path(marker_dir, f"heard{info.rank}").write_text(repr(time.time())))
    ckpt = Checkpointer(ckpt_dir)
    found = ckpt.load_latest()
    started_at = time.time()
    start = 0 if found is None else found[0] + 1
    for step in range(start, steps if found is None else start + 1):
        dist.all_reduce(torch.ones(1))
        if step == 20 and info.node_rank == 1 and info.local_rank == 0:
            Path(marker_dir, "sent").write_text(repr(time.time()))
            os.kill(os.getppid(), signal.SIGUSR2)
        ckpt.save_if_preempted({"step": step, "weights": torch.zeros(1 << 20)}, step)  # a 4 MB state
        time.sleep(0.01)
    return {"attempt": info.attempt, "world": info.world_size, "started_at": started_at}


def one_notice() -> dict:
    from skytasks import GPUPool, distributed_task

    work = Path(tempfile.mkdtemp(prefix="skytasks-bench-preempt-"))
    ckpt_dir = work / "ckpt"
    pool = GPUPool(nodes=2, min_nodes=1, procs_per_node=2)
    out = distributed_task(train_until_noticed, pool=pool, retries=1)(str(ckpt_dir), str(work))
    assert [(r["attempt"], r["world"]) for r in out] == [(2, 2), (2, 2)], out
    sent = float((work / "sent").read_text())
    heard = [float(p.read_text()) for p in work.glob("heard*")]
    assert len(heard) == 4, heard  # every rank of attempt 1, the preempted node's too
    [saved] = list(ckpt_dir.glob("step-*.pt"))
    return {"every_rank_s": max(heard) - sent, "checkpoint_on_disk_s": saved.stat().st_mtime - sent,
            "retry_running_s": min(r["started_at"] for r in out) - sent}


def preemption(repeats: int) -> dict:
    runs = [one_notice() for _ in range(max(repeats, 3))]
    return {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}
