"""`skytasks check` for an aws pool: EC2's answers to the pool's start, with nothing launched.

Reads only, then one DryRun: that the credentials work (STS GetCallerIdentity), that the instance
type, image, subnet, security groups and key pair the pool names exist (the Describe calls of
`plan.py`, each its own line), that the instance type is offered in the subnet's zone, and
EC2's `DryRun=True` RunInstances with the request the start would send (`provider.launch_request`):
`DryRunOperation` means EC2 would have launched it (permissions, the image, the user-data, the
tags); anything else is EC2's refusal in its words. The pool's own security group, key pair and
placement group are made only as it starts, so the DryRun asks without them.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Callable, Iterator

from skytasks.errors import PoolConfigError
from skytasks.pool_spec import PoolSpec
from skytasks.providers.aws import plan as aws_plan
from skytasks.providers.aws.capacity import refused
from skytasks.providers.aws.spec import AWSSettings
from skytasks.providers.checks import Check


def _error(exc: BaseException) -> str:
    """An AWS error (or a PoolConfigError naming the field) in its own words."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and "Error" in response:
        error = response["Error"]
        return f"{error.get('Code', 'Unknown')}: {error.get('Message', '') or exc}"
    return str(exc)


def run(spec: PoolSpec) -> Iterator[Check]:
    from botocore.exceptions import BotoCoreError, ClientError

    aws = spec.own(AWSSettings)
    failed = False

    def ask(name: str, question: Callable[[], str]) -> Check:
        nonlocal failed
        try:
            return Check(name, True, question())
        except (ClientError, BotoCoreError, PoolConfigError) as exc:
            failed = True
            return Check(name, False, _error(exc))

    try:
        ec2, ssm, sts = (spec.credentials.get_client(s) for s in ("ec2", "ssm", "sts"))
    except (BotoCoreError, ValueError) as exc:
        yield Check("the AWS credentials work", False, str(exc))
        return
    region = ec2.meta.region_name

    def identity() -> str:
        said = sts.get_caller_identity()
        return f"{said['Arn']} (account {said['Account']}), region {region}"

    yield (check := ask("the AWS credentials work", identity))
    if not check.passed:
        return

    found: dict[str, Any] = {}
    instance_type = aws.instance_type or ""

    def the_type() -> str:
        nonlocal instance_type
        instance_type, info, gpus = aws_plan.find_instance_type(ec2, spec, region)
        found["type"] = info
        return f"{info.get('VCpuInfo', {}).get('DefaultVCpus', '?')} vCPUs, {gpus} GPU(s)"

    yield ask(f"instance type {aws.instance_type or '(the default for the accelerator)'} exists in {region}", the_type)

    def the_image() -> str:
        image_id, image = aws_plan.find_image(ec2, ssm, spec, found.get("type", {}), region)
        return f"{image_id}: {image.get('Name', '')}".rstrip(": ")

    yield ask(f"image {aws.image_id or '(the default image)'} exists", the_image)

    def the_subnet() -> str:
        subnet = found["subnet"] = aws_plan.find_subnet(ec2, aws.subnet_id)
        return f"{subnet['SubnetId']} in {subnet['VpcId']}, {subnet['AvailabilityZone']}"

    yield ask(f"subnet {aws.subnet_id or '(the default subnet)'} exists", the_subnet)
    if "type" in found and "subnet" in found:
        yield _offered(ec2, instance_type, found["subnet"]["AvailabilityZone"])
    if aws.security_group_ids:
        yield ask(f"security groups {', '.join(aws.security_group_ids)} exist", lambda: ", ".join(
            f"{g['GroupId']} ({g.get('GroupName', '')})"
            for g in ec2.describe_security_groups(GroupIds=list(aws.security_group_ids))["SecurityGroups"]))
    if aws.key_name:
        yield ask(f"key pair {aws.key_name} exists", lambda: ", ".join(
            k.get("KeyFingerprint", "") for k in ec2.describe_key_pairs(KeyNames=[aws.key_name])["KeyPairs"]))
    cidr = aws.ssh_ingress_cidr
    if cidr is None:
        def address() -> str:
            nonlocal cidr
            cidr = f"{aws_plan.controller_public_ip()}/32"
            return f"{cidr}, the nodes' SSH rule (ssh_ingress_cidr unset)"

        yield ask("this machine's public address can be looked up", address)
    dry_run = f"EC2 would launch the nodes (RunInstances DryRun, {spec.fewest}-{spec.nodes} x {instance_type or '?'})"
    if failed:
        yield Check(dry_run, None, "not asked: a check above failed")
        return
    yield _dry_run(spec, ec2, ssm, cidr or "127.0.0.1/32", dry_run)


def _offered(ec2: Any, instance_type: str, zone: str) -> Check:
    from botocore.exceptions import BotoCoreError, ClientError

    name = f"instance type {instance_type} is offered in {zone} (the subnet's zone)"
    try:
        offers = ec2.describe_instance_type_offerings(LocationType="availability-zone", Filters=[
            {"Name": "location", "Values": [zone]}, {"Name": "instance-type", "Values": [instance_type]}]
        )["InstanceTypeOfferings"]
    except (ClientError, BotoCoreError) as exc:
        return Check(name, None, f"cannot ask: {_error(exc)}")
    if offers:
        return Check(name, True)
    return Check(name, False, f"instance_type: EC2 offers no {instance_type} in {zone}; choose a subnet_id in a zone "
                              f"that has it, or another instance_type")


def _dry_run(spec: PoolSpec, ec2: Any, ssm: Any, cidr: str, name: str) -> Check:
    import asyncssh
    from botocore.exceptions import BotoCoreError, ClientError

    from skytasks.providers.aws.provider import launch_request
    from skytasks.providers.aws.resources import pool_tags
    from skytasks.providers.remote_fields import lease_expiry
    from skytasks.event_bus import flow_run_id

    aws = spec.own(AWSSettings)
    try:
        plan = aws_plan.plan_launch(spec, ec2, ssm, public_ip_lookup=lambda: cidr.split("/")[0])
    except PoolConfigError as exc:
        return Check(name, False, str(exc))

    def tags(resource_type: str) -> list[dict]:
        now = datetime.now(timezone.utc)
        found = pool_tags("skytasks-check", lease_expiry(now, now, aws.idle_minutes, aws.max_lifetime_minutes),
                          aws.tags, flow_run_id())
        return [{"ResourceType": resource_type, "Tags": [{"Key": k, "Value": v} for k, v in found.items()]}]

    request = launch_request(spec, plan, asyncssh.generate_private_key("ssh-ed25519"), tags,
                             list(aws.security_group_ids), aws.key_name, None)
    try:
        ec2.run_instances(**request, MinCount=spec.fewest, MaxCount=spec.nodes, DryRun=True)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "DryRunOperation":
            return Check(name, True, exc.response["Error"].get("Message", ""))
        return Check(name, False, refused(exc, "a DryRun of the launch"))
    except BotoCoreError as exc:
        return Check(name, False, str(exc))
    # Never so: a DryRun that launched. Said, not hidden.
    return Check(name, False, "EC2 answered a DryRun without DryRunOperation: look for instances it launched")
