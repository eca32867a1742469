"""Elastic node counts and preemption notices, on local pools (real agents, ranks, gloo groups).

`GPUPool(nodes=N, min_nodes=M)`: the pool runs on what it has between the two. A lost node of an
elastic pool is dropped and the retry runs on the nodes that are left (renumbered, a smaller
world); the pool grows back before the next call. A preemption notice (SIGUSR2 to a node's agent,
as SLURM's `--signal` sends it) reaches every rank at once, and `save_if_preempted` saves and ends
the attempt.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from skytasks import Checkpointer, GPUPool, distributed_task, rank_info
from skytasks.errors import DistributedTaskError
from skytasks.events import (AttemptRestarted, NodeLost, NodePreempted, NodeReplaced, PoolGrew, PoolShrank,
                             listen)
from tests.harness.workloads import resume


def of(kind, heard):
    return [e for e in heard if isinstance(e, kind)]


def kill_node_1_once(marker: str) -> dict:
    import torch.distributed as dist

    info = rank_info()
    if info.node_rank == 1 and not os.path.exists(marker):
        Path(marker).write_text(str(os.getppid()))
        time.sleep(0.3)
        os.kill(os.getppid(), signal.SIGKILL)  # the node agent: the whole node is gone
        time.sleep(60)
    dist.barrier()
    return {"attempt": info.attempt, "world": info.world_size, "node": info.node_rank, "agent": os.getppid()}


def test_an_elastic_pool_with_no_retries_goes_on_with_the_nodes_left_then_grows_back_before_the_next_call(
        capsys, tmp_path):
    """retries=0 (the default): a node killed mid-call is the pool's loss, not the code's failure,
    so the call finishes on the nodes left, from `node_recoveries`."""
    pool = GPUPool(nodes=3, min_nodes=2)
    task = distributed_task(kill_node_1_once, pool=pool)
    with pool:
        with listen() as during:
            shrunk = task(str(tmp_path / "killed"))
        with listen() as after:
            grown = task(str(tmp_path / "killed"))
    # The next attempt: 2 nodes, node ranks 0 and 1 again (the old node 2 is node 1 now).
    assert [(r["attempt"], r["world"], r["node"]) for r in shrunk] == [(2, 2, 0), (2, 2, 1)]
    killed_agent = int((tmp_path / "killed").read_text())
    assert killed_agent not in {r["agent"] for r in shrunk}
    [lost] = of(NodeLost, during)
    assert (lost.node, lost.address) == (1, "127.0.0.1")
    [restarted] = of(AttemptRestarted, during)
    assert (restarted.attempt, restarted.reason, restarted.charged) == (1, "node lost", "node_recoveries")
    assert (restarted.retries_left, restarted.node_recoveries_left) == (0, 2)
    [shrank] = of(PoolShrank, during)
    assert (shrank.from_nodes, shrank.to_nodes) == (3, 2) and "node 1 (127.0.0.1) was lost" in shrank.reason
    assert "goes on with the 2 nodes left, 2 ranks" in capsys.readouterr().err  # the console renders it
    # The next call starts on the full pool again, a fresh group of 3 ranks.
    assert [(r["attempt"], r["world"]) for r in grown] == [(1, 3)] * 3
    [grew] = of(PoolGrew, after)
    assert (grew.from_nodes, grew.to_nodes, grew.ranks) == (2, 3, 3)


def checkpoint_every_step(ckpt_dir: str, marker: str, steps: int = 30) -> dict:
    """A loop that saves every step; node 1's agent is killed at step 5 of attempt 1, no notice."""
    import torch
    import torch.distributed as dist

    info = rank_info()
    ckpt, found, start = resume(ckpt_dir)
    for step in range(start, steps):
        dist.all_reduce(torch.ones(1))
        ckpt.save({"step": step, "world": info.world_size}, step)
        dist.barrier()
        if step == 5 and info.node_rank == 1 and not os.path.exists(marker):
            Path(marker).write_text("killed")
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(60)
    return {"attempt": info.attempt, "world": info.world_size, "start": start,
            "saved_by": None if found is None else found[1]["world"]}


def test_a_node_killed_without_notice_the_retry_resumes_from_the_checkpoint_on_fewer_ranks(tmp_path):
    out = distributed_task(checkpoint_every_step, pool=GPUPool(nodes=2, min_nodes=1))(
        str(tmp_path / "ckpt"), str(tmp_path / "killed"))
    # Saved by 2 ranks up to step 5, loaded by the 1 rank left, which goes on from step 6.
    assert out == [{"attempt": 2, "world": 1, "start": 6, "saved_by": 2}]


