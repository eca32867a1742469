"""provider="aws" against moto's EC2 server on loopback.

Network rule: instances are launched into a loopback subnet (127.0.0.0/24; 127.10N.0.0/24 in xdist
worker N), so moto gives them loopback private addresses and no public one, and every SSH attempt of
the provider stays on this machine.
`ssh_ingress_cidr` is always set, so nothing looks up this machine's public address.
After every test, moto must hold no live instance, security group or key pair of ours.
"""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from skytasks import GPUPool, distributed_task, rank_info
from skytasks.errors import PoolConfigError, PoolStartError
from tests.harness.sshd import SSHServer

ROOT = Path(__file__).resolve().parent.parent
REGION = "us-east-1"
STATE_DIR = Path("/var/lib/skytasks")  # the node's state folder (bootstrap status, heartbeat)


@pytest.fixture(autouse=True)
def moto_holds_nothing_afterwards(request):
    yield
    if "moto" in request.fixturenames:
        assert leftovers(request.getfixturevalue("moto")["ec2"]) == {"instances": [], "security_groups": [], "key_pairs": []}


def leftovers(ec2) -> dict:
    live = [i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
            if i["State"]["Name"] != "terminated"]
    groups = [g["GroupId"] for g in ec2.describe_security_groups()["SecurityGroups"] if g["GroupName"] != "default"]
    return {"instances": live, "security_groups": groups, "key_pairs": [k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"]]}


def aws_pool(moto, **overrides) -> GPUPool:
    fields = dict(provider="aws", nodes=2, instance_type="t3.micro", image_id=moto["image"], subnet_id=moto["subnet"],
                  aws_credentials=moto["creds"], ssh_ingress_cidr="127.0.0.1/32", ready_timeout_seconds=4)
    return GPUPool(**{**fields, **overrides})


def instances_of_latest_pool(ec2) -> list[dict]:
    every = [i for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]]
    latest = max(every, key=lambda i: i["LaunchTime"])
    pool_id = {t["Key"]: t["Value"] for t in latest["Tags"]}["skytasks:pool"]
    return [i for i in every if {t["Key"]: t["Value"] for t in i.get("Tags", [])}.get("skytasks:pool") == pool_id]


def test_an_unknown_instance_type_is_refused_before_anything_is_launched(moto):
    before = len(moto["ec2"].describe_instances()["Reservations"])
    with pytest.raises(PoolConfigError, match=r"instance_type: 'p9\.huge' does not exist"):
        distributed_task(lambda: 1, pool=aws_pool(moto, instance_type="p9.huge"))()
    assert len(moto["ec2"].describe_instances()["Reservations"]) == before


@pytest.mark.parametrize("field,value,message", [
    ("image_id", "ami-00000000", r"image_id: 'ami-00000000'"),
    ("subnet_id", "subnet-00000000", r"subnet_id: 'subnet-00000000' does not exist"),
    ("accelerator", "Z9000", r"accelerator: no default instance type for 'Z9000'"),
    ("security_group_ids", ["sg-12345678"], r"security_group_ids: .*sg-12345678"),
    ("key_name", "nobodys-key", r"key_name: .*nobodys-key"),
])
def test_a_missing_image_subnet_or_unknown_accelerator_is_refused_naming_the_field(moto, field, value, message):
    overrides = {field: value, **({"instance_type": None} if field == "accelerator" else {}),
                 **({"ssh_private_key": "unused"} if field == "key_name" else {})}
    with pytest.raises(PoolConfigError, match=message):
        distributed_task(lambda: 1, pool=aws_pool(moto, **overrides))()


def test_the_accelerator_chooses_the_instance_type_and_the_default_image_comes_from_ssm(moto):
    from skytasks.providers.aws.plan import plan_launch

    ec2, ssm = moto["ec2"], moto["creds"].get_client("ssm")
    plan = plan_launch(aws_pool(moto, instance_type=None, accelerator="A10G", accelerators_per_node=4).spec(), ec2, ssm)
    assert (plan.instance_type, plan.gpus_per_node, plan.cuda, plan.placement_group) == ("g5.12xlarge", 4, True, True)
    plan = plan_launch(aws_pool(moto, instance_type=None, accelerator="A100").spec(), ec2, ssm)
    assert (plan.instance_type, plan.efa) == ("p4d.24xlarge", True)
    plan = plan_launch(aws_pool(moto, instance_type=None).spec(), ec2, ssm)
    assert (plan.instance_type, plan.cuda, plan.placement_group) == ("m6i.xlarge", False, False)
    assert "2 x m6i.xlarge in us-east-1: about $0.38/hour" in plan.cost_line(2, 12, spot=False)
    assert "at most $4.61 if it lives to max_lifetime_minutes" in plan.cost_line(2, 12, spot=False)
    uncapped = plan.cost_line(2, None, spot=False)  # no max_lifetime_minutes: the hourly cost, and no bound
    assert "about $0.38/hour" in uncapped and "no lifetime cap" in uncapped and "at most" not in uncapped
    # moto holds no Ubuntu parameter: the error names the field and the public parameter.
    with pytest.raises(PoolConfigError, match=r"image_id: unset.*/aws/service/canonical/ubuntu"):
        plan_launch(aws_pool(moto, image_id=None).spec(), ec2, ssm)


def test_a_launch_whose_nodes_never_answer_times_out_and_leaves_nothing(moto):
    started = time.monotonic()
    with pytest.raises(PoolStartError, match=r"ready_timeout_seconds: 2 of 2 node\(s\) not ready after 4s"):
        distributed_task(lambda: 1, pool=aws_pool(moto, spot=True, tags={"team": "ml"}))()
    assert time.monotonic() - started < 60
    launched = instances_of_latest_pool(moto["ec2"])
    # One RunInstances call for the whole pool, all of it terminated now.
    assert len(launched) == 2 and len({i["AmiLaunchIndex"] for i in launched}) == 2
    assert all(i["State"]["Name"] == "terminated" for i in launched)
    assert all(i["PrivateIpAddress"].startswith(moto["addresses"]) and not i.get("PublicIpAddress") for i in launched)
    assert all(i.get("InstanceLifecycle") == "spot" for i in launched)
    tags = {t["Key"]: t["Value"] for t in launched[0]["Tags"]}
    assert tags["team"] == "ml" and tags["skytasks:pool"].startswith("skytasks-") and "skytasks:expires-at" in tags


def test_a_launch_refused_by_ec2_after_the_group_and_key_exist_leaves_nothing(moto):
    from botocore.exceptions import ClientError

    # The instance profile is checked by RunInstances itself, after the pool's own security
    # group and key pair were made: the autouse check proves both are gone again.
    with pytest.raises(PoolStartError, match="NoSuchEntity") as caught:
        distributed_task(lambda: 1, pool=aws_pool(moto, iam_instance_profile="no-such-profile"))()
    assert isinstance(caught.value.__cause__, ClientError)
    assert str(caught.value).startswith("iam_instance_profile: EC2 refused RunInstances"), str(caught.value)


def refuse_launches(patch, code: str, message: str) -> None:
    """moto's EC2 refusing every RunInstances with EC2's own error code and words."""
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.instances import InstanceBackend

    def run_instances(self, image_id, count, *args, **kwargs):
        raise EC2ClientError(code, message)

    patch.setattr(InstanceBackend, "run_instances", run_instances)


@pytest.mark.parametrize("code, message, field", [
    ("InsufficientInstanceCapacity", "We currently do not have sufficient t3.micro capacity in the Availability "
                                     "Zone you requested (us-east-1a).", "nodes"),
    ("Unsupported", "Your requested instance type (t3.micro) is not supported in your requested Availability Zone "
                    "(us-east-1e).", "instance_type"),
    ("InvalidParameterValue", "Value (c0ffee) for parameter placement is invalid.", None),
    ("UnauthorizedOperation", "You are not authorized to perform this operation. Encoded authorization failure "
                              "message: abc123", "aws_credentials"),
], ids=lambda v: v if isinstance(v, str) and " " not in v else "")
def test_an_ec2_refusal_is_a_pool_start_error_in_ec2s_own_words_and_leaves_nothing(moto, monkeypatch, code, message,
                                                                                   field):
    from botocore.exceptions import ClientError

    refuse_launches(monkeypatch, code, message)
    with pytest.raises(PoolStartError) as caught:
        distributed_task(lambda: 1, pool=aws_pool(moto))()
    text = str(caught.value)
    assert code in text and message in text, text
    assert field is None or text.startswith(f"{field}: "), text
    cause = caught.value.__cause__
    assert isinstance(cause, ClientError) and cause.response["Error"]["Code"] == code
    # The autouse check: the pool's security group and key pair, made before the launch, are gone.


def test_teardown_finds_by_tag_what_an_interrupted_create_call_never_reported(moto):
    from skytasks.providers.aws.provider import AWSProvider
    provider = AWSProvider(aws_pool(moto).spec())
    provider.launch()
    # As if Ctrl-C had landed while each create call was in flight: AWS made it, the ids never came back.
    provider.owned.instance_ids, provider.owned.security_group_id, provider.owned.key_name = [], None, None
    assert len(leftovers(moto["ec2"])["instances"]) == 2
    provider.stop()  # the autouse check: nothing of it is left


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_during_the_launch_tears_everything_down(moto, tmp_path, sig):
    script = tmp_path / "launch.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from prefect_aws import AwsCredentials
from skytasks import GPUPool
from skytasks import distributed_task
creds = AwsCredentials(aws_access_key_id="testing", aws_secret_access_key="testing", region_name={REGION!r},
                       aws_client_parameters={{"endpoint_url": {moto['endpoint']!r}}})
pool = GPUPool(provider="aws", nodes=2, instance_type="t3.micro", image_id={moto['image']!r},
               subnet_id={moto['subnet']!r}, aws_credentials=creds, ssh_ingress_cidr="127.0.0.1/32",
               ready_timeout_seconds=600)
try:
    distributed_task(lambda: 1, pool=pool)()
finally:
    print("TEARDOWN", flush=True)
""")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not leftovers(moto["ec2"])["instances"]:
            assert proc.poll() is None and time.monotonic() < deadline, "the launch never happened"
            time.sleep(0.2)
        time.sleep(1.0)  # well inside the wait for readiness
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
        assert "TEARDOWN" in out and proc.returncode != 0
    finally:
        proc.kill()


def test_an_async_with_cancelled_during_the_launch_tears_everything_down(moto):
    import asyncio

    pool = aws_pool(moto, ready_timeout_seconds=600)

    async def enter_and_cancel() -> None:
        async def enter() -> None:
            async with pool:
                raise AssertionError("the pool never gets up: its nodes never answer")

        task = asyncio.create_task(enter())
        deadline = time.monotonic() + 60
        while not leftovers(moto["ec2"])["instances"]:
            assert time.monotonic() < deadline and not task.done(), "the launch never happened"
            await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(enter_and_cancel())  # asyncio.run also waits for the launch thread to finish
    assert leftovers(moto["ec2"]) == {"instances": [], "security_groups": [], "key_pairs": []}
    assert not pool.is_up


def test_user_data_pins_the_host_key_starts_the_watchdog_and_installs_what_the_torch_settings_say():
    from skytasks.providers.aws.bootstrap import render_user_data

    cuda_pool = GPUPool(provider="aws", accelerator="L4", torch_version="2.5.1", torch_cuda="cu121",
                        torchvision=">=0.20", torchaudio="latest", pip_packages=["transformers==4.46.0"],
                        idle_minutes=10, max_lifetime_minutes=60)
    text = render_user_data(cuda_pool.spec(), True, "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----",
                            "ssh-ed25519 AAAAC3 host", python_version="3.11")
    assert text.startswith("#cloud-config\n") and len(text.encode()) < 16384  # EC2's user-data limit
    config = yaml.safe_load(text)
    assert config["ssh_keys"]["ed25519_public"] == "ssh-ed25519 AAAAC3 host" and config["ssh_genkeytypes"] == []
    files = {f["path"]: f["content"] for f in config["write_files"]}
    script = files["/opt/skytasks/bootstrap.sh"]
    assert ("uv pip install --python /opt/skytasks/venv/bin/python --index-url https://download.pytorch.org/whl/cu121 "
            "torch==2.5.1 'torchvision>=0.20' torchaudio") in script
    assert "uv venv --python 3.11 /opt/skytasks/venv" in script
    assert "transformers==4.46.0" in script and "cloudpickle==" in script
    unit = files["/etc/systemd/system/skytasks-watchdog.service"]
    assert "--idle-seconds 600 --max-lifetime-seconds 3600" in unit
    assert "--notice-file" not in unit  # on-demand: EC2 gives no interruption notice to watch for
    spot = yaml.safe_load(render_user_data(GPUPool(provider="aws", spot=True).spec(), False, "k", "ssh-ed25519 A h"))
    spot_unit = {f["path"]: f["content"] for f in spot["write_files"]}["/etc/systemd/system/skytasks-watchdog.service"]
    assert "--notice-file /var/lib/skytasks/preemption-notice" in spot_unit  # what the node agent reads
    # No max_lifetime_minutes (the default): no lifetime flag, so the watchdog ends the node for idleness only.
    assert "--idle-seconds 900 --notice-file" in spot_unit and "--max-lifetime-seconds" not in spot_unit
    assert "def verdict(" in files["/opt/skytasks/watchdog.py"]
    # The watchdog starts before the bootstrap, so a controller lost during installs still ends the node.
    assert config["runcmd"].index(["systemctl", "enable", "--now", "skytasks-watchdog.service"]) < \
        config["runcmd"].index(["bash", "/opt/skytasks/bootstrap.sh"])

    cpu_pool = GPUPool(provider="aws", torch_version=">=2.3,<3")
    script = yaml.safe_load(render_user_data(cpu_pool.spec(), False, "k", "ssh-ed25519 AAAA host"))["write_files"][2]["content"]
    assert "--index-url https://download.pytorch.org/whl/cpu 'torch>=2.3,<3'\n" in script
    assert "torchvision" not in script and "cu128" not in script


def test_with_no_lifetime_cap_the_watchdogs_verdict_ends_a_node_for_idleness_only():
    from skytasks.providers.aws.watchdog import verdict

    booted, idle = 1_700_000_000.0, 900.0
    for age in (3600.0, 13 * 3600.0, 400 * 86400.0):  # an hour, past the old 12-hour default, a year on
        now = booted + age
        assert verdict(now, booted, now - 5, idle, None) is None  # a live controller: wanted at any age
        assert "controller silent for 901s" in verdict(now, booted, now - 901, idle, None)
    assert "controller silent" in verdict(booted + 901, booted, None, idle, None)  # never heard: counted from boot
    assert verdict(booted + 899, booted, None, idle, None) is None
    # With a cap, the age still ends a node whose controller is alive.
    assert "reached max lifetime (3600s)" in verdict(booted + 3600, booted, booted + 3599, idle, 3600.0)
    assert verdict(booted + 3599, booted, booted + 3598, idle, 3600.0) is None


def test_the_watchdog_shuts_down_only_once_its_heartbeat_is_stale(tmp_path):
    heartbeat, shutdown = tmp_path / "heartbeat", tmp_path / "shutdown-called"
    # No --max-lifetime-seconds: a pool with no lifetime cap (the default).
    proc = subprocess.Popen([sys.executable, str(ROOT / "skytasks/providers/aws/watchdog.py"), "--heartbeat-file", str(heartbeat),
                             "--idle-seconds", "2", "--check-every", "0.1",
                             "--started-at", str(time.time()), "--shutdown-command", f"touch {shutdown}"])
    try:
        for _ in range(30):  # 3 s of a live controller: longer than the idle limit
            heartbeat.write_text("alive")
            time.sleep(0.1)
        assert not shutdown.exists() and proc.poll() is None
        stale_since = time.monotonic()
        proc.wait(timeout=10)  # heartbeats stop: it shuts down and exits
        assert shutdown.exists() and 1.5 < time.monotonic() - stale_since < 6
    finally:
        proc.kill()


def test_the_watchdog_ends_a_node_at_its_max_lifetime_even_with_a_live_controller(tmp_path):
    heartbeat, shutdown = tmp_path / "heartbeat", tmp_path / "shutdown-called"
    heartbeat.write_text("alive")
    proc = subprocess.run([sys.executable, str(ROOT / "skytasks/providers/aws/watchdog.py"), "--heartbeat-file", str(heartbeat),
                           "--idle-seconds", "600", "--max-lifetime-seconds", "1", "--check-every", "0.1",
                           "--started-at", str(time.time()), "--shutdown-command", f"touch {shutdown}"],
                          timeout=10, capture_output=True, text=True)
    assert shutdown.exists() and "max lifetime" in proc.stderr


def test_skytasks_gc_sweeps_an_expired_pool_and_an_orphan_and_spares_a_live_one(moto):
    from skytasks.providers.aws.provider import AWSProvider

    def leak(lifetime_minutes: float, launch: bool) -> AWSProvider:
        """Resources as a controller that died (SIGKILL) would leave them: nobody tears them down."""
        provider = AWSProvider(aws_pool(moto, max_lifetime_minutes=lifetime_minutes).spec())
        if launch:
            provider.launch()
        else:  # a pool killed between its security group and its instances
            moto["ec2"].create_security_group(GroupName=provider.pool_id, VpcId=moto["vpc"], Description="x",
                                              TagSpecifications=provider.tags("security-group"))
        return provider

    expired, live, orphan = leak(0.01, True), leak(600, True), leak(600, False)
    expired._lease.stop()  # its controller died: nobody renews its lease
    a_minute_on = (datetime.now(timezone.utc) + timedelta(minutes=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
    cli = Path(sys.executable).parent / "skytasks"  # the console script the package installs
    out = subprocess.run([str(cli), "gc", "--region", REGION, "--endpoint-url",
                          moto["endpoint"], "--grace-minutes", "0", "--now", a_minute_on], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"sweeping {expired.pool_id} (expired)" in out.stdout
    assert f"sweeping {orphan.pool_id} (orphaned)" in out.stdout
    assert live.pool_id not in out.stdout
    left = leftovers(moto["ec2"])
    assert len(left["instances"]) == 2 and left["key_pairs"] == [live.pool_id]  # only the live pool remains
    live.stop()


class CloudInitStandIn(threading.Thread):
    """Plays cloud-init for moto's instances, which are only records: for each running instance,
    an sshd on its (loopback) private address with the host key from its user-data and the key
    pair's public key, and the bootstrap's status file saying "ready", in a STATE_DIR of the node's
    own (a mount namespace around its sshd and so its sessions). What the bootstrap itself
    does (uv and torch from the internet) cannot run here; its text is tested above."""

    def __init__(self, ec2, folder: Path, status: str = "ready"):
        super().__init__(daemon=True)
        self.ec2, self.folder, self.servers, self.user_data, self.status = ec2, folder, {}, {}, status
        self.booted_at: dict[str, float] = {}  # when each instance's "boot" (its sshd) was done
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            running = self.ec2.describe_instances(Filters=[{"Name": "instance-state-name", "Values": ["running"]}])
            for instance in (i for r in running["Reservations"] for i in r["Instances"]):
                iid = instance["InstanceId"]
                if iid in self.servers:
                    continue
                raw = self.ec2.describe_instance_attribute(InstanceId=iid, Attribute="userData")["UserData"]["Value"]
                config = yaml.safe_load(base64.b64decode(raw))
                [pair] = self.ec2.describe_key_pairs(KeyNames=[instance["KeyName"]], IncludePublicKey=True)["KeyPairs"]
                self.user_data[iid] = config
                state = self.state_dir(iid)  # this node's STATE_DIR: tests on other workers boot nodes too
                state.mkdir(parents=True, exist_ok=True)
                (state / "status").write_text(self.status + "\n")
                self.servers[iid] = SSHServer(self.folder / iid, [instance["PrivateIpAddress"]], 22,
                                              host_key=config["ssh_keys"]["ed25519_private"],
                                              authorized_key=pair["PublicKey"], own_folders={str(STATE_DIR): state})
                self.booted_at[iid] = time.time()

    def state_dir(self, iid: str) -> Path:
        return self.folder / iid / "state"

    def stop(self) -> None:
        self.done.set()
        self.join()
        for server in self.servers.values():
            server.stop()


def gloo_sum() -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(rank_info().rank + 1)])
    dist.all_reduce(t)
    return {"rank": rank_info().rank, "peers": rank_info().peers, "sum": t.item()}


def test_a_2_node_job_on_launched_instances_in_a_flow_then_everything_is_terminated(moto, tmp_path):
    from prefect import flow

    stand_in = CloudInitStandIn(moto["ec2"], tmp_path)
    stand_in.start()
    pool = aws_pool(moto, ssh_user="root", remote_python=sys.executable, ready_timeout_seconds=120)

    @flow
    def train_on_ec2():
        from prefect.runtime import flow_run

        return distributed_task(gloo_sum, pool=pool)(), flow_run.id

    try:
        results, flow_run_id = train_on_ec2()
        progress = launch_progress(flow_run_id)
        heartbeat_seen = all((stand_in.state_dir(iid) / "heartbeat").exists() for iid in stand_in.servers)
    finally:
        stand_in.stop()
    launched = instances_of_latest_pool(moto["ec2"])
    addresses = tuple(i["PrivateIpAddress"] for i in sorted(launched, key=lambda i: i["AmiLaunchIndex"]))
    assert [r["rank"] for r in results] == [0, 1] and {r["sum"] for r in results} == {3.0}
    assert results[0]["peers"] == addresses  # reached on private addresses: these instances have no public one
    assert heartbeat_seen  # the agent fed the node's watchdog while the controller was there
    tags = {t["Key"]: t["Value"] for t in launched[0]["Tags"]}
    assert tags["prefect.io/flow-run-id"] == flow_run_id
    assert all(i["State"]["Name"] == "terminated" for i in launched)
    assert progress == (f"{tags['skytasks:pool']}-launch", 100.0)  # the launch's progress artifact, in the flow


def launch_progress(flow_run_id: str) -> tuple:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"])))

    found = [a for a in asyncio.run(read()) if a.key and a.key.endswith("-launch")]
    return (found[0].key, float(found[0].data)) if found else None


def test_the_lease_runs_out_idle_minutes_after_the_last_renewal_and_never_past_a_cap():
    from skytasks.providers.remote_fields import lease_expiry, renew_every_seconds

    start = datetime(2026, 1, 1, tzinfo=timezone.utc)
    now = start + timedelta(days=30)  # a month-long run, renewed just now
    assert renew_every_seconds(15) == 300 and renew_every_seconds(0.05) == 5
    assert lease_expiry(now, start, 15, None) == now + timedelta(minutes=25)  # idle_minutes and two renewals
    assert lease_expiry(now, start, 15, 720) == start + timedelta(hours=12)  # a cap still bounds it
    assert lease_expiry(start, start, 15, 720) == start + timedelta(minutes=25)


def _instance_leases(ec2, pool_id: str) -> list[datetime]:
    from skytasks.providers.aws.resources import EXPIRES_TAG, parse_time

    found = ec2.describe_instances(Filters=[{"Name": "tag:skytasks:pool", "Values": [pool_id]},
                                            {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    tags = [{t["Key"]: t["Value"] for t in i["Tags"]} for r in found["Reservations"] for i in r["Instances"]]
    return [when for t in tags if (when := parse_time(t.get(EXPIRES_TAG)))]


def test_an_uncapped_pool_keeps_its_lease_while_its_controller_lives_and_gc_sweeps_it_once_nobody_renews_it(moto):
    from skytasks.providers.aws.gc import sweep
    from skytasks.providers.aws.provider import AWSProvider

    ec2 = moto["ec2"]
    default = AWSProvider(aws_pool(moto).spec())  # no max_lifetime_minutes; idle_minutes=15
    default.launch()
    try:
        leases = _instance_leases(ec2, default.pool_id)
        soon = datetime.now(timezone.utc) + timedelta(minutes=25, seconds=5)
        assert len(leases) == 2 and all(lease <= soon for lease in leases)  # a lease, not a lifetime
    finally:
        default.stop()
    # A 3-second idle limit: renewed every 5 s, a lease of 13 s.
    live, dead = (AWSProvider(aws_pool(moto, idle_minutes=0.05).spec()) for _ in range(2))
    live.launch()
    dead.launch()
    dead._lease.stop()  # its controller died (SIGKILL): nobody renews its lease
    try:
        first = min(_instance_leases(ec2, live.pool_id))
        deadline = time.monotonic() + 60
        while True:  # until the dead pool's lease runs out
            swept = sweep(ec2, grace_minutes=0, dry_run=True)
            assert live.pool_id not in swept
            if dead.pool_id in swept:
                break
            assert time.monotonic() < deadline, "the dead pool's lease never ran out"
            time.sleep(0.5)
        assert min(_instance_leases(ec2, live.pool_id)) > first  # renewed, on every instance
        # Its security group and key pair still carry the lease they were made with, run out by
        # now: the instances' lease is the pool's.
        assert sweep(ec2, grace_minutes=0) == [dead.pool_id]
        an_hour_on = datetime.now(timezone.utc) + timedelta(hours=1)
        assert live.pool_id in sweep(ec2, now=an_hour_on, dry_run=True)  # were its controller gone too
    finally:
        live.stop()
        dead.stop()
    assert leftovers(ec2) == {"instances": [], "security_groups": [], "key_pairs": []}


def test_the_gc_flow_sweeps_with_a_saved_credentials_block(moto):
    from flows.gc_sweep import skytasks_gc
    from skytasks.providers.aws.provider import AWSProvider

    moto["creds"].save("skytasks-test-moto", overwrite=True)
    provider = AWSProvider(aws_pool(moto, max_lifetime_minutes=0.01).spec())
    provider.launch()
    provider._lease.stop()  # its controller died: nobody renews its lease
    an_hour_on = datetime.now(timezone.utc) + timedelta(hours=1)  # long past its 0.6 s lifetime
    assert skytasks_gc(aws_credentials_block="skytasks-test-moto", now=an_hour_on) == [provider.pool_id]


def test_a_node_whose_bootstrap_failed_fails_the_launch_at_once_with_its_log(moto, tmp_path):
    stand_in = CloudInitStandIn(moto["ec2"], tmp_path, status="failed: ERROR: No matching distribution for torch==9.9")
    stand_in.start()
    started = time.monotonic()
    try:
        with pytest.raises(PoolStartError, match=r"bootstrap failed: ERROR: No matching distribution for torch==9\.9"):
            distributed_task(lambda: 1, pool=aws_pool(moto, ssh_user="root", ready_timeout_seconds=300))()
    finally:
        stand_in.stop()
    assert time.monotonic() - started < 60  # not the 300 s readiness timeout


def test_a_node_python_without_torch_fails_the_start_naming_remote_python_and_terminates_everything(moto, tmp_path):
    system_python = "/usr/bin/python3"  # the system's own Python: no torch, no cloudpickle
    lacks = subprocess.run([system_python, "-c", "import torch"], capture_output=True, text=True)
    assert lacks.returncode != 0, "this test needs a Python without torch"
    stand_in = CloudInitStandIn(moto["ec2"], tmp_path)
    stand_in.start()
    try:
        with pytest.raises(PoolStartError) as caught:
            distributed_task(lambda: 1, pool=aws_pool(moto, ssh_user="root", remote_python=system_python,
                                                      ready_timeout_seconds=120))()
    finally:
        stand_in.stop()
    text = str(caught.value)
    assert text.startswith("remote_python: node ") and f"remote_python={system_python!r}" in text, text
    assert "ModuleNotFoundError: No module named 'torch'" in text, text
    assert all(i["State"]["Name"] == "terminated" for i in instances_of_latest_pool(moto["ec2"]))


def lose_node_1_once(marker: str) -> dict:
    import time

    import torch.distributed as dist

    info = rank_info()
    if info.rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()  # the test now terminates this instance
        time.sleep(120)
    dist.barrier()
    return {"attempt": info.attempt, "peers": info.peers, "running_at": time.time()}


def test_a_terminated_instance_is_replaced_on_retry_and_everything_ends_terminated(moto, tmp_path):
    import threading
    import time

    stand_in = CloudInitStandIn(moto["ec2"], tmp_path)
    stand_in.start()
    pool = aws_pool(moto, ssh_user="root", remote_python=sys.executable, ready_timeout_seconds=120)
    marker = tmp_path / "lost"
    terminated: dict = {}

    def terminate_node_1_when_asked() -> None:  # what a spot interruption does to a node
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        first = pool_instances()
        terminated["originals"] = {i["InstanceId"] for i in first}
        victim = max(first, key=lambda i: i["AmiLaunchIndex"])  # node 1 of the launch
        terminated["id"], terminated["at"] = victim["InstanceId"], time.time()
        moto["ec2"].terminate_instances(InstanceIds=[victim["InstanceId"]])
        stand_in.servers[victim["InstanceId"]].stop()  # the machine is gone, sessions and all

    def pool_instances() -> list[dict]:
        return [i for i in instances_of_latest_pool(moto["ec2"]) if i["State"]["Name"] == "running"]

    killer = threading.Thread(target=terminate_node_1_when_asked, daemon=True)
    killer.start()
    try:
        results = distributed_task(lose_node_1_once, pool=pool, retries=1)(str(marker))
    finally:
        killer.join(timeout=5)
        stand_in.stop()
    launched = instances_of_latest_pool(moto["ec2"])
    assert [r["attempt"] for r in results] == [2, 2]
    assert len(launched) == 3 and terminated["id"] in {i["InstanceId"] for i in launched}
    [replacement] = [i for i in launched if i["InstanceId"] not in terminated["originals"]]
    originals = [i for i in launched if i is not replacement]
    assert results[0]["peers"][1] == replacement["PrivateIpAddress"]  # node 1 is the new instance
    tags = lambda i: {t["Key"]: t["Value"] for t in i["Tags"]}  # noqa: E731
    assert tags(replacement)["skytasks:pool"] == tags(originals[0])["skytasks:pool"]
    assert [g["GroupId"] for g in replacement["SecurityGroups"]] == [g["GroupId"] for g in originals[0]["SecurityGroups"]]
    assert replacement["KeyName"] == originals[0]["KeyName"]
    assert all(i["State"]["Name"] == "terminated" for i in launched)
    back = min(r["running_at"] for r in results)
    booting = stand_in.booted_at[replacement["InstanceId"]] - terminated["at"]
    print(f"aws (moto): lost node to retry running {back - terminated['at']:.2f}s, of which waiting for the "
          f"new instance to boot {booting:.2f}s: {back - terminated['at'] - booting:.2f}s without the launch")


def test_a_termination_that_fails_reaches_the_flow_runs_log_an_event_and_the_caller(moto, monkeypatch):
    """An H100 node left running costs about $100 an hour: a teardown that cannot confirm it gone
    is an ERROR in the flow run naming every id, an event to page on, and an error to the caller."""
    from datetime import datetime, timedelta, timezone

    from prefect import flow
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, LogFilterLevel

    from skytasks import PoolTeardownError
    from skytasks.providers.aws import resources
    from skytasks.providers.aws.provider import AWSProvider
    from tests.harness.prefect_api import logs_when
    from tests.test_prefect_native import _wait_for_events

    monkeypatch.setattr(resources, "POLL_SECONDS", 0.01)  # the group's DependencyViolation retries
    ec2 = moto["ec2"]
    since = datetime.now(timezone.utc) - timedelta(seconds=1)
    seen: dict = {}

    @flow
    def launch_then_fail_to_terminate():
        from prefect.runtime import flow_run

        seen["flow_run"] = flow_run.get_id()
        provider = seen["provider"] = AWSProvider(aws_pool(moto).spec())
        provider.launch()
        seen["stuck"] = provider.owned.instance_ids[0]
        ec2.modify_instance_attribute(InstanceId=seen["stuck"], DisableApiTermination={"Value": True})
        provider.stop()

    try:
        with pytest.raises(PoolTeardownError) as caught:
            launch_then_fail_to_terminate()
        assert seen["stuck"] in str(caught.value) and "OperationNotPermitted" in str(caught.value)
        events = _wait_for_events("skytasks.pool.teardown-failed", since, {"skytasks.pool.teardown-failed"},
                                  seen["flow_run"])
        [event] = [e for e in events if e["event"] == "skytasks.pool.teardown-failed"]
        assert seen["stuck"] in event["payload"]["resources"] and event["payload"]["provider"] == "aws"
        errors = [log.message for log in logs_when(
            LogFilter(flow_run_id=LogFilterFlowRunId(any_=[seen["flow_run"]]), level=LogFilterLevel(ge_=40)),
            lambda logs: any("teardown could not confirm" in log.message for log in logs))]
        assert any(seen["stuck"] in line and "teardown could not confirm" in line for line in errors), errors
    finally:  # what a person does after the page: allow termination, and clean up
        for iid in [i["InstanceId"] for i in instances_of_latest_pool(ec2)]:
            ec2.modify_instance_attribute(InstanceId=iid, DisableApiTermination={"Value": False})
        if "provider" in seen:
            seen["provider"].stop()


def limit_ec2_capacity(patch, left: dict) -> None:
    """moto's EC2 with a capacity: a RunInstances for more instances than `left["instances"]` is
    refused with EC2's own InsufficientInstanceCapacity, as a real region says when it has no
    more. `patch` is a pytest monkeypatch (or one of its contexts)."""
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.models.instances import InstanceBackend

    launch = InstanceBackend.run_instances

    def run_instances(self, image_id, count, *args, **kwargs):
        if count > left["instances"]:
            raise EC2ClientError("InsufficientInstanceCapacity",
                                 f"We currently do not have sufficient capacity for {count} instances in the "
                                 f"Availability Zone you requested.")
        left["instances"] -= count
        return launch(self, image_id, count, *args, **kwargs)

    patch.setattr(InstanceBackend, "run_instances", run_instances)


@pytest.fixture
def ec2_capacity(monkeypatch):
    left = {"instances": 2}
    limit_ec2_capacity(monkeypatch, left)
    return left


def world_and_peers() -> dict:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return {"world": rank_info().world_size, "sum": t.item(), "peers": rank_info().peers}


def test_an_elastic_launch_takes_what_ec2_has_and_grows_back_when_capacity_returns(moto, ec2_capacity, tmp_path,
                                                                                 monkeypatch):
    """nodes=3, min_nodes=2 in a region with room for 2: EC2 refuses 3 (InsufficientInstanceCapacity),
    the pool launches 2, says why and what the 2 cost, and runs. When capacity returns, the next
    call inside `with pool:` launches the third alike, and every instance ends terminated."""
    stand_in = CloudInitStandIn(moto["ec2"], tmp_path)
    stand_in.start()
    pool = aws_pool(moto, nodes=3, min_nodes=2, ssh_user="root", remote_python=sys.executable,
                    ready_timeout_seconds=120)
    try:
        with pool:
            session = pool.runtime().session
            said = "\n".join(session.provider.reporter.lines)
            assert len(instances_of_latest_pool(moto["ec2"])) == 2  # what moto holds: 2, not 3
            first = distributed_task(world_and_peers, pool=pool)()  # tried to grow: no capacity
            ec2_capacity["instances"] = 5  # capacity came back
            held_off = distributed_task(world_and_peers, pool=pool)()  # within a minute: not tried again
            monkeypatch.setenv("SKYTASKS_GROW_RETRY_SECONDS", "0")
            second = distributed_task(world_and_peers, pool=pool)()
            grown = instances_of_latest_pool(moto["ec2"])
            said_later = "\n".join(session.provider.reporter.lines)
    finally:
        stand_in.stop()
    assert "launched 2 of 3 nodes (InsufficientInstanceCapacity for 3" in said, said
    assert "provisioning 2 x t3.micro" in said.split("launched 2 of 3 nodes")[1], said  # the cost of 2
    assert [r["world"] for r in first] == [2, 2] and [r["sum"] for r in first] == [2.0, 2.0]
    assert [r["world"] for r in held_off] == [2, 2]
    assert "could not grow: nodes: EC2 has no capacity for 1 t3.micro instance now" in said_later, said_later
    assert [r["world"] for r in second] == [3, 3, 3] and [r["sum"] for r in second] == [3.0] * 3
    assert len(grown) == 3 and set(second[0]["peers"]) == {i["PrivateIpAddress"] for i in grown}
    tags = lambda i: {t["Key"]: t["Value"] for t in i["Tags"]}  # noqa: E731
    assert len({tags(i)["skytasks:pool"] for i in grown}) == 1  # the third is the pool's own
    assert all(i["State"]["Name"] == "terminated" for i in instances_of_latest_pool(moto["ec2"]))


def test_below_min_nodes_ec2s_capacity_error_names_nodes_and_nothing_is_left(moto, ec2_capacity):
    ec2_capacity["instances"] = 1
    with pytest.raises(PoolStartError, match=r"nodes: EC2 has no capacity for 2 t3.micro instances now "
                                             r"\(InsufficientInstanceCapacity for 2"):
        distributed_task(lambda: 1, pool=aws_pool(moto, nodes=3, min_nodes=2))()


def test_the_watchdog_turns_a_spot_interruption_from_imdsv2_into_the_agents_notice(tmp_path):
    """The instance metadata service, played on loopback (the watchdog's --metadata-url), first
    has no instance-action (404), then one: the watchdog writes the notice file, and a node
    agent reading it tells its controller, with EC2's time as the deadline."""
    import http.server
    import json as jsonlib

    from skytasks.protocol import Op
    from skytasks.wire import read_frame

    action = {"action": "terminate", "time": "2030-01-01T00:02:00Z"}
    state = {"scheduled": False, "tokens": 0}

    class Metadata(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):  # IMDSv2: a session token first
            assert self.headers["X-aws-ec2-metadata-token-ttl-seconds"]
            state["tokens"] += 1
            self._answer(200, b"token-123")

        def do_GET(self):
            if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                return self._answer(401, b"")
            if self.path == "/latest/meta-data/spot/instance-action" and state["scheduled"]:
                return self._answer(200, jsonlib.dumps(action).encode())
            self._answer(404, b"")

        def _answer(self, code, body):
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metadata)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    notice, heartbeat = tmp_path / "notice", tmp_path / "beat"
    heartbeat.write_text("0")
    watchdog = subprocess.Popen([sys.executable, str(ROOT / "skytasks/providers/aws/watchdog.py"),
                                 "--heartbeat-file", str(heartbeat), "--idle-seconds", "600",
                                 "--max-lifetime-seconds", "600", "--notice-file", str(notice),
                                 "--started-at", str(time.time()),
                                 "--metadata-url", f"http://127.0.0.1:{server.server_port}", "--notice-every", "0.2",
                                 "--shutdown-command", "true"])
    agent = subprocess.Popen([sys.executable, "-m", "skytasks.node.agent", "--heartbeat-seconds", "5",
                              "--heartbeat-timeout", "60", "--sample-seconds", "5", "--notice-file", str(notice)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert read_frame(agent.stdout)["op"] == Op.HELLO
        deadline = time.monotonic() + 15
        while state["tokens"] < 2 and time.monotonic() < deadline:  # the watchdog asks every 0.2 s
            time.sleep(0.1)
        assert not notice.exists() and state["tokens"] >= 2  # asked, and nothing scheduled yet
        state["scheduled"] = True
        msg = read_frame(agent.stdout)
        while msg["op"] != Op.NOTICE:
            msg = read_frame(agent.stdout)
        assert "EC2 spot interruption: instance-action terminate at 2030-01-01T00:02:00Z" in msg["reason"]
        assert msg["deadline"] == datetime(2030, 1, 1, 0, 2, tzinfo=timezone.utc).timestamp()
    finally:
        watchdog.terminate()
        agent.stdin.close()
        agent.wait(timeout=10)
        watchdog.wait(timeout=10)
        server.shutdown()
