"""Checkpointer: the head saves atomically, every rank resumes from the newest complete one."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.checkpoint import Checkpointer
from tests.conftest import moto_bucket

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10


def train_with_checkpoints(path: str, fail_at: int | None) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from skytasks import Checkpointer

    info = rank_info()
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(path, keep=3)
    found = ckpt.load_latest()
    start = 0
    if found is not None:
        step, state = found
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = step + 1
    for step in range(start, STEPS):
        g = torch.Generator().manual_seed(1000 * step + info.rank)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ckpt.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, step)
        dist.barrier()  # the head's save of this step is done before anyone goes on
        if info.attempt == 1 and info.rank == 1 and step == fail_at:
            raise RuntimeError(f"rank 1 fails at step {step} on attempt 1")
    return {"attempt": info.attempt, "started_at": start,
            "weights": [round(v, 6) for v in model.module.weight.detach().flatten().tolist()]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The same training, never interrupted: what every resumed run must end with."""
    where = tmp_path_factory.mktemp("clean")
    return distributed_task(train_with_checkpoints, pool=GPUPool(nodes=2))(str(where), None)[0]


def test_a_failed_attempt_resumes_from_the_newest_local_checkpoint(tmp_path, uninterrupted):
    where = tmp_path / "ckpt"
    results = distributed_task(train_with_checkpoints, pool=GPUPool(nodes=2), retries=1)(str(where), 5)
    assert [(r["attempt"], r["started_at"]) for r in results] == [(2, 6), (2, 6)]
    assert results[0]["weights"] == results[1]["weights"] == uninterrupted["weights"]
    assert sorted(p.name for p in where.iterdir()) == [f"step-{s:012d}.pt" for s in (7, 8, 9)]  # keep=3
    assert Checkpointer(where).steps() == [7, 8, 9]


@pytest.fixture(scope="module")
def s3(moto):
    return moto_bucket(moto, "ckpts")


def test_resume_from_s3_with_the_pools_aws_credentials(s3, uninterrupted):
    pool = GPUPool(nodes=2, aws_credentials=s3["creds"])
    results = distributed_task(train_with_checkpoints, pool=pool, retries=1)("s3://ckpts/runs/tiny", 5)
    assert [(r["attempt"], r["started_at"]) for r in results] == [(2, 6), (2, 6)]
    assert results[0]["weights"] == uninterrupted["weights"]
    keys = [o["Key"] for o in s3["client"].list_objects_v2(Bucket="ckpts", Prefix="runs/tiny/")["Contents"]]
    assert sorted(keys) == [f"runs/tiny/step-{s:012d}.pt" for s in (7, 8, 9)]


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint_newest(tmp_path):
    # The child writes step 2 completely under its temporary name, then is killed before the
    # rename (it is held in fsync): exactly what a kill mid-write can leave behind.
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        from skytasks.checkpoint import Checkpointer
        ckpt = Checkpointer({str(tmp_path)!r})
        ckpt.save({{"w": torch.ones(3)}}, 1)
        real_fsync = os.fsync
        def stuck(fd):
            real_fsync(fd)
            print("written", flush=True)
            time.sleep(120)
        os.fsync = stuck
        ckpt.save({{"w": torch.full((1000, 1000), 2.0)}}, 2)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "written"
        assert any(p.name.endswith(".partial") for p in tmp_path.iterdir())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.steps() == [1]
    step, state = ckpt.load_latest()
    assert step == 1 and state["w"].tolist() == [1.0, 1.0, 1.0]


def test_only_the_head_writes_and_bad_arguments_are_named(tmp_path, monkeypatch):
    import torch

    from skytasks.rank import rank_environment

    with pytest.raises(ValueError, match="^keep:"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="^path:"):
        Checkpointer("s3:///prefix")
    with pytest.raises(ValueError, match="^step:"):
        Checkpointer(tmp_path).save({}, -1)
    for k, v in rank_environment(rank=1, world_size=2, local_rank=0, local_world_size=1, node_rank=1,
                                 peers=("127.0.0.1", "127.0.0.1"), head_port=1, accelerators=0).items():
        monkeypatch.setenv(k, v)
    assert Checkpointer(tmp_path).save({"w": torch.ones(1)}, 3) is None  # rank 1: a no-op
    assert list(tmp_path.iterdir()) == [] and Checkpointer(tmp_path).load_latest() is None


def load_and_say_what_failed(path: str) -> tuple[str, str]:
    from skytasks import Checkpointer

    try:
        return "loaded", repr(Checkpointer(path).load_latest())
    except Exception as exc:  # noqa: BLE001 - what each rank met is the point
        return type(exc).__name__, str(exc)


def test_a_head_that_cannot_read_the_checkpoint_tells_the_other_ranks(tmp_path):
    import torch

    Checkpointer(tmp_path).save({"w": torch.ones(1)}, 1)
    (tmp_path / "step-000000000002.pt").mkdir()  # the newest name, unreadable as a file
    head, other = distributed_task(load_and_say_what_failed, pool=GPUPool(nodes=2), timeout_seconds=60)(str(tmp_path))
    assert head[0] == "IsADirectoryError"
    assert other == ("RuntimeError", "Checkpointer.load_latest: the head could not read the newest checkpoint "
                                     "(its error is rank 0's)")
