"""`skytasks check --pool NAME` for ssh, slurm and aws pools, as a user runs it: the pool saved as a
block, the real CLI in a process of its own, against the real parts (OpenSSH servers, the SLURM
test cluster, moto's EC2). A pool that would start passes every check (exit 0); one that would
not fails the check that says why (exit 1). Either way nothing is started: no node agent, no job
in SLURM's queue, no instance, security group or key pair in EC2.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from skytasks import GPUPool
from tests.conftest import started_here
from tests.harness.ssh_pools import ssh_pool

SYSTEM_PYTHON = "/usr/bin/python3"  # the system's own Python: no torch, no cloudpickle


def check(pool: GPUPool, label: str) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    name = f"check-{label}-{os.getpid()}"
    pool.save(name, overwrite=True)
    return subprocess.run([sys.executable, "-m", "skytasks.cli", "check", "--pool", name],
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                          capture_output=True, text=True, timeout=180)


def lines(done: subprocess.CompletedProcess, verdict: str) -> list[str]:
    return [ln for ln in done.stdout.splitlines() if ln.startswith(verdict + "  ")]


def no_agents() -> None:
    """No node agent or rank under this test process (sshd's sessions and slurmd included); other
    sessions' tests on this machine may have their own."""
    assert started_here() == []


# -- ssh ------------------------------------------------------------------------------------------


def test_ssh_hosts_that_answer_with_a_python_that_has_torch_pass(sshd):
    done = check(ssh_pool(sshd, ["127.0.0.1", "127.0.0.2"]), "ssh-ok")
    assert done.returncode == 0, done.stdout + done.stderr
    passed = lines(done, "PASS")
    for node, host in enumerate(["127.0.0.1", "127.0.0.2"]):
        assert any(ln.startswith(f"PASS  node {node} (root@{host}:{sshd.port}) answers SSH") and "OpenSSH" in ln
                   for ln in passed), done.stdout
        assert any(ln.startswith(f"PASS  node {node} (root@{host}:{sshd.port}): remote_python imports torch")
                   and sys.executable in ln for ln in passed), done.stdout
    assert not lines(done, "FAIL") and "all passed" in done.stdout
    no_agents()


def test_a_host_without_sshd_and_a_python_without_torch_fail(sshd):
    # 127.0.0.3: nothing listens there. The system Python has neither torch nor cloudpickle.
    done = check(ssh_pool(sshd, ["127.0.0.1", "127.0.0.3"], remote_python=SYSTEM_PYTHON), "ssh-bad")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert f"PASS  node 0 (root@127.0.0.1:{sshd.port}) answers SSH" in out
    assert re.search(rf"FAIL  node 0 \(root@127\.0\.0\.1:{sshd.port}\): remote_python imports torch and cloudpickle: "
                     rf"remote_python={SYSTEM_PYTHON!r} ran \S+ \(Python [\d.]+\), which cannot import "
                     r"torch, cloudpickle", out), out
    assert re.search(rf"FAIL  node 1 \(root@127\.0\.0\.3:{sshd.port}\) answers SSH .*: cannot connect over SSH", out), out
    assert f"SKIP  node 1 (root@127.0.0.3:{sshd.port}): remote_python imports torch and cloudpickle: not reached" in out
    assert "2 failed" in out
    no_agents()


def test_a_host_key_not_in_known_hosts_fails(sshd):
    only_first = sshd.known_hosts(["127.0.0.1"])
    done = check(ssh_pool(sshd, ["127.0.0.1", "127.0.0.2"], known_hosts=only_first), "ssh-hostkey")
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"FAIL  node 1 \(root@127\.0\.0\.2:\d+\) answers SSH .*: host key of 127\.0\.0\.2:\d+ does not "
                     r"match known_hosts", done.stdout), done.stdout
    no_agents()


# -- slurm ----------------------------------------------------------------------------------------


def slurm_pool(**overrides) -> GPUPool:
    fields = dict(provider="slurm", nodes=2, procs_per_node=2, accelerator="H100", accelerators_per_node=2,
                  remote_python=sys.executable)
    return GPUPool(**{**fields, **overrides})


def queue(cluster) -> str:
    return cluster.run("squeue", "-h", "-o", "%i %j").stdout.strip()


