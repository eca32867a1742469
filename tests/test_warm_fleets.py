"""Warm pools across processes, what only some fleets have (issue 52, part 3): what every provider
that keeps warm promises (the next process attaches to the same nodes, a node lost unheld is
replaced, an unheld pool ends itself, `pools down` leaves nothing) is the conformance suite's,
tests/test_provider_conformance_warm.py. Here: an ssh holder SIGKILLed mid-call frees the pool
within its re-attach window (its ranks stopped), and an AWS pool whose login key the user gives.

Each controller is a process of its own (tests/programs/warm_call.py, a Prefect flow run).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from tests.conftest import gone
from tests.harness.conformance_warm import use, wait_until
from tests.harness.ssh_pools import ssh_pool
from tests.harness.sshd import SSHServer
from tests.harness.warm import api_env as _env
from tests.harness.warm import pools_down

PROGRAM = Path(__file__).parent / "programs" / "warm_call.py"
ROOT = Path(__file__).resolve().parent.parent


def save_ssh(server: SSHServer, name: str, **fields) -> None:
    ssh_pool(server, ready_timeout_seconds=60, reattach_seconds=5,
             **{"keep_warm_minutes": 2.0, **fields}).save(name, overwrite=True)


def test_ssh_a_dead_holder_frees_the_pool_within_reattach_seconds(sshd, pool_name, tmp_path):
    """The holder SIGKILLed in the middle of a call: its SSH connections drop, each agent waits its
    re-attach window (5 s + 2), stops the dead holder's ranks and lets the next process hold it."""
    save_ssh(sshd, pool_name)
    holder = subprocess.Popen([sys.executable, str(PROGRAM), pool_name, str(tmp_path / "holder.json"), "120"],
                              env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: len(list(tmp_path.glob("holder.json.ready*"))) == 2, 120, "the holder's ranks in its call")
        ranks = [int(p.read_text()) for p in tmp_path.glob("holder.json.ready*")]
        agents = [next(a.pid for a in psutil.Process(r).parents() if "skytasks.node.agent" in " ".join(a.cmdline()))
                  for r in ranks]
    finally:
        holder.kill()
        holder.wait()
    killed = time.monotonic()
    second = use(pool_name, tmp_path / "second.json")
    assert time.monotonic() - killed < 5 + 2 + 20  # the window, and the second process's own start
    assert sorted(second["pids"]) == sorted(agents) and second["ranks"] == [0, 1]
    assert all(gone(r) for r in ranks)  # the dead holder's ranks were stopped, not left running


def test_aws_a_pool_with_the_user_s_own_key_pair_attaches_to_the_same_instances_and_pools_down_terminates_them(
        moto, tmp_path, monkeypatch, pool_name):
    """The login key the user gives (key_name, ssh_private_key), not one the pool makes (that one
    is the conformance suite's aws pool): the next holder logs in with it from the pool's fields."""
    import asyncssh

    from tests.harness.conformance_clusters import AWSFleet
    from tests.test_aws_provider import leftovers

    key = asyncssh.generate_private_key("ssh-ed25519")
    pair = f"warm-{uuid.uuid4().hex[:6]}"
    moto["ec2"].import_key_pair(KeyName=pair, PublicKeyMaterial=key.export_public_key())
    fleet = AWSFleet(moto, tmp_path, monkeypatch)
    try:
        fleet.pool(nodes=2, key_name=pair, ssh_private_key=key.export_private_key().decode(), reattach_seconds=10,
                   keep_warm_minutes=2.0).save(pool_name, overwrite=True)
        first = use(pool_name, tmp_path / "first.json")
        assert first["ranks"] == [0, 1] and all(not gone(pid) for pid in first["pids"])
        instances = leftovers(moto["ec2"])["instances"]
        assert len(instances) == 2
        second = use(pool_name, tmp_path / "second.json")
        assert second["pids"] == first["pids"] and second["ranks"] == [0, 1]
        assert leftovers(moto["ec2"])["instances"] == instances  # nothing launched again
        pools_down(pool_name)
        wait_until(lambda: not leftovers(moto["ec2"])["instances"], 60, "the instances terminated")
        assert leftovers(moto["ec2"])["security_groups"] == [] and all(gone(p) for p in first["pids"])
    finally:
        moto["ec2"].delete_key_pair(KeyName=pair)
        fleet.close()
