"""provider="slurm" against a real SLURM: slurmctld and three slurmd "nodes", each in a network
namespace of its own (ranks on different nodes talk over a bridge), with fake GPUs from gres.conf.

After every test the queue is empty: no allocation outlives its pool, on any path.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from skytasks import GPUPool, PoolConfigError, PoolStartError, distributed_task, rank_info
from skytasks.providers.slurm import job as slurm_job
from tests.harness.workloads import lightning_fit, resume

ROOT = Path(__file__).resolve().parent.parent
# After each test that used the SLURM cluster, its queue is empty (conftest).
pytestmark = pytest.mark.usefixtures("slurm_queue_empty_after")


def slurm_pool(**overrides) -> GPUPool:
    fields = dict(provider="slurm", nodes=2, procs_per_node=2, remote_python=sys.executable,
                  ready_timeout_seconds=60)
    return GPUPool(**{**fields, **overrides})


def test_two_nodes_by_two_procs_over_the_bridge_with_slurms_gpus(cluster):
    pool = slurm_pool(accelerator="H100", accelerators_per_node=2)  # gres gpu:2 on fake devices

    @distributed_task(pool=pool, backend="gloo")  # the GPUs are device files only: no NCCL here
    def where():
        import socket

        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0])
        dist.all_reduce(t)
        info = rank_info()
        return dict(rank=info.rank, host=socket.gethostname(), cvd=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    local_rank=info.local_rank, device=info.device, sum=t.item(), head=info.head_addr,
                    job=os.environ.get("SLURM_JOB_ID"))

    out = where()
    assert [r["rank"] for r in out] == [0, 1, 2, 3]
    assert {r["sum"] for r in out} == {4.0}
    hosts = [r["host"] for r in out]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3] and set(hosts) <= {"n0", "n1", "n2"}
    assert out[0]["head"] == cluster.addresses[hosts[0]]  # rendezvous on the head's bridge address
    assert {r["cvd"] for r in out} == {"0,1"}  # as SLURM set it for the step
    assert [r["local_rank"] for r in out] == [0, 1, 0, 1]
    assert [r["device"] for r in out] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert len({r["job"] for r in out}) == 1 and out[0]["job"]


def test_the_example_flow_and_an_unchanged_torchrun_script_on_one_allocation(cluster, tmp_path, monkeypatch):
    from flows.ddp_train import ddp_train
    from skytasks import run_script
    from tests.test_run_script import TRAIN

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(TRAIN)
    (project / "helpers.py").write_text("def double(x):\n    return 2 * x\n")
    name = f"slurm-example-{os.getpid()}"
    slurm_pool().save(name, overwrite=True)
    pool = GPUPool.load(name)
    with pool:
        results = ddp_train(epochs=2, samples=256, pool=name, checkpoint_dir=str(tmp_path / "ckpt"))
        scripted = run_script("train.py", ["--lr", "0.1", "--out", str(tmp_path / "out")], workdir=project)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    losses = results[0]["epoch_losses"]
    assert len(losses) == 2 and losses[-1] < losses[0]
    assert all(r["epoch_losses"] == losses for r in results)
    assert [(r.rank, r.exit_code) for r in scripted] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    import json

    seen = {int(p.stem): json.loads(p.read_text()) for p in (tmp_path / "out").glob("*.json")}
    assert sorted(seen) == [0, 1, 2, 3] and {s["sum"] for s in seen.values()} == {6.0}
    assert {s["env"]["WORLD_SIZE"] for s in seen.values()} == {"4"}
    assert seen[0]["env"]["LOCAL_WORLD_SIZE"] == "2" and seen[3]["env"]["GROUP_RANK"] == "1"


def test_a_pending_allocation_is_reported_then_cancelled_at_the_ready_timeout(cluster):
    blocker = cluster.run("sbatch", "--parsable", "--output=/dev/null", "--exclusive", "-N3", "--wrap", "sleep 300").stdout.strip()
    try:
        deadline = time.monotonic() + 20
        while "RUNNING" not in cluster.run("squeue", "-h", "-j", blocker, "-o", "%T").stdout:
            assert time.monotonic() < deadline, cluster.queue()
            time.sleep(0.3)
        pool = slurm_pool(ready_timeout_seconds=4)

        @distributed_task(pool=pool)
        def never():
            return 1

        started = time.monotonic()
        with pytest.raises(PoolStartError) as caught:
            never()
        text = str(caught.value)
        assert "ready_timeout_seconds" in text and "slurm job" in text and "cancelled" in text
        assert "Resources" in text or "Priority" in text, text  # SLURM's own reason
        assert time.monotonic() - started < 30
        assert [line.split()[0] for line in cluster.queue()] == [blocker]  # ours is gone, the other stays
    finally:
        cluster.run("scancel", blocker, check=False)


@pytest.mark.parametrize("fields, field, said", [
    (dict(slurm_partition="nope"), "slurm_partition", "invalid partition"),
    (dict(slurm_gres="tpu:1"), "slurm_gres", "generic resource"),
    (dict(slurm_gres="gpu:9"), "slurm_gres", "node configuration is not available"),
    (dict(nodes=5), "nodes", "node configuration is not available"),
    (dict(slurm_constraint="a100"), "slurm_constraint", "feature"),
    (dict(slurm_partition="proj", slurm_account="nope", nodes=1), "slurm_account", "account"),
])
def test_bad_input_gets_slurms_own_message_naming_the_field_and_leaves_no_job(cluster, fields, field, said):
    @distributed_task(pool=slurm_pool(**fields))
    def never():
        return 1

    with pytest.raises(PoolConfigError) as caught:
        never()
    text = str(caught.value)
    assert text.startswith(f"{field}: ") and said.lower() in text.lower(), text


def test_sbatch_refusals_with_accounting_name_their_field():
    # With AccountingStorageEnforce (a slurmdbd, which this test cluster has not), sbatch itself
    # refuses an unknown account or qos with these words.
    assert slurm_job.refused_field("Invalid account or account/partition combination specified") == "slurm_account"
    assert slurm_job.refused_field("Invalid qos specification") == "slurm_qos"
    assert slurm_job.never_starts("InvalidQOS") == "slurm_qos"
    assert slurm_job.never_starts("Resources") is None and slurm_job.never_starts("Priority") is None


def test_a_node_that_dies_mid_call_fails_the_attempt_naming_it_and_the_retry_runs_on_a_new_node(
        cluster, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_SECONDS", "0.5")
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS", "3")
    marker = tmp_path / "started"
    pool = slurm_pool(procs_per_node=1)

    @distributed_task(pool=pool, retries=1)
    def work(marker: str):
        import socket

        info = rank_info()
        if info.attempt == 1:
            Path(f"{marker}{info.rank}").write_text(socket.gethostname())
            time.sleep(60)
        return socket.gethostname()

    victim: dict[str, str] = {}

    def kill_when_running() -> None:
        deadline = time.monotonic() + 60
        while not Path(f"{marker}1").exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)
        victim["name"] = Path(f"{marker}1").read_text()
        cluster.kill_node(victim["name"])

    killer = threading.Thread(target=kill_when_running)
    killer.start()
    try:
        hosts = work(str(marker))
        killer.join()
        assert victim["name"] not in hosts and len(set(hosts)) == 2, hosts
        notices = capsys.readouterr().err.splitlines()
        failed = [n for n in notices if "attempt 1 failed" in n]
        # the error names the node as SLURM knows it, with what SLURM says of it
        assert failed and f"SLURM: node {victim['name']}" in failed[0], notices
        assert any("replaced" in n for n in notices), notices
    finally:
        killer.join()
        if victim:
            cluster.revive_node(victim["name"])


CONTROLLER = """
import os, sys, time
from skytasks import GPUPool, distributed_task, rank_info
pool = GPUPool(provider="slurm", nodes=2, remote_python=sys.executable, idle_minutes=0.25)

