"""What one aws pool owns in EC2, and how it all goes away: shared by the provider's teardown
and by `skytasks gc`, which rebuilds it from tags for pools whose controller never came back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from skytasks.errors import PoolTeardownError

POOL_TAG, EXPIRES_TAG, CREATED_TAG = "skytasks:pool", "skytasks:expires-at", "skytasks:created-at"
FLOW_RUN_TAG = "prefect.io/flow-run-id"
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
POLL_SECONDS = 2.0
TERMINATE_WAIT_SECONDS = 600.0


def pool_tags(pool_id: str, expires_at: datetime, extra: Mapping[str, str], flow_run_id: str | None) -> dict[str, str]:
    """The tags on everything a pool makes. `expires_at` is its lease (`remote_fields.lease_expiry`):
    the provider renews it on the pool's instances while the controller lives, and `skytasks gc`
    reads it there."""
    now = datetime.now(timezone.utc)
    tags = {**extra, "Name": pool_id, POOL_TAG: pool_id, CREATED_TAG: now.strftime(TIME_FORMAT),
            EXPIRES_TAG: expires_at.strftime(TIME_FORMAT)}
    if flow_run_id:
        tags[FLOW_RUN_TAG] = flow_run_id
    return tags


def parse_time(text: str | None) -> datetime | None:
    try:
        return datetime.strptime(text, TIME_FORMAT).replace(tzinfo=timezone.utc) if text else None
    except ValueError:
        return None


@dataclass
class PoolResources:
    ec2: Any
    pool_id: str
    instance_ids: list[str] = field(default_factory=list)
    security_group_id: str | None = None
    key_name: str | None = None  # only a key pair the pool made; never the user's own
    placement_group: str | None = None

    def renew_expiry(self, instance_ids: list[str], expires_at: datetime) -> None:
        """Move the lease on these (live) instances forward: `skytasks gc` reads it there."""
        if instance_ids:
            self.ec2.create_tags(Resources=instance_ids, Tags=[{"Key": EXPIRES_TAG,
                                                                "Value": expires_at.strftime(TIME_FORMAT)}])

    def describe_instances(self) -> list[dict]:
        if not self.instance_ids:
            return []
        pages = self.ec2.describe_instances(InstanceIds=self.instance_ids)["Reservations"]
        return [i for r in pages for i in r["Instances"]]

    def adopt_tagged(self) -> None:
        """Add what carries this pool's tag but was never recorded: an interrupt can land while a
        create call is in flight, after AWS made the thing and before its id came back."""
        mine = [{"Name": f"tag:{POOL_TAG}", "Values": [self.pool_id]}]
        live = [{"Name": "instance-state-name", "Values": ["pending", "running", "stopping", "stopped"]}]
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=mine + live):
            for reservation in page["Reservations"]:
                for instance in reservation["Instances"]:
                    if instance["InstanceId"] not in self.instance_ids:
                        self.instance_ids.append(instance["InstanceId"])
        groups = self.ec2.describe_security_groups(Filters=mine)["SecurityGroups"]
        self.security_group_id = self.security_group_id or next((g["GroupId"] for g in groups), None)
        keys = self.ec2.describe_key_pairs(Filters=mine)["KeyPairs"]
        self.key_name = self.key_name or next((k["KeyName"] for k in keys), None)

    def leftovers(self) -> list[str]:
        """Every id this pool owns now: what a failed teardown names."""
        ids = list(self.instance_ids)
        ids += [x for x in (self.security_group_id, self.key_name and f"key-pair {self.key_name}",
                            self.placement_group and f"placement-group {self.placement_group}") if x]
        return ids

    def teardown(self) -> list[str]:
        """Delete everything, in dependency order; every step is attempted. Returns what failed."""
        errors = []
        for step in (self.adopt_tagged, self.terminate_instances, self.delete_security_group, self.delete_key_pair,
                     self.delete_placement_group):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - the next steps still run
                errors.append(f"{step.__name__}: {exc}")
        return errors

    def only_tagged_instances(self) -> None:
        """Keep only the instances that carry this pool's tag. The ids may come from a record that
        another process wrote (a warm pool's), and a record is no proof: an instance that is not
        the pool's own is never terminated by its teardown, whatever the record says."""
        if not self.instance_ids:
            return
        wanted = [{"Name": "instance-id", "Values": list(self.instance_ids)}]
        tagged = set()
        for page in self.ec2.get_paginator("describe_instances").paginate(Filters=wanted):
            for reservation in page["Reservations"]:
                for instance in reservation["Instances"]:
                    if {"Key": POOL_TAG, "Value": self.pool_id} in (instance.get("Tags") or []):
                        tagged.add(instance["InstanceId"])
        self.instance_ids = [i for i in self.instance_ids if i in tagged]

    def terminate_instances(self) -> None:
        self.only_tagged_instances()
        if not self.instance_ids:
            return
        self.ec2.terminate_instances(InstanceIds=self.instance_ids)
        deadline = time.monotonic() + TERMINATE_WAIT_SECONDS
        # The security group cannot go while an instance still uses it.
        while any(i["State"]["Name"] != "terminated" for i in self.describe_instances()):
            if time.monotonic() > deadline:
                raise PoolTeardownError(f"instances {self.instance_ids} not terminated after {TERMINATE_WAIT_SECONDS:g}s")
            time.sleep(POLL_SECONDS)
        self.instance_ids = []

    def delete_security_group(self) -> None:
        if self.security_group_id:
            sg = self.security_group_id
            _retry_dependency(lambda: self.ec2.delete_security_group(GroupId=sg))
            self.security_group_id = None

    def delete_key_pair(self) -> None:
        if self.key_name:
            name = self.key_name
            _retry_dependency(lambda: self.ec2.delete_key_pair(KeyName=name))
            self.key_name = None

    def delete_placement_group(self) -> None:
        if self.placement_group:
            name = self.placement_group
            _retry_dependency(lambda: self.ec2.delete_placement_group(GroupName=name))
            self.placement_group = None


# Already gone (`skytasks gc` or a person deleted it first): for a teardown, that is done.
GONE_CODES = frozenset({"InvalidGroup.NotFound", "InvalidKeyPair.NotFound", "InvalidPlacementGroup.Unknown"})


def _retry_dependency(call: Callable[[], Any], attempts: int = 30) -> None:
    """Network interfaces linger a little after termination; AWS says DependencyViolation meanwhile."""
    from botocore.exceptions import ClientError

    for attempt in range(attempts):
        try:
            call()
            return
        except ClientError as exc:
            if exc.response["Error"]["Code"] in GONE_CODES:
                return
            if exc.response["Error"]["Code"] not in ("DependencyViolation", "InvalidPlacementGroup.InUse") \
                    or attempt == attempts - 1:
                raise
            time.sleep(POLL_SECONDS)