def test_below_min_nodes_a_lost_node_is_replaced_and_a_fixed_pool_never_shrinks(capsys, tmp_path):
    """At the floor (2 of 2-3 here, and any fixed pool) a lost node is replaced, not dropped."""
    pool = GPUPool(nodes=2, min_nodes=2)
    with listen() as heard:
        out = distributed_task(kill_node_1_once, pool=pool)(str(tmp_path / "killed"))
    assert [(r["attempt"], r["world"]) for r in out] == [(2, 2), (2, 2)]
    [replaced] = of(NodeReplaced, heard)
    assert replaced.node == 1 and replaced.why == "was lost" and not of(PoolShrank, heard)
    assert "replaced by a new node" in capsys.readouterr().err


def train_steps(ckpt_dir: str, marker: str, steps: int = 60) -> dict:
    """A loop that checks for a notice every step; node 1's rank sends its agent the notice."""
    import torch
    import torch.distributed as dist

    from skytasks.preemption import on_preemption

    info = rank_info()
    heard: list = []
    on_preemption(heard.append)
    ckpt, found, start = resume(ckpt_dir)
    for step in range(start, steps):
        dist.all_reduce(torch.ones(1))
        if step == 5 and info.node_rank == 1 and info.local_rank == 0 and not os.path.exists(marker):
            Path(marker).write_text(f"{time.time()!r}")
            os.kill(os.getppid(), signal.SIGUSR2)  # as SLURM's --signal=USR2 reaches the node agent
        ckpt.save_if_preempted({"step": step, "world": info.world_size}, step)
        time.sleep(0.05)
    return {"attempt": info.attempt, "world": info.world_size, "start": start, "preempted": info.preempted,
            "hooks": len(heard)}


def test_a_notice_reaches_every_rank_the_head_saves_and_the_retry_resumes_on_the_nodes_left(capsys, tmp_path):
    ckpt_dir, marker = tmp_path / "ckpt", tmp_path / "noticed"
    pool = GPUPool(nodes=2, min_nodes=1, procs_per_node=2)
    with listen() as heard:
        out = distributed_task(train_steps, pool=pool)(str(ckpt_dir), str(marker))
    err = capsys.readouterr().err
    # Attempt 1 ended at the head's save; attempt 2 ran on node 0's 2 ranks from the step after it.
    [saved] = Checkpointer(ckpt_dir).steps()  # the head's save at the notice, the only one
    assert [(r["attempt"], r["world"]) for r in out] == [(2, 2), (2, 2)]
    assert out[0]["start"] == saved + 1 and saved >= 5 and not out[0]["preempted"]  # fresh ranks, no notice
    noticed_at = float(marker.read_text())
    on_disk = os.stat(ckpt_dir / f"step-{saved:012d}.pt").st_mtime
    print(f"notice to checkpoint on disk: {(on_disk - noticed_at) * 1000:.0f} ms")
    assert 0 < on_disk - noticed_at < 5.0  # at the next step, not when the node goes
    [notice] = of(NodePreempted, heard)
    assert (notice.node, notice.address, notice.source) == (1, "127.0.0.1", "SIGUSR2 reached the node agent")
    [restarted] = of(AttemptRestarted, heard)
    assert (restarted.reason, restarted.charged, restarted.retries_left) == ("preempted", "node_recoveries", 0)
    assert "Preempted" in restarted.cause and "checkpoint of step" in restarted.cause
    [shrank] = of(PoolShrank, heard)
    assert (shrank.from_nodes, shrank.to_nodes) == (2, 1) and "was preempted (SIGUSR2" in shrank.reason
    assert "goes on with the 1 node left, 2 ranks" in err and "after the notice" in err, err


def report_the_notice(marker: str, target: str = "agent") -> dict:
    """Every rank waits for the notice node 1 asks for: the flag, the hook, and how long it took."""
    from skytasks.preemption import on_preemption, preemption

    info = rank_info()
    heard: list = []
    on_preemption(heard.append)
    if info.rank == 3:
        Path(marker).write_text(f"{time.time()!r}")
        os.kill(os.getppid() if target == "agent" else os.getpid(), signal.SIGUSR2)
    deadline = time.time() + 20
    while not rank_info().preempted and time.time() < deadline:
        time.sleep(0.001)
    got = time.time()
    while not heard and time.time() < deadline:
        time.sleep(0.01)
    notice = preemption()
    return {"preempted": rank_info().preempted, "node": notice.node_rank, "hooks": len(heard), "at": got}


