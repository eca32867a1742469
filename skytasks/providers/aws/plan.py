"""What an aws pool will launch, worked out and checked against EC2 before anything is launched.

Every check here is a read (DescribeInstanceTypes, DescribeImages, DescribeSubnets, SSM
GetParameter): a pool with a typo in its instance type or AMI fails in a second, naming the field,
instead of after a quarter of an hour of provisioning, or after a bill.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import urllib.request
from dataclasses import dataclass
from typing import Any

from skytasks.errors import PoolConfigError

from skytasks.providers.aws.spec import AWSSettings

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec

# GPU model -> instance types that carry it, smallest first, with their GPU count. The first
# with at least `accelerators_per_node` GPUs is chosen.
ACCELERATOR_TYPES: dict[str, list[tuple[str, int]]] = {
    "A100": [("p4d.24xlarge", 8)],
    "H100": [("p5.48xlarge", 8)],
    "H200": [("p5en.48xlarge", 8)],
    "A10G": [("g5.xlarge", 1), ("g5.12xlarge", 4), ("g5.48xlarge", 8)],
    "L4": [("g6.xlarge", 1), ("g6.12xlarge", 4), ("g6.48xlarge", 8)],
    "L40S": [("g6e.xlarge", 1), ("g6e.12xlarge", 4), ("g6e.48xlarge", 8)],
    "T4": [("g4dn.xlarge", 1), ("g4dn.12xlarge", 4), ("g4dn.metal", 8)],
    "V100": [("p3.2xlarge", 1), ("p3.8xlarge", 4), ("p3.16xlarge", 8)],
}
CPU_INSTANCE_TYPE = "m6i.xlarge"

# On-demand list prices in us-east-1, USD per hour (2025). An estimate to say out loud before
# launching, not a bill: other regions and spot differ, and types not listed get no estimate.
PRICES_USD_PER_HOUR: dict[str, float] = {
    "m6i.xlarge": 0.192, "m6i.2xlarge": 0.384, "c6i.xlarge": 0.17, "t3.micro": 0.0104, "t3.medium": 0.0416,
    "p4d.24xlarge": 21.96, "p5.48xlarge": 55.04, "g5.xlarge": 1.006, "g5.12xlarge": 5.672, "g5.48xlarge": 16.288,
    "g6.xlarge": 0.805, "g6.12xlarge": 4.602, "g6.48xlarge": 13.35, "g6e.xlarge": 1.861, "g4dn.xlarge": 0.526,
    "g4dn.12xlarge": 3.912, "g4dn.metal": 7.824, "p3.2xlarge": 3.06, "p3.8xlarge": 12.24, "p3.16xlarge": 24.48,
}

# AWS's public SSM parameters for current images. Ubuntu, so both kinds log in as "ubuntu"; the
# Deep Learning base AMI brings the NVIDIA driver (and EFA) that CUDA wheels need.
DEFAULT_IMAGE_PARAMETERS = {
    ("cpu", "x86_64"): "/aws/service/canonical/ubuntu/server/24.04/stable/current/amd64/hvm/ebs-gp3/ami-id",
    ("cpu", "arm64"): "/aws/service/canonical/ubuntu/server/24.04/stable/current/arm64/hvm/ebs-gp3/ami-id",
    ("cuda", "x86_64"): "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
    ("cuda", "arm64"): "/aws/service/deeplearning/ami/arm64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id",
}
DEFAULT_LOGIN = "ubuntu"


@dataclass
class LaunchPlan:
    region: str
    instance_type: str
    image_id: str
    root_device: str  # the image's own root device name: the volume size applies to it
    login: str
    subnet_id: str
    vpc_id: str
    gpus_per_node: int
    cuda: bool
    efa: bool
    placement_group: bool
    ssh_ingress_cidr: str
    price_per_hour: float | None

    def cost_line(self, nodes: int, max_hours: float | None, spot: bool) -> str:
        """What the launch costs, as the progress says it; `max_hours` None: the pool has no lifetime cap."""
        what = f"{nodes} x {self.instance_type} in {self.region}"
        if self.price_per_hour is None:
            return f"provisioning {what}; no price known for {self.instance_type}"
        hourly = self.price_per_hour * nodes
        kind = "spot, billed below this on-demand estimate" if spot else "on-demand"
        line = f"provisioning {what}: about ${hourly:,.2f}/hour ({kind}, ${self.price_per_hour:,.3f} per node); "
        if max_hours is None:
            return line + "no lifetime cap: it runs as long as the work does (set max_lifetime_minutes to bound it)"
        return line + f"at most ${hourly * max_hours:,.2f} if it lives to max_lifetime_minutes"


def plan_launch(spec: PoolSpec, ec2: Any, ssm: Any, *, public_ip_lookup=None) -> LaunchPlan:
    """Resolve defaults and validate the pool against the account, naming the field at fault."""
    aws = spec.own(AWSSettings)
    from botocore.exceptions import ClientError

    region = ec2.meta.region_name
    instance_type, info, gpus = find_instance_type(ec2, spec, region)
    cuda = spec.accelerator is not None
    image_id, image = find_image(ec2, ssm, spec, info, region)

    subnet = find_subnet(ec2, aws.subnet_id)
    for field, call in (("security_group_ids", lambda: ec2.describe_security_groups(GroupIds=aws.security_group_ids)),
                        ("key_name", lambda: ec2.describe_key_pairs(KeyNames=[aws.key_name]))):
        if getattr(aws, field):
            try:
                call()
            except ClientError as exc:
                raise PoolConfigError(f"{field}: {exc.response['Error']['Message']}") from None
    cidr = aws.ssh_ingress_cidr or f"{(public_ip_lookup or controller_public_ip)()}/32"
    return LaunchPlan(
        region=region, instance_type=instance_type, image_id=image_id,
        root_device=image.get("RootDeviceName") or "/dev/sda1",
        login=aws.ssh_user or DEFAULT_LOGIN, subnet_id=subnet["SubnetId"], vpc_id=subnet["VpcId"],
        gpus_per_node=gpus, cuda=cuda, efa=bool(info.get("NetworkInfo", {}).get("EfaSupported")) and cuda,
        # A cluster placement group puts GPU nodes on one network spine: NCCL's all-reduce is
        # the step time. CPU pools gain little and some CPU types do not support it.
        placement_group=cuda and spec.nodes > 1, ssh_ingress_cidr=cidr,
        price_per_hour=PRICES_USD_PER_HOUR.get(instance_type),
    )


def default_instance_type(accelerator: str | None, per_node: int) -> str:
    if accelerator is None:
        return CPU_INSTANCE_TYPE
    choices = ACCELERATOR_TYPES.get(accelerator.upper())
    if choices is None:
        raise PoolConfigError(f"accelerator: no default instance type for {accelerator!r} "
                              f"(known: {', '.join(ACCELERATOR_TYPES)}); set instance_type")
    for instance_type, gpus in choices:
        if gpus >= per_node:
            return instance_type
    raise PoolConfigError(f"accelerators_per_node: no {accelerator} instance type has {per_node} GPUs "
                          f"(at most {choices[-1][1]}); set instance_type")


def find_instance_type(ec2: Any, spec: PoolSpec, region: str) -> tuple[str, dict, int]:
    """The pool's instance type (the accelerator's default if unset), as EC2 describes it, and
    its GPUs per node; PoolConfigError naming the field if EC2 has no such type, or too few GPUs."""
    from botocore.exceptions import ClientError

    instance_type = spec.own(AWSSettings).instance_type or default_instance_type(spec.accelerator,
                                                                                 spec.accelerators_per_node or 0)
    try:
        [info] = ec2.describe_instance_types(InstanceTypes=[instance_type])["InstanceTypes"]
    except ClientError as exc:
        raise PoolConfigError(f"instance_type: {instance_type!r} does not exist in {region} "
                              f"({exc.response['Error']['Message']})") from None
    gpus = sum(g.get("Count", 0) for g in info.get("GpuInfo", {}).get("Gpus", []))
    if spec.accelerator and gpus and gpus < (spec.accelerators_per_node or 1):
        raise PoolConfigError(f"accelerators_per_node: {instance_type} has {gpus} GPU(s), "
                              f"{spec.accelerators_per_node} asked for")
    return instance_type, info, gpus


def find_image(ec2: Any, ssm: Any, spec: PoolSpec, info: dict, region: str) -> tuple[str, dict]:
    """The pool's image (the default for the instance type's architecture, CUDA or not, if
    unset) and EC2's description of it; PoolConfigError naming image_id if there is none."""
    from botocore.exceptions import ClientError

    arch = "arm64" if info.get("ProcessorInfo", {}).get("SupportedArchitectures") == ["arm64"] else "x86_64"
    image_id = spec.own(AWSSettings).image_id or default_image(ssm, spec.accelerator is not None, arch)
    try:
        images = ec2.describe_images(ImageIds=[image_id])["Images"]
    except ClientError as exc:
        raise PoolConfigError(f"image_id: {image_id!r} ({exc.response['Error']['Message']})") from None
    if not images:
        raise PoolConfigError(f"image_id: {image_id!r} does not exist in {region}")
    return image_id, images[0]