@distributed_task(pool=pool)
def long():
    print("RANK STARTED", flush=True)
    time.sleep(300)

with pool:
    print("JOB", os.popen("squeue -h -o %i").read().split(), flush=True)
    long()
"""


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_ctrl_c_sigterm_and_sigkill_all_end_the_allocation(cluster, tmp_path, how):
    script = tmp_path / "controller.py"
    script.write_text(CONTROLLER)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=env, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 90
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "RANK STARTED" in line:
                break
            assert time.monotonic() < deadline, lines
        assert cluster.queue(), "the allocation should be up while the call runs"
        started = time.monotonic()
        proc.send_signal(how)
        proc.wait(timeout=60)
        # Ctrl-C and SIGTERM: the controller cancels the job itself. SIGKILL: the batch job ends
        # the allocation once the controller has been silent for idle_minutes (15 s here: 6 s, with
        # heartbeats every 5 s, ended a live pool on a 2-core machine running the suite in workers).
        left = cluster.wait_queue_empty(timeout=60)
        assert not left, (left, "".join(lines))
        if how == signal.SIGKILL:
            print(f"allocation gone {time.monotonic() - started:.1f}s after the controller was SIGKILLed")
        else:
            assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_slurm_login_runs_every_command_on_the_login_node_over_ssh(cluster, login_node):
    pool = slurm_pool(slurm_login=f"root@127.0.0.1:{login_node.port}", ssh_private_key=login_node.client_key,
                      known_hosts=login_node.known_hosts(), procs_per_node=1)

    @distributed_task(pool=pool)
    def hostname():
        import socket

        return socket.gethostname()

    hosts = hostname()
    assert len(set(hosts)) == 2 and set(hosts) <= {"n0", "n1", "n2"}

    wrong = slurm_pool(slurm_login=f"root@127.0.0.1:{login_node.port}", ssh_private_key=login_node.client_key,
                       known_hosts=f"[127.0.0.1]:{login_node.port} " + textwrap.dedent(
                           "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"))

    @distributed_task(pool=wrong)
    def refused():
        return 1

    with pytest.raises(PoolStartError, match="host key"):
        refused()


def test_the_sbatch_time_limit_comes_from_max_lifetime_minutes_and_is_left_out_without_one():
    def args(**fields) -> list[str]:
        return slurm_job.sbatch_args(slurm_pool(**fields).spec(), "skytasks-x", 2)

    uncapped = args()  # the default: no max_lifetime_minutes
    assert not [a for a in uncapped if a.startswith(("--time", "-t"))]  # the partition's limit applies
    assert "--signal=USR2@120" in uncapped  # the notice still comes before the partition's limit
    [comment] = [a for a in uncapped if a.startswith("--comment=")]
    lease = slurm_job.parse_expiry(comment)
    soon = datetime.now(timezone.utc) + timedelta(minutes=25, seconds=5)
    assert lease is not None and lease <= soon  # a lease (idle_minutes and two renewals), not a lifetime
    capped = args(max_lifetime_minutes=90.5)
    assert "--time=91" in capped and "--signal=USR2@120" in capped
    short = args(max_lifetime_minutes=0.5, idle_minutes=15)
    assert "--time=1" in short and "--signal=USR2@10" in short
    [comment] = [a for a in short if a.startswith("--comment=")]
    assert slurm_job.parse_expiry(comment) <= datetime.now(timezone.utc) + timedelta(seconds=31)  # never past the cap


def test_an_uncapped_pool_asks_for_no_time_and_renews_its_lease_so_gc_spares_it_until_nobody_does(cluster):
    from skytasks.providers.reporting import PoolReporter
    from skytasks.providers.slurm.gc import sweep_jobs
    from skytasks.providers.slurm.shell import SlurmShell
    from skytasks.providers.slurm.spec import SlurmSpec

    def lease_and_limit(job_id: str) -> tuple[datetime | None, str]:
        done = cluster.run("squeue", "-h", "-j", job_id, "-o", "%k|%l").stdout.strip()
        comment, _, limit = done.rpartition("|")
        return slurm_job.parse_expiry(comment), limit

    pool = slurm_pool(nodes=1, procs_per_node=1, idle_minutes=0.25)  # a lease of 25 s, renewed every 5 s
    shell = SlurmShell(pool.spec().own(SlurmSpec), PoolReporter("gc", "slurm"))
    with pool:
        [job_id] = pool.runtime().session.provider.jobs
        first, limit = lease_and_limit(job_id)
        # No --time: the partition's limit, none on the test cluster. squeue shows that as UNLIMITED,
        # or (seen once in CI, after the lease's `scontrol update` of the comment) as SLURM's year.
        assert limit in ("UNLIMITED", "365-00:00:00")
        assert first is not None and first <= datetime.now(timezone.utc) + timedelta(seconds=26)
        deadline = time.monotonic() + 90
        while datetime.now(timezone.utc) <= first + timedelta(seconds=1):  # until its first lease has run out
            assert job_id not in sweep_jobs(shell, dry_run=True)  # renewed in time, every time
            assert time.monotonic() < deadline
            time.sleep(0.5)
        renewed, _ = lease_and_limit(job_id)
        assert renewed is not None and renewed > first
        assert sweep_jobs(shell) == []
        an_hour_on = datetime.now(timezone.utc) + timedelta(hours=1)
        assert sweep_jobs(shell, dry_run=True, now=an_hour_on) == [job_id]  # were its controller gone
        assert distributed_task(lambda: rank_info().world_size, pool=pool)() == [1]  # still up and working


def test_gc_cancels_skytasks_jobs_past_their_expiry_and_nothing_else(cluster):
    from skytasks.providers.reporting import PoolReporter
    from skytasks.providers.slurm.gc import sweep_jobs
    from skytasks.providers.slurm.shell import SlurmShell
    from skytasks.providers.slurm.spec import SlurmSpec

    expired = cluster.run("sbatch", "--parsable", "--output=/dev/null", "--job-name=skytasks-old", "--comment=skytasks:expires-at=2000-01-01T00:00:00Z",
                          "--wrap", "sleep 300").stdout.strip()
    fresh = cluster.run("sbatch", "--parsable", "--output=/dev/null", "--job-name=skytasks-new", "--comment=skytasks:expires-at=2999-01-01T00:00:00Z",
                        "--wrap", "sleep 300").stdout.strip()
    theirs = cluster.run("sbatch", "--parsable", "--output=/dev/null", "--job-name=someone-else", "--comment=skytasks:expires-at=2000-01-01T00:00:00Z",
                         "--wrap", "sleep 300").stdout.strip()
    try:
        shell = SlurmShell(slurm_pool().spec().own(SlurmSpec), PoolReporter("gc", "slurm"))
        assert sweep_jobs(shell, dry_run=True) == [expired]
        assert sweep_jobs(shell) == [expired]
        cluster.wait_queue_empty_of(expired)  # scancel returns before a running job has left the queue
        ids = [line.split()[0] for line in cluster.queue()]
        assert expired not in ids and fresh in ids and theirs in ids
    finally:
        cluster.run("scancel", expired, fresh, theirs, check=False)


def test_a_preempted_node_says_so_with_its_ranks_stacks_and_the_retry_resumes_from_the_checkpoint(
        cluster, tmp_path, capsys):
    """SLURM's SIGTERM before the kill (preemption, scancel --signal, the time limit) reaches the
    agent and its ranks at once: the agent says the node is going away, with where each rank
    was; the attempt fails as a lost node; the retry resumes from the last checkpoint."""
    from skytasks import Checkpointer

    marker = tmp_path / "step"
    pool = slurm_pool(procs_per_node=1)

    @distributed_task(pool=pool, retries=1)
    def train(ckpt_dir: str, marker: str):
        ckpt = Checkpointer(ckpt_dir, keep=2)
        found = ckpt.load_latest()
        start = 0 if found is None else found[0] + 1
        for step in range(start, 6):
            ckpt.save({"step": step}, step)
            if rank_info().attempt == 1 and step == 2:
                import socket

                Path(f"{marker}{rank_info().rank}").write_text(socket.gethostname())
                time.sleep(120)  # preempted here
        return (rank_info().attempt, start)

    def preempt_node_1() -> None:
        deadline = time.monotonic() + 60
        while not Path(f"{marker}1").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # into the sleep
        host = Path(f"{marker}1").read_text()
        # the agent step on rank 1's node, as `scancel --signal` names a step
        steps = [line.split() for line in cluster.run("squeue", "-h", "-s", "-o", "%i %N").stdout.splitlines()]
        [step] = [s for s, node in steps if node == host and ".batch" not in s]
        # (scancel may exit non-zero when a process of the step is already gone; the signal went out)
        cluster.run("scancel", "--signal=TERM", step, check=False)

    threading.Thread(target=preempt_node_1, daemon=True).start()
    out = train(str(tmp_path / "ckpt"), str(marker))
    assert out == [(2, 3), (2, 3)]  # attempt 2 went on from the step after the last checkpoint
    err = capsys.readouterr().err
    assert "node 1 is going away" in err and "SIGTERM" in err, err
    assert "stopped because node 1 is going away" in err and "in `train`" in err, err  # its rank's stack


def test_a_job_that_cannot_be_cancelled_is_an_error_naming_it_not_a_silent_leak(cluster, monkeypatch, caplog):
    """slurmctld does not answer when the pool ends: the job may still hold its nodes (and bill
    for them). The pool's exit names it in an ERROR and raises PoolTeardownError."""
    import logging

    from skytasks import PoolTeardownError

    monkeypatch.setenv("SKYTASKS_TEARDOWN_WAIT_SECONDS", "2")
    pool = slurm_pool(procs_per_node=1)
    with pytest.raises(PoolTeardownError) as caught, caplog.at_level(logging.ERROR, logger="skytasks"):
        with pool:
            job = cluster.queue()[0].split()[0]
            cluster.freeze_controller()
    try:
        assert f"slurm job {job}" in str(caught.value) and "skytasks gc" in str(caught.value)
        assert f"slurm job {job}" in caplog.text
    finally:
        cluster.thaw_controller()
        cluster.run("scancel", job, check=False)
        # The steps ended while the controller was frozen, so it still waits to hear of them:
        # an administrator's way out is to down the nodes and resume them, which ends the job.
        if cluster.wait_queue_empty(timeout=1):
            cluster.run("scontrol", "update", "nodename=n0,n1,n2", "state=down", "reason=test cleanup", check=False)
            cluster.run("scontrol", "update", "nodename=n0,n1,n2", "state=resume", check=False)
            cluster.wait_idle()