@pytest.mark.parametrize("target", ["agent", "rank"])
def test_every_rank_of_every_node_hears_a_notice_at_once_with_its_hook_called_once(tmp_path, target):
    """SIGUSR2 to a node's agent, or to one rank of it (SLURM signals every process of a step):
    either way it is that node's notice, for every rank of every node."""
    marker = tmp_path / "sent"
    pool = GPUPool(nodes=2, procs_per_node=2)
    with pool:
        out = distributed_task(report_the_notice, pool=pool)(str(marker), target)
    sent = float(marker.read_text())
    assert [(r["preempted"], r["node"], r["hooks"]) for r in out] == [(True, 1, 1)] * 4
    slowest = max(r["at"] for r in out) - sent
    print(f"notice to the last rank: {slowest * 1000:.1f} ms")
    assert slowest < 5.0  # at once, not at the node's end


def test_min_nodes_is_checked_before_anything_starts():
    with pytest.raises(ValueError, match="min_nodes: 3 is more than nodes=2"):
        GPUPool(nodes=2, min_nodes=3)
    with pytest.raises(ValueError, match="min_nodes"):
        GPUPool(nodes=2, min_nodes=0)
    spec = GPUPool(nodes=4, min_nodes=2).spec()
    assert (spec.min_nodes, spec.nodes, spec.node_count, spec.elastic) == (2, 4, "2-4", True)
    assert GPUPool(nodes=2).spec().min_nodes == 2  # unset: exactly `nodes`


def test_an_elastic_ssh_pool_starts_with_the_hosts_that_answer_and_says_why_not_more(tmp_path):
    from tests.harness.sshd import SSHServer, free_port

    server = SSHServer(tmp_path / "sshd", ["127.0.0.1"], free_port())  # 127.0.0.2 has no sshd
    hosts = [f"root@127.0.0.1:{server.port}", f"root@127.0.0.2:{server.port}"]
    common = dict(provider="ssh", nodes=2, hosts=hosts, ssh_private_key=server.client_key,
                  known_hosts=server.known_hosts(), remote_python=sys.executable)
    try:
        pool = GPUPool(min_nodes=1, **common)
        with pool:
            said = pool.runtime().session.provider._reporter.lines
            out = distributed_task(lambda: (rank_info().world_size, rank_info().head_addr), pool=pool)()
        assert out == [(1, "127.0.0.1")]
        assert any("starting with 1 of 2 hosts" in line and "127.0.0.2" in line for line in said), said
        with pytest.raises(Exception, match="127.0.0.2"):  # a fixed pool still needs every host
            with GPUPool(**common):
                pass
    finally:
        server.stop()


def test_a_notice_between_calls_keeps_the_going_node_out_of_the_next_group(tmp_path, capsys):
    pool = GPUPool(nodes=2, min_nodes=1)
    task = distributed_task(lambda: (rank_info().world_size, os.getppid()), pool=pool)
    with pool, listen() as heard:
        first = task()
        os.kill(first[1][1], signal.SIGUSR2)  # node 1's agent
        deadline = time.monotonic() + 10
        while pool.runtime().session.nodes[1].notice is None and time.monotonic() < deadline:
            time.sleep(0.05)
        second = task()
    assert [w for w, _ in first] == [2, 2]
    # The going node is left out; the pool grows back with a fresh node in its place at once.
    assert [w for w, _ in second] == [2, 2] and first[1][1] not in {a for _, a in second}
    [notice] = of(NodePreempted, heard)  # said once, by the session, though no call was running
    assert notice.node == 1
    [shrank], [grew] = of(PoolShrank, heard), of(PoolGrew, heard)
    assert (shrank.from_nodes, shrank.to_nodes, grew.from_nodes, grew.to_nodes) == (2, 1, 1, 2)


def test_with_no_node_recovery_left_a_preempted_attempt_is_the_callers_error_naming_the_node(tmp_path):
    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(train_steps, pool=GPUPool(nodes=2, min_nodes=1), node_recoveries=0)(
            str(tmp_path / "c"), str(tmp_path / "m"))
    [exc] = caught.value.exceptions
    assert type(exc).__name__ == "Preempted" and "node 1 (127.0.0.1) is being preempted" in str(exc)
    # No retry is left: nothing promises one; the note says how to resume.
    assert "the retry resumes" not in str(exc)
    assert any("no node recoveries are left" in n and "load_latest()" in n for n in caught.value.__notes__)