def default_image(ssm: Any, cuda: bool, arch: str) -> str:
    from botocore.exceptions import ClientError

    name = DEFAULT_IMAGE_PARAMETERS[("cuda" if cuda else "cpu", arch)]
    try:
        return ssm.get_parameter(Name=name)["Parameter"]["Value"]
    except ClientError as exc:
        raise PoolConfigError(f"image_id: unset, and the default image could not be read from the public SSM "
                              f"parameter {name} ({exc.response['Error']['Code']}); set image_id") from None


def find_subnet(ec2: Any, subnet_id: str | None) -> dict:
    from botocore.exceptions import ClientError

    if subnet_id:
        try:
            return ec2.describe_subnets(SubnetIds=[subnet_id])["Subnets"][0]
        except (ClientError, IndexError):
            raise PoolConfigError(f"subnet_id: {subnet_id!r} does not exist") from None
    defaults = ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])["Subnets"]
    if not defaults:
        raise PoolConfigError("subnet_id: unset, and the region has no default subnet; set subnet_id")
    return sorted(defaults, key=lambda s: s["AvailabilityZone"])[0]


def controller_public_ip() -> str:
    """The controller's public address, for the SSH rule of the pool's security group. Only
    called when `ssh_ingress_cidr` is unset; tests and controllers inside the VPC set it."""
    try:
        with urllib.request.urlopen("https://checkip.amazonaws.com", timeout=10) as response:
            return response.read().decode().strip()
    except OSError as exc:
        raise PoolConfigError(f"ssh_ingress_cidr: unset, and this machine's public address could not be "
                              f"looked up ({exc}); set ssh_ingress_cidr") from None
