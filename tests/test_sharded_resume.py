"""The example FSDP2 training (flows/fsdp_train.py) on an elastic 2 x 2 local pool loses a node, or
gets a preemption notice, mid-training: the same call goes on with the node left (2 ranks), from the
last committed sharded checkpoint, its loss going on from where it was rather than from step 0."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

from flows.fsdp_train import train
from skytasks import Checkpointer, GPUPool, rank_info
from skytasks.events import AttemptRestarted, PoolShrank, listen

STEPS, SAVE_EVERY = 20, 5


def lose_node_1(checkpoint_dir: str, marker: str, at: int, step: int) -> None:
    """At step `at` of attempt 1, node 1's agent is killed (the whole node is gone), once the
    checkpoint before it is committed: which one a resume must find is then known."""
    info = rank_info()
    if step != at or info.node_rank != 1 or info.local_rank != 0 or os.path.exists(marker):
        return
    committed = Path(checkpoint_dir, f"step-{at - at % SAVE_EVERY - 1:012d}", "COMMITTED")
    deadline = time.time() + 30
    while not committed.exists() and time.time() < deadline:
        time.sleep(0.05)
    Path(marker).write_text("killed")
    os.kill(os.getppid(), signal.SIGKILL)
    time.sleep(60)


def notice_on_node_1(marker: str, at: int, step: int) -> None:
    """At step `at` of attempt 1, node 1 gets a preemption notice, as SLURM's --signal=USR2 sends it."""
    info = rank_info()
    if step == at and info.node_rank == 1 and info.local_rank == 0 and not os.path.exists(marker):
        Path(marker).write_text("noticed")
        os.kill(os.getppid(), signal.SIGUSR2)


def assert_the_loss_went_on(result: dict, restored: int) -> None:
    losses = result["losses"]
    assert len(losses) == STEPS  # the history up to the checkpoint came back with it
    first, before, after = losses[0], losses[restored], losses[restored + 1]
    # Nearer where it was than where it started: a restart from step 0 would be back near `first`.
    assert after < first - 0.5 * (first - before), losses
    assert losses[-1] < before


def test_a_lost_node_the_same_call_resumes_from_the_last_committed_checkpoint_on_fewer_ranks(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    pool = GPUPool(nodes=2, procs_per_node=2, min_nodes=1)
    disrupt = functools.partial(lose_node_1, ckpt_dir, str(tmp_path / "killed"), 12)
    with listen() as heard:
        out = train.with_options(pool=pool)(Path("flows/data/sonnets.txt").read_text(), steps=STEPS,
                                            save_every=SAVE_EVERY, checkpoint_dir=ckpt_dir, disrupt=disrupt)
    assert [(r["attempt"], r["world"], r["restored"], r["start"]) for r in out] == [(2, 2, 9, 10)] * 2
    assert_the_loss_went_on(out[0], 9)
    assert any(isinstance(e, PoolShrank) for e in heard)
    assert Checkpointer(ckpt_dir).committed_steps() == [14, 19]  # keep=2


def test_a_preemption_notice_saves_at_once_and_the_call_resumes_from_it_on_the_node_left(tmp_path):
    ckpt_dir = str(tmp_path / "ckpt")
    pool = GPUPool(nodes=2, procs_per_node=2, min_nodes=1)
    disrupt = functools.partial(notice_on_node_1, str(tmp_path / "noticed"), 7)
    with listen() as heard:
        out = train.with_options(pool=pool)(Path("flows/data/sonnets.txt").read_text(), steps=STEPS,
                                            save_every=SAVE_EVERY, checkpoint_dir=ckpt_dir, disrupt=disrupt)
    restored = out[0]["restored"]
    assert restored is not None and 7 <= restored < 12 and restored != 9  # the notice's own save, not step 9's
    assert [(r["attempt"], r["world"], r["start"]) for r in out] == [(2, 2, restored + 1)] * 2
    assert_the_loss_went_on(out[0], restored)
    [restarted] = [e for e in heard if isinstance(e, AttemptRestarted)]
    assert restarted.reason == "preempted" and "committed at" in restarted.cause
