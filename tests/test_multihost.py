"""Two hosts for real: network namespaces joined by veth pairs on a bridge, each with its own
address and its own sshd. Traffic goes only to addresses inside namespaces made here.

Taking one host's link down closes nothing: no FIN, no RST, the TCP connection just falls silent.
Only heartbeats can tell, on both ends.
"""

from __future__ import annotations

import os
import time

import pytest

from skytasks import DistributedTaskError, distributed_task, rank_info
from tests.conftest import running, skytasks_processes
from tests.harness.netns import bridged_hosts, ip, netns_pool

SUBNET = "10.231.77"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with bridged_hosts(tmp_path_factory.mktemp, SUBNET, "skt") as made:
        yield made


def where_am_i() -> dict:
    import socket

    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank_info().rank + 1)])
    dist.all_reduce(t)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((rank_info().head_addr, 9))  # no packet is sent: it only picks the route
        own_address = s.getsockname()[0]
    # Inside a namespace the hostname means nothing to gloo: skytasks picked the interface that
    # reaches the head.
    return {"rank": rank_info().rank, "own_address": own_address, "sum": t.item(),
            "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME")}


def test_a_two_node_gloo_job_across_two_network_namespaces(hosts):
    results = distributed_task(where_am_i, pool=netns_pool(hosts))()
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["own_address"] for r in results] == hosts["addresses"]  # each rank on its own host
    assert {r["sum"] for r in results} == {3.0}
    assert [r["gloo_interface"] for r in results] == ["eth0", "eth0"]


def all_reduce_forever() -> None:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    while True:
        dist.all_reduce(t)
        time.sleep(0.05)


def test_a_link_going_down_mid_run_fails_the_call_in_bounded_time_and_leaves_nothing_running(hosts, monkeypatch):
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS", "4")
    link = hosts["links"][1]
    outcome: dict = {}

    def pull_the_cable_once_running() -> None:
        deadline = time.monotonic() + 120
        while len(running("skytasks.node.worker")) < 2:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)
        time.sleep(2.0)  # well inside the all_reduce loop
        ip("link", "set", link, "down")
        outcome["down_at"] = time.monotonic()

    import threading

    puller = threading.Thread(target=pull_the_cable_once_running)
    puller.start()
    try:
        with pytest.raises(DistributedTaskError) as caught:
            # A cut link is first a break: the pool tries to reach the node again for reattach_seconds
            # (60 s by default) before the node is lost; 5 s here.
            distributed_task(all_reduce_forever, pool=netns_pool(hosts, reattach_seconds=5), timeout_seconds=90,
                             node_recoveries=0)()
        assert "down_at" in outcome, "the link was never taken down: the ranks were not seen running"
        failed_after = time.monotonic() - outcome["down_at"]
    finally:
        puller.join()
        ip("link", "set", link, "up")
    [exc] = caught.value.exceptions
    assert isinstance(exc, ConnectionError) and "node 1" in str(exc) and "no heartbeat" in str(exc)
    assert "not reached again within reattach_seconds=5" in str(exc)
    print(f"the call failed {failed_after:.1f}s after the link went down")
    assert failed_after < 30, f"the call took {failed_after:.1f}s to fail after the link went down"
    # The cut-off node's agent stops its rank on its own (the autouse leak check waits 10 s more).
    deadline = time.monotonic() + 20
    while skytasks_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert skytasks_processes() == []
