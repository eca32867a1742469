"""Membership as values: what a fixed and an elastic pool decide from a `PoolStatus`.

Pure functions, no process: the table is the contract. Ids are the provider's node ids; "gone"
nodes are lost or have a preemption notice.
"""

from __future__ import annotations

import pytest

from skytasks.controller.membership import (Drop, ElasticPolicy, FixedPolicy, GoneNode, Grow, Keep, PoolStatus,
                                            Replace, policy_for)


def gone(*ids: int, preempted: bool = False) -> tuple[GoneNode, ...]:
    return tuple(GoneNode(i, i, f"10.0.0.{i}", "was lost", preempted) for i in ids)


def status(live, lost=(), counts=(2, 2), before_call=False, now=100.0, grow_failed_at=None) -> PoolStatus:
    return PoolStatus(live=tuple(live), gone=lost, counts=counts, now=now, grow_failed_at=grow_failed_at,
                      grow_retry_seconds=60.0, before_call=before_call)


CASES = [
    # (why, policy, status, decisions)
    ("a full fixed pool keeps its nodes", FixedPolicy(), status([0, 1]), (Keep(),)),
    ("a fixed pool replaces a lost node", FixedPolicy(), status([0], gone(1)), (Replace((1,)),)),
    ("a fixed pool replaces a preempted node too", FixedPolicy(), status([1], gone(0, preempted=True)),
     (Replace((0,)),)),
    ("a fixed pool never grows, even before a call", FixedPolicy(), status([0, 1], before_call=True), (Keep(),)),
    ("an elastic pool above min drops a lost node", ElasticPolicy(), status([0, 2], gone(1), counts=(2, 3)),
     (Drop((1,)),)),
    ("an elastic pool at min replaces what keeps it at min and drops the rest", ElasticPolicy(),
     status([0], gone(1, 2), counts=(2, 3)), (Drop((2,)), Replace((1,)))),
    ("an elastic pool that lost everything replaces up to min", ElasticPolicy(),
     status([], gone(0, 1, 2), counts=(1, 3)), (Drop((1, 2)), Replace((0,)))),
    ("between attempts an elastic pool drops and never grows", ElasticPolicy(),
     status([0], gone(1), counts=(1, 2)), (Drop((1,)),)),
    ("before a call an elastic pool drops a going node and grows back", ElasticPolicy(),
     status([0], gone(1, preempted=True), counts=(1, 2), before_call=True), (Drop((1,)), Grow(1))),
    ("before a call a short elastic pool grows by what it lacks", ElasticPolicy(),
     status([0, 1], counts=(1, 4), before_call=True), (Grow(2),)),
    ("a shortfall a minute ago throttles growing", ElasticPolicy(),
     status([0], counts=(1, 2), before_call=True, now=100.0, grow_failed_at=50.0), (Keep(),)),
    ("past the throttle it grows again", ElasticPolicy(),
     status([0], counts=(1, 2), before_call=True, now=111.0, grow_failed_at=50.0), (Grow(1),)),
    ("a full elastic pool keeps its nodes", ElasticPolicy(), status([0, 1], counts=(1, 2), before_call=True),
     (Keep(),)),
]


@pytest.mark.parametrize("why, policy, given, decisions", CASES, ids=[c[0] for c in CASES])
def test_the_policy_decides_membership_from_the_status(why, policy, given, decisions):
    assert policy.decide(given) == decisions


def test_min_below_max_is_elastic_and_min_equal_max_is_fixed():
    assert isinstance(policy_for((1, 2)), ElasticPolicy) and isinstance(policy_for((2, 2)), FixedPolicy)
