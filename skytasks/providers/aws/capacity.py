"""Launching what EC2 can give: between the fewest and the most nodes of an elastic pool.

Each try is one RunInstances call for exactly `count` nodes (`MinCount` = `MaxCount`): all of them
or none, so a cluster placement group never holds a partial set, and what was launched is what was
asked for. When EC2 answers `InsufficientInstanceCapacity` (or another capacity error) the count
steps down, one node at a time, to the fewest; anything else EC2 refuses is a PoolStartError in
EC2's own words (`refused`), with botocore's ClientError as its cause.
An answer for a count costs one API call and no instance: EC2 refuses before it launches.
"""

from __future__ import annotations

import re
from typing import Any

from skytasks.errors import PoolStartError

# What EC2 says when the capacity, not the request, is the problem.
NO_CAPACITY = frozenset({"InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity",
                         "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "InsufficientReservedInstanceCapacity"})


# The field a refusal is about, where EC2's code or words say so.
_REFUSAL_FIELDS = (
    (re.compile(r"^(UnauthorizedOperation|AuthFailure|OptInRequired|Blocked)"), "aws_credentials"),
    (re.compile(r"iamInstanceProfile|instance profile", re.I), "iam_instance_profile"),
    (re.compile(r"instance type|InstanceType", re.I), "instance_type"),
    (re.compile(r"\bsubnet", re.I), "subnet_id"),
    (re.compile(r"security group", re.I), "security_group_ids"),
    (re.compile(r"\bAMI\b|\bimage\b", re.I), "image_id"),
    (re.compile(r"volume", re.I), "root_volume_gb"),
    (re.compile(r"\bspot\b", re.I), "spot"),
)


def refused(exc: Any, doing: str) -> str:
    """An EC2 refusal (a botocore ClientError) in EC2's own words: its operation, code and message,
    after the field it is about when that can be told."""
    error = exc.response.get("Error", {})
    code, said = error.get("Code", "Unknown"), error.get("Message", "") or str(exc)
    field = next((f for pattern, f in _REFUSAL_FIELDS if pattern.search(f"{code}: {said}")), None)
    text = f"EC2 refused {getattr(exc, 'operation_name', None) or 'the request'} ({doing}): {code}: {said}"
    return f"{field}: {text}" if field else text


def launch_what_can_be_had(ec2: Any, request: dict[str, Any], fewest: int, most: int) -> tuple[list[dict], str]:
    """The instances launched (between `fewest` and `most`) and, when fewer than `most`, why not
    more in EC2's words. Raises PoolStartError naming `nodes` when not even `fewest` can be had."""
    from botocore.exceptions import ClientError

    said, last = "", None
    for count in range(most, fewest - 1, -1):
        try:
            reservation = ec2.run_instances(**{**request, "MinCount": count, "MaxCount": count})
        except ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code") not in NO_CAPACITY:
                raise PoolStartError(refused(exc, f"launching {_instances(count, request)}") + "; nothing was "
                                     "launched") from exc
            said, last = f"{error.get('Code')} for {count}: {error.get('Message', '')}".strip(), exc
            continue
        return reservation["Instances"], said
    raise PoolStartError(f"nodes: EC2 has no capacity for {_instances(fewest, request)} now ({said}); "
                         f"nothing was launched") from last


def _instances(count: int, request: dict[str, Any]) -> str:
    return f"{count} {request.get('InstanceType')} instance{'s' * (count != 1)}"