def test_an_elastic_allocation_takes_what_is_free_grows_back_and_a_notice_saves_then_shrinks(cluster, tmp_path, capsys,
                                                                                           monkeypatch):
    """`min_nodes=2, nodes=3` with one node held by someone else: SLURM's own `--nodes=2-3` gives
    two, and the pool says why not three. A call while the node is still held tries to grow with
    a job of its own, which stays pending and is cancelled after 10 s: the call runs on two and no
    job is left behind. Once the node is free, the next call grows to three. `scancel --signal=USR2` on one node's step is the
    preemption notice: every rank is told, the head saves, and the retry resumes from that
    checkpoint on the two nodes that are left."""

    blocker = cluster.run("sbatch", "--parsable", "-w", "n2", "--exclusive", "--output=/dev/null",
                          "--wrap", "sleep 300").stdout.strip().split(";")[0]
    cluster.wait_running(blocker)
    pool = slurm_pool(nodes=3, min_nodes=2, procs_per_node=1)
    marker = tmp_path / "noticed"

    @distributed_task(pool=pool, retries=1)
    def train(ckpt_dir: str, marker: str, steps: int = 40):
        import socket

        import torch
        import torch.distributed as dist

        info = rank_info()
        ckpt, found, start = resume(ckpt_dir)
        for step in range(start, steps):
            dist.all_reduce(torch.ones(1))
            if info.node_rank == 1 and step == 3 and not Path(marker).exists():
                Path(marker).write_text(socket.gethostname())
            ckpt.save_if_preempted({"step": step}, step)
            time.sleep(0.1)
        return (info.attempt, info.world_size, start, socket.gethostname())

    def notice_to_node_1() -> None:
        deadline = time.monotonic() + 90
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        host = marker.read_text()
        steps = [line.split() for line in cluster.run("squeue", "-h", "-s", "-o", "%i %N").stdout.splitlines()]
        [step] = [s for s, node in steps if node == host and ".batch" not in s and "extern" not in s]
        cluster.run("scancel", "--signal=USR2", step, check=False)

    monkeypatch.setenv("SKYTASKS_GROW_RETRY_SECONDS", "0")  # each call here may try to grow
    from skytasks.providers.slurm import provider as slurm_provider

    monkeypatch.setattr(slurm_provider, "GROW_WAIT_SECONDS", 3.0)  # the pending grow job is cancelled sooner
    with pool:
        session = pool.runtime().session
        said = "\n".join(session.provider.reporter.lines)
        jobs_at_start = list(session.provider.jobs)
        assert distributed_task(lambda: rank_info().world_size, pool=pool)() == [2, 2]  # n2 still held
        [pending_grow] = [j for j in session.provider.jobs if j not in jobs_at_start]
        cluster.wait_queue_empty_of(pending_grow)
        assert pending_grow not in {line.split()[0] for line in cluster.queue()}  # cancelled, not left queued
        assert "could not grow by 1 node now" in "\n".join(session.provider.reporter.lines)
        cluster.run("scancel", blocker)
        assert len(session.nodes) == 2
        assert "got 2 of 3 nodes (--nodes=2-3)" in said and "n2 is allocated" in said, said
        cluster.wait_queue_empty_of(blocker)
        threading.Thread(target=notice_to_node_1, daemon=True).start()
        out = train(str(tmp_path / "ckpt"), str(marker))
        err = capsys.readouterr().err
        said = "\n".join(session.provider.reporter.lines)
        # The preempted node went back to SLURM: the pool's jobs hold only the nodes it uses.
        held = cluster.run("squeue", "-h", "-o", "%N", "-j", ",".join(session.provider.jobs)).stdout
        held_names = cluster.run("scontrol", "show", "hostnames", ",".join(held.split())).stdout.split()
    assert sorted(held_names) == sorted(o[3] for o in out) and marker.read_text() not in held_names, held_names
    assert "grew by n2" in said, said
    assert "grew back to 3 of 3 nodes" in err, (err, said)
    assert "will be taken away: SIGUSR2" in err, err
    noticed = marker.read_text()
    # The retry: two ranks, from the step after the head's checkpoint, never on the preempted node.
    assert [o[:2] for o in out] == [(2, 2), (2, 2)], out
    assert out[0][2] >= 4 and noticed not in {o[3] for o in out}, (out, noticed)
    assert "Preempted" in err and "the elastic pool goes on with the 2 nodes left" in err, err


