"""`skytasks gc`: find what aws pools left in EC2 and delete it.

A pool tears itself down on every path its controller lives through, and its nodes end
themselves when the controller goes quiet. This sweep is the third line: everything a pool makes
carries `skytasks:pool` and `skytasks:expires-at` tags, so a pool whose time is up (expired), or
whose instances are all gone while its security group or key pair remain (orphaned), is found by
tags alone and deleted in dependency order. Run it by hand, or deploy `flows/gc_sweep.py` on a
schedule.

`skytasks:expires-at` is a lease, not a lifetime: the controller renews it on the pool's instances
while it lives (`remote_fields.lease_expiry`), so it runs out `idle_minutes` and a little more after
the controller is gone, or at `max_lifetime_minutes` when the pool has a cap. A pool with no cap
(the default) thus still expires once nobody holds it, even when its nodes' watchdogs failed to end
them. The instances' latest lease is the pool's: the other resources keep the one they were made
with, and a pool without instances is swept as orphaned anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from skytasks.providers.aws.resources import CREATED_TAG, EXPIRES_TAG, POOL_TAG, PoolResources, parse_time

LIVE_STATES = ["pending", "running", "stopping", "stopped", "shutting-down"]


@dataclass
class FoundPool:
    resources: PoolResources
    expires_at: datetime | None = None
    created_at: datetime | None = None

    def note_tags(self, tags: list[dict] | None, instance: bool = False) -> None:
        """The earliest creation of anything of the pool, and the latest lease of its instances."""
        values = {t["Key"]: t["Value"] for t in tags or []}
        created = parse_time(values.get(CREATED_TAG))
        if created and (self.created_at is None or created < self.created_at):
            self.created_at = created
        expires = parse_time(values.get(EXPIRES_TAG)) if instance else None
        if expires and (self.expires_at is None or expires > self.expires_at):
            self.expires_at = expires


def find_pools(ec2: Any, log: Callable[[str], None] = lambda line: None) -> dict[str, FoundPool]:
    pools: dict[str, FoundPool] = {}

    def pool_of(tags: list[dict] | None, instance: bool = False) -> FoundPool | None:
        pool_id = next((t["Value"] for t in tags or [] if t["Key"] == POOL_TAG), None)
        if pool_id is None:
            return None
        found = pools.setdefault(pool_id, FoundPool(PoolResources(ec2, pool_id)))
        found.note_tags(tags, instance)
        return found

    tagged = [{"Name": "tag-key", "Values": [POOL_TAG]}]
    for page in ec2.get_paginator("describe_instances").paginate(
            Filters=tagged + [{"Name": "instance-state-name", "Values": LIVE_STATES}]):
        for reservation in page["Reservations"]:
            for instance in reservation["Instances"]:
                if found := pool_of(instance.get("Tags"), instance=True):
                    found.resources.instance_ids.append(instance["InstanceId"])
    for sg in ec2.describe_security_groups(Filters=tagged)["SecurityGroups"]:
        if found := pool_of(sg.get("Tags")):
            found.resources.security_group_id = sg["GroupId"]
    for key in ec2.describe_key_pairs(Filters=tagged)["KeyPairs"]:
        if found := pool_of(key.get("Tags")):
            found.resources.key_name = key["KeyName"]
    try:
        for group in ec2.describe_placement_groups(Filters=tagged)["PlacementGroups"]:
            if found := pool_of(group.get("Tags")):
                found.resources.placement_group = group["GroupName"]
    except Exception as exc:  # noqa: BLE001 - some EC2 look-alikes lack placement groups
        log(f"skytasks gc: placement groups not listed ({type(exc).__name__})")
    return pools


def sweep(ec2: Any, *, now: datetime | None = None, grace_minutes: float = 15, dry_run: bool = False,
          log: Callable[[str], None] = lambda line: None) -> list[str]:
    """Delete expired and orphaned pools; returns the ids of the pools swept.

    `grace_minutes` spares a pool being launched right now: its security group and key pair
    exist a few seconds before its instances do."""
    now = now or datetime.now(timezone.utc)
    swept = []
    for pool_id, found in sorted(find_pools(ec2, log).items()):
        r = found.resources
        expired = found.expires_at is not None and found.expires_at <= now
        young = found.created_at is not None and found.created_at > now - timedelta(minutes=grace_minutes)
        orphaned = not r.instance_ids and not young
        if not (expired or orphaned):
            continue
        what = (f"{len(r.instance_ids)} instance(s), security group {r.security_group_id}, key pair {r.key_name}, "
                f"placement group {r.placement_group}")
        log(f"skytasks gc: {'would sweep' if dry_run else 'sweeping'} {pool_id} "
            f"({'expired' if expired else 'orphaned'}): {what}")
        if not dry_run:
            for error in r.teardown():
                log(f"skytasks gc: {pool_id}: {error}")
        swept.append(pool_id)
    return swept


def command(args: Any) -> int:
    """`skytasks gc` (the default sweep): the credentials (a saved AwsCredentials block, or the
    region and endpoint given), then the sweep by tags. `args`: the command line's (cli.py)."""
    from typing import cast

    from prefect_aws import AwsCredentials

    if args.aws_credentials:
        # No event loop runs here, so Prefect's load returns the block itself, not a coroutine.
        creds = cast(AwsCredentials, AwsCredentials.load(args.aws_credentials))
    else:
        params = {"endpoint_url": args.endpoint_url} if args.endpoint_url else {}
        creds = AwsCredentials(region_name=args.region, aws_client_parameters=params)
    swept = sweep(creds.get_client("ec2"), now=args.now, grace_minutes=args.grace_minutes, dry_run=args.dry_run,
                  log=print)
    print(f"skytasks gc: {len(swept)} pool(s) {'to sweep' if args.dry_run else 'swept'}")
    return 0
