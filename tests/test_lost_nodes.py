"""A lost node is replaced before the retry: the next attempt runs on a full pool."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from skytasks import DistributedTaskError, GPUPool, distributed_task, rank_info
from skytasks.errors import PoolStartError


def kill_my_agent_once(marker: str) -> dict:
    import torch.distributed as dist

    info = rank_info()
    if info.rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        time.sleep(0.5)
        os.kill(os.getppid(), signal.SIGKILL)  # the node agent: the whole node is gone
        time.sleep(60)
    dist.barrier()
    return {"attempt": info.attempt, "agent": os.getppid()}


def test_a_lost_local_node_is_replaced_and_the_retry_succeeds(capsys, tmp_path):
    pool = GPUPool(nodes=2)
    task = distributed_task(kill_my_agent_once, pool=pool, retries=1)
    with pool:
        agents_before = {n.link.node_rank: n for n in pool.runtime().session.nodes}
        results = task(str(tmp_path / "killed"))
        again = task(str(tmp_path / "killed"))  # the pool stays whole for later calls too
    assert [r["attempt"] for r in results] == [2, 2]
    assert [r["attempt"] for r in again] == [1, 1]
    err = capsys.readouterr().err
    assert "node 1 (127.0.0.1) was lost; replaced by a new node" in err
    assert "lost the agent of node 1" in err  # the attempt's failure, as the retry line shows
    assert results[1]["agent"] == again[1]["agent"] != 0
    assert agents_before[1].alive is False


def freeze_my_agent_once(marker: str) -> int:
    info = rank_info()
    if info.rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getppid(), signal.SIGSTOP)  # the node agent hangs: it can hear nothing, say nothing
        time.sleep(60)
    return info.attempt


def test_a_frozen_node_is_replaced_without_waiting_for_it_to_end_on_its_own(capsys, tmp_path, monkeypatch):
    """A node found lost cannot hear the EOF that asks a healthy agent to end: its transport is let
    go at once (here SIGKILL after 1 s, not 10), so the replacement does not wait on it."""
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_SECONDS", "0.5")
    # Also how long the new agent has to say hello: 3 s was too little for a fresh interpreter on
    # a loaded CI machine. 1 s for the frozen one plus up to 6 s for the new one stays under 8.
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS", "6")
    pool = GPUPool(nodes=2)
    with pool:
        frozen = next(n for n in pool.runtime().session.nodes if n.link.node_rank == 1)
        attempts = distributed_task(freeze_my_agent_once, pool=pool, init_torch=False)(str(tmp_path / "frozen"))
    assert attempts == [2, 2]
    err = capsys.readouterr().err
    [line] = [x for x in err.splitlines() if "was lost; replaced by a new node" in x]
    assert "no heartbeat from the node for 6s" in err
    replaced_in = float(line.rsplit(" in ", 1)[1].rstrip("s"))
    assert replaced_in < 8, line  # a graceful end would have waited 10 s for the frozen agent alone
    assert frozen.alive is False


def test_with_no_node_recoveries_the_loss_is_the_error(tmp_path):
    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(kill_my_agent_once, pool=GPUPool(nodes=2), node_recoveries=0)(str(tmp_path / "killed"))
    [exc] = caught.value.exceptions
    assert isinstance(exc, ConnectionError) and "node 1" in str(exc)


def test_an_unreachable_ssh_host_is_named_when_it_cannot_be_replaced(tmp_path):
    from tests.harness.sshd import SSHServer, free_port

    server = SSHServer(tmp_path / "sshd", ["127.0.0.1", "127.0.0.2"], free_port())
    pool = GPUPool(provider="ssh", nodes=2, hosts=[f"root@127.0.0.1:{server.port}", f"root@127.0.0.2:{server.port}"],
                   ssh_private_key=server.client_key, known_hosts=server.known_hosts(), remote_python=sys.executable,
                   reattach_seconds=5)  # a stopped sshd is tried again this long before its node is lost
    task = distributed_task(kill_my_agent_once, pool=pool, retries=2)
    try:
        with pool:
            assert [r["attempt"] for r in task(str(tmp_path / "killed"))] == [2, 2]  # reconnected
            server.stop()  # the hosts are gone for good (and with them every session)
            with pytest.raises(PoolStartError, match=r"node \d \(127\.0\.0\.\d:\d+\) was lost and cannot be reached"):
                task(str(tmp_path / "killed"))
    finally:
        server.stop()
