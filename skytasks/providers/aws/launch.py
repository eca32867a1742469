"""provider="aws": the RunInstances request of a pool's nodes, shared by its start (provider.py)
and `skytasks check`'s DryRun of it (check.py)."""

from __future__ import annotations

from typing import Any, Callable

from skytasks.pool_spec import PoolSpec
from skytasks.providers.aws.bootstrap import render_user_data
from skytasks.providers.aws.plan import LaunchPlan
from skytasks.providers.aws.spec import AWSSettings


def launch_request(spec: PoolSpec, plan: LaunchPlan, host_key: Any, tags: Callable[[str], list[dict]],
                   groups: list[str], key_name: str | None, placement_group: str | None) -> dict[str, Any]:
    """The RunInstances request of a pool's nodes (less MinCount and MaxCount): its start's, and
    `skytasks check`'s DryRun of it (check.py), where the pool's own security group, key pair and
    placement group do not exist yet (None and absent there)."""
    aws = spec.own(AWSSettings)
    request: dict[str, Any] = dict(
        ImageId=plan.image_id, InstanceType=plan.instance_type,
        UserData=render_user_data(spec, plan.cuda, host_key.export_private_key().decode(),
                                  host_key.export_public_key().decode()),
        InstanceInitiatedShutdownBehavior="terminate",  # the watchdog's shutdown ends the instance
        # The user-data holds the host's private key: only IMDSv2 (a session token, no
        # one-hop SSRF) may read it back on the node.
        MetadataOptions={"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 1},
        BlockDeviceMappings=[{"DeviceName": plan.root_device,
                              "Ebs": {"VolumeSize": aws.root_volume_gb, "VolumeType": "gp3",
                                      "DeleteOnTermination": True}}],
        TagSpecifications=tags("instance") + tags("volume"),
    )
    if plan.efa:  # EFA needs the interface spelled out; the subnet and groups move into it
        request["NetworkInterfaces"] = [{"DeviceIndex": 0, "InterfaceType": "efa", "SubnetId": plan.subnet_id,
                                         "Groups": groups, "DeleteOnTermination": True}]
    else:
        request.update(SubnetId=plan.subnet_id, **({"SecurityGroupIds": groups} if groups else {}))
    if key_name:
        request["KeyName"] = key_name
    if placement_group:
        request["Placement"] = {"GroupName": placement_group}
    if aws.spot:
        request["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
            "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
    if aws.iam_instance_profile:
        key = "Arn" if aws.iam_instance_profile.startswith("arn:") else "Name"
        request["IamInstanceProfile"] = {key: aws.iam_instance_profile}
    return request
