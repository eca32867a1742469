"""Retries as a policy, and as Prefect retries a task: `timeout_seconds` bounds each attempt, and
every kind of failure is retried while retries are left, none once they are spent.

The policy is pure and tested first without processes; then each kind of failure is made for real
on a local pool, once with a retry left (the second attempt succeeds) and once without (the
caller gets the failure of that kind).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from skytasks import DistributedTaskError, GPUPool, HangError, distributed_task, rank_info
from skytasks.controller.outcome import MEMBERSHIP_ENDS, CallOutcome, EndReason, FailurePolicy, Spent
from skytasks.errors import PoolStartError, RankProcessDied

CODE_FAILURES = [r for r in EndReason if r not in (EndReason.COMPLETED, *MEMBERSHIP_ENDS)]


@pytest.mark.parametrize("reason", CODE_FAILURES)
def test_every_failure_of_the_code_is_retried_while_retries_are_left_and_raised_after(reason):
    failed = CallOutcome(reason, error=RuntimeError(str(reason)))
    policy = FailurePolicy(retries=2)
    first = policy.decide(failed, Spent())
    assert first.retry and first.charged == "retries" and first.spent(Spent()) == Spent(retries=1)
    assert policy.decide(failed, Spent(retries=1)).retry
    last = policy.decide(failed, Spent(retries=2, node_recoveries=0))
    assert not last.retry and "no retries left" in last.why
    assert not FailurePolicy(retries=0).decide(failed, Spent()).retry
    # node recoveries never pay for the code's failures
    assert not FailurePolicy(retries=0, node_recoveries=5).decide(failed, Spent()).retry


@pytest.mark.parametrize("reason", sorted(MEMBERSHIP_ENDS))
def test_a_node_lost_or_preempted_is_a_node_recovery_never_a_retry(reason):
    failed = CallOutcome(reason, error=ConnectionError(str(reason)))
    policy = FailurePolicy(retries=0, node_recoveries=2)
    first = policy.decide(failed, Spent())
    assert first.retry and first.charged == "node_recoveries" and first.spent(Spent()) == Spent(node_recoveries=1)
    assert policy.decide(failed, Spent(node_recoveries=1)).retry
    last = policy.decide(failed, Spent(retries=0, node_recoveries=2))
    assert not last.retry and "no node recoveries left" in last.why
    # retries never pay for the pool's losses
    assert not FailurePolicy(retries=9, node_recoveries=0).decide(failed, Spent()).retry


def test_the_default_is_three_node_recoveries_per_call():
    assert FailurePolicy(retries=0).node_recoveries == 3


def test_a_completed_attempt_is_never_retried_and_unwraps_to_its_values():
    done = CallOutcome(EndReason.COMPLETED, values=[1, 2])
    assert not FailurePolicy(retries=3).decide(done, Spent()).retry
    assert done.unwrap() == [1, 2]
    with pytest.raises(PoolStartError):
        CallOutcome(EndReason.POOL_START, error=PoolStartError("node 0 (h): cannot connect")).unwrap()


# -- for real: each kind of failure on attempt 1 only --------------------------------------------

def fail_once(kind: str, marker: str) -> str:
    """Attempt 1 fails as `kind` on rank 1 (rank 0 waits); any later attempt returns."""
    info = rank_info()
    if info.attempt > 1:
        return f"attempt {info.attempt}"
    if info.rank == 1:
        if kind == "rank":
            raise ValueError("rank 1 broke")
        if kind == "died":
            os._exit(7)
        if kind == "node":
            os.kill(os.getppid(), signal.SIGKILL)  # the node's agent: the node is gone
    Path(f"{marker}{info.rank}").touch()
    time.sleep(60)  # deadline and hang: silent; the others: waiting for the failure to stop it
    return "unreachable"


CASES = {
    "rank": (dict(), ValueError),
    "died": (dict(), RankProcessDied),
    "node": (dict(), ConnectionError),
    "hang": (dict(hang_timeout_seconds=2), HangError),
    "deadline": (dict(timeout_seconds=3), TimeoutError),
}


@pytest.fixture
def pool():
    return GPUPool(nodes=2)  # up for each call; every test leaves no process behind


@pytest.mark.parametrize("kind", list(CASES))
def test_each_failure_kind_with_a_retry_or_node_recovery_left_runs_again_and_succeeds(pool, kind, tmp_path):
    options, _ = CASES[kind]
    # A node lost is the pool's doing: it is recovered from node_recoveries (default 3), with no retry.
    task = distributed_task(fail_once, pool=pool, init_torch=False, retries=0 if kind == "node" else 1, **options)
    started = time.monotonic()
    assert task(kind, str(tmp_path / "m")) == ["attempt 2", "attempt 2"]
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("kind", list(CASES))
def test_each_failure_kind_with_nothing_left_reaches_the_caller(pool, kind, tmp_path):
    options, expected = CASES[kind]
    task = distributed_task(fail_once, pool=pool, init_torch=False, retries=0, node_recoveries=0, **options)
    with pytest.raises(DistributedTaskError) as caught:
        task(kind, str(tmp_path / "m"))
    assert isinstance(caught.value.exceptions[0], expected), caught.value.exceptions
    if kind == "deadline":
        assert str(caught.value).count("fail_once:") == 1  # the task's name once, not twice


def test_the_init_timeout_is_retried_like_any_failure(tmp_path, monkeypatch):
    """A rank that never reaches init_process_group on attempt 1 (its interpreter stalls at
    start-up, as on an overloaded node); attempt 2 forms the group."""
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "stalled"
    (site / "sitecustomize.py").write_text(
        "import os, time\n"
        f"if os.environ.get('RANK') == '1' and not os.path.exists({str(marker)!r}):\n"
        f"    open({str(marker)!r}, 'w').close()\n"
        "    time.sleep(30)\n")
    monkeypatch.setenv("SKYTASKS_INIT_TIMEOUT_SECONDS", "2")
    monkeypatch.setenv("SKYTASKS_RANK_START", "exec")  # a fresh interpreter per rank: a forked one runs no sitecustomize
    # preflight off: a basic preflight would meet the stall first and absorb it (spending no retry)
    pool = GPUPool(nodes=2, env={"PYTHONPATH": str(site)}, preflight="off")

    @distributed_task(pool=pool, retries=1)
    def formed():
        import torch.distributed as dist

        return (dist.get_world_size(), rank_info().attempt)

    assert formed() == [(2, 2), (2, 2)]
    marker.unlink()

    @distributed_task(pool=pool, retries=0)
    def never_formed():
        return 1

    with pytest.raises(DistributedTaskError) as caught:
        never_formed()
    assert isinstance(caught.value.exceptions[0], TimeoutError)
    assert "initialisation timed out" in str(caught.value.exceptions[0])