def test_a_lightning_trainer_on_a_slurm_pool_sees_one_job_with_each_rank_its_own_task(cluster, tmp_path):
    # The Trainer finds SLURM's variables and must see one job of 4 tasks, not 4 jobs of one.
    out = distributed_task(lightning_fit, pool=slurm_pool(), backend="gloo")(str(tmp_path), devices=2)
    assert [r["env"] for r in out] == ["SLURMEnvironment"] * 4  # Lightning chose SLURM's variables...
    assert [(r["global_rank"], r["world_size"], r["node_rank"], r["local_rank"]) for r in out] == [
        (0, 4, 0, 0), (1, 4, 0, 1), (2, 4, 1, 0), (3, 4, 1, 1)]  # ...and they say where each rank is
    assert all(r["weights"] == out[0]["weights"] for r in out)  # one model, trained together
    assert [r["slurm"] for r in out] == [
        {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2), "SLURM_NODEID": str(r // 2), "SLURM_NTASKS": "4",
         "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_GTIDS": "0,1" if r < 2 else "2,3"}
        for r in range(4)]



SYSTEM_PYTHON = "/usr/bin/python3"  # the system's own Python: no torch, no cloudpickle


@pytest.mark.parametrize("fields, ran", [
    (dict(remote_python=SYSTEM_PYTHON), f"remote_python={SYSTEM_PYTHON!r} ran {SYSTEM_PYTHON}"),
    # Left unset: python3 on the nodes' PATH, here the system's own.
    (dict(remote_python=None, env={"PATH": "/usr/bin:/bin"}), "remote_python unset, so 'python3'"),
], ids=["set", "default"])
def test_a_python_without_torch_fails_the_start_naming_remote_python_and_cancels_the_job(cluster, fields, ran):
    lacks = subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True, text=True)
    assert lacks.returncode != 0, "this test needs a Python without torch"
    started = time.monotonic()
    with pytest.raises(PoolStartError) as caught:
        distributed_task(lambda: 1, pool=slurm_pool(**fields))()
    text = str(caught.value)
    assert text.startswith("remote_python: node ") and ran in text, text
    assert "ModuleNotFoundError: No module named 'torch'" in text and "no rank was started" in text, text
    assert time.monotonic() - started < 60
    # The autouse checks: the queue is empty (the allocation was cancelled), and no agent is left.
