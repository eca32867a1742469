"""Launching what EC2 can give: between the fewest and the most nodes of an elastic pool.

Each try is one RunInstances call for exactly `count` nodes (`MinCount` = `MaxCount`): all of them
or none, so a cluster placement group never holds a partial set, and what was launched is what was
asked for. When EC2 answers `InsufficientInstanceCapacity` (or another capacity error) the count
steps down, one node at a time, to the fewest; anything else EC2 refuses is raised as it is.
An answer for a count costs one API call and no instance: EC2 refuses before it launches.
"""

from __future__ import annotations

from typing import Any

from skytasks.errors import PoolStartError

# What EC2 says when the capacity, not the request, is the problem.
NO_CAPACITY = frozenset({"InsufficientInstanceCapacity", "InsufficientHostCapacity", "InsufficientCapacity",
                         "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow", "InsufficientReservedInstanceCapacity"})


def launch_what_can_be_had(ec2: Any, request: dict[str, Any], fewest: int, most: int) -> tuple[list[dict], str]:
    """The instances launched (between `fewest` and `most`) and, when fewer than `most`, why not
    more in EC2's words. Raises PoolStartError naming `nodes` when not even `fewest` can be had."""
    from botocore.exceptions import ClientError

    said = ""
    for count in range(most, fewest - 1, -1):
        try:
            reservation = ec2.run_instances(**{**request, "MinCount": count, "MaxCount": count})
        except ClientError as exc:
            error = exc.response.get("Error", {})
            if error.get("Code") not in NO_CAPACITY:
                raise
            said = f"{error.get('Code')} for {count}: {error.get('Message', '')}".strip()
            continue
        return reservation["Instances"], said
    raise PoolStartError(f"nodes: EC2 has no capacity for {fewest} {request.get('InstanceType')} "
                         f"instance{'s' * (fewest != 1)} now ({said}); nothing was launched")