def test_a_slurm_pool_slurm_would_allocate_passes(cluster):
    done = check(slurm_pool(), "slurm-ok")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "PASS  SLURM's controller answers on this machine: Slurmctld(primary) at" in out
    assert re.search(r"PASS  SLURM would accept the allocation \(sbatch --test-only --nodes=2 --ntasks-per-node=2 .*"
                     r"--gres=gpu:2\): Job \d+ to start at", out), out
    assert re.search(r"PASS  the default partition has 2 node\(s\) that can run: \d of 3 idle", out), out
    assert "SKIP  remote_python imports torch and cloudpickle on the nodes" in out
    assert queue(cluster) == ""
    no_agents()


@pytest.mark.parametrize("fields, field, said", [
    ({"slurm_partition": "nope"}, "slurm_partition", r"invalid partition"),
    ({"slurm_gres": "gpu:8"}, "slurm_gres", r"Requested node configuration is not available"),
])
def test_a_slurm_pool_slurm_refuses_fails_naming_the_field(cluster, fields, field, said):
    done = check(slurm_pool(**fields), "slurm-bad")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert re.search(rf"FAIL  SLURM would accept the allocation \(sbatch --test-only .*\): {field}: SLURM refused the "
                     rf"allocation: .*{said}[^()]*$", out, re.I | re.M), out
    if field == "slurm_partition":
        assert "FAIL  partition 'nope' has 2 node(s) that can run: sinfo lists no node in partition 'nope'" in out
    assert queue(cluster) == ""
    no_agents()


# -- aws ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zone_a_subnet(moto) -> str:
    """A subnet in a zone where EC2 offers t3.micro (moto, like EC2, has none in us-east-1e)."""
    return moto["ec2"].create_subnet(VpcId=moto["vpc"], CidrBlock=f"{moto['vpc_prefix']}.1.0/24",
                                     AvailabilityZone="us-east-1a")["Subnet"]["SubnetId"]


def aws_pool(moto, subnet: str, **overrides) -> GPUPool:
    fields = dict(provider="aws", nodes=2, instance_type="t3.micro", image_id=moto["image"], subnet_id=subnet,
                  aws_credentials=moto["creds"], ssh_ingress_cidr="127.0.0.1/32")
    return GPUPool(**{**fields, **overrides})


def ec2_contents(ec2) -> tuple:
    instances = sorted(i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"])
    groups = sorted(g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"])
    keys = sorted(k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"])
    return instances, groups, keys


def test_an_aws_pool_ec2_would_launch_passes_its_dry_run(moto, zone_a_subnet):
    before = ec2_contents(moto["ec2"])
    done = check(aws_pool(moto, zone_a_subnet), "aws-ok")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "PASS  the AWS credentials work: arn:aws:sts::123456789012:user/moto" in out
    assert "PASS  instance type t3.micro exists in us-east-1" in out
    assert f"PASS  image {moto['image']} exists" in out
    assert f"PASS  subnet {zone_a_subnet} exists: {zone_a_subnet} in {moto['vpc']}, us-east-1a" in out
    assert "PASS  instance type t3.micro is offered in us-east-1a" in out
    assert "PASS  EC2 would launch the nodes (RunInstances DryRun, 2-2 x t3.micro): Request would have succeeded" in out
    assert ec2_contents(moto["ec2"]) == before


def test_an_aws_pool_naming_a_subnet_that_does_not_exist_fails(moto, zone_a_subnet):
    before = ec2_contents(moto["ec2"])
    done = check(aws_pool(moto, "subnet-0123456789abcdef0", security_group_ids=["sg-0123456789abcdef0"]), "aws-bad")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "PASS  the AWS credentials work" in out
    assert ("FAIL  subnet subnet-0123456789abcdef0 exists: subnet_id: 'subnet-0123456789abcdef0' does not exist"
            in out), out
    assert "FAIL  security groups sg-0123456789abcdef0 exist: InvalidGroup.NotFound" in out
    assert "SKIP  EC2 would launch the nodes (RunInstances DryRun, 2-2 x t3.micro): not asked: a check above failed" in out
    assert ec2_contents(moto["ec2"]) == before
