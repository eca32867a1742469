"""A teardown acts only on what is verifiably the pool's own (issue 58): a warm pool's record is
written by another process and is no proof. aws terminates only recorded instances that carry the
pool's tag; a local pool removes only a log folder that its own start made; and an `SSHLogin`'s
repr shows neither its private key nor its `env`."""

from __future__ import annotations

import os
import tempfile

from skytasks.pool_spec import PoolSpec
from skytasks.providers.aws.resources import POOL_TAG, PoolResources
from skytasks.providers.local.provider import LocalProvider, is_own_log_dir
from skytasks.providers.ssh.nodes import SSHLogin


def _launch(moto, tags: dict[str, str]) -> str:
    spec = [{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}] if tags else []
    done = moto["ec2"].run_instances(ImageId=moto["image"], MinCount=1, MaxCount=1, InstanceType="t3.micro",
                                     SubnetId=moto["subnet"], TagSpecifications=spec)
    return done["Instances"][0]["InstanceId"]


def _state(moto, iid: str) -> str:
    return moto["ec2"].describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]["State"]["Name"]


def test_aws_teardown_terminates_only_recorded_instances_that_carry_the_pools_tag(moto):
    own = _launch(moto, {POOL_TAG: "skytasks-pool-a"})
    someone_elses = _launch(moto, {"Name": "a training job of another team"})
    other_pool = _launch(moto, {POOL_TAG: "skytasks-pool-b"})
    try:
        record = PoolResources(moto["ec2"], "skytasks-pool-a", instance_ids=[own, someone_elses, other_pool])
        assert record.teardown() == []
        assert _state(moto, own) == "terminated"
        assert _state(moto, someone_elses) == "running"
        assert _state(moto, other_pool) == "running"
    finally:
        moto["ec2"].terminate_instances(InstanceIds=[someone_elses, other_pool])


def test_local_stop_removes_only_a_log_folder_its_own_start_made(tmp_path):
    spec = PoolSpec(name="local-pool", provider="local", nodes=1, procs_per_node=1, accelerators_per_node=None)
    elsewhere = tmp_path / "skytasks-warm-notmine"  # named so, but not in the temporary folder
    elsewhere.mkdir(mode=0o700)
    (elsewhere / "precious").write_text("keep me")
    linked = os.path.join(tempfile.gettempdir(), f"skytasks-warm-link{os.getpid()}")
    os.symlink(elsewhere, linked)  # named so, in the right place, but a link to another folder
    own = tempfile.mkdtemp(prefix="skytasks-warm-")
    try:
        for recorded in (str(elsewhere), linked, str(tmp_path)):
            provider = LocalProvider(spec)
            provider._log_dir = recorded  # as a (forged) warm record's log_dir sets it on adopt
            provider.stop()
            assert not is_own_log_dir(recorded)
        assert (elsewhere / "precious").read_text() == "keep me" and os.path.islink(linked)
        assert is_own_log_dir(own)
        provider = LocalProvider(spec)
        provider._log_dir = own
        provider.stop()
        assert not os.path.exists(own)  # the pool's own folder does go
    finally:
        os.unlink(linked)


def test_an_ssh_logins_repr_shows_no_secret():
    login = SSHLogin(targets=[("me", "host", 22)], known_hosts="", private_key="-----BEGIN KEY-----SECRETKEY",
                     python="python3", env={"WANDB_API_KEY": "SECRETENV"})
    text = repr(login) + str(login)
    assert "SECRETKEY" not in text and "SECRETENV" not in text and "WANDB_API_KEY" not in text
    assert "host" in text and "python3" in text  # what is not secret still helps a reader
