"""A hang's evidence beyond stacks: torch's flight recorder (`TORCH_FR_BUFFER_SIZE`, set on every
rank; gloo on CPU records too in torch 2.13), read from each rank before it is stopped, names the
rank that never entered the collective the others wait in."""

from __future__ import annotations

import re
import time

import pytest

from skytasks import DistributedTaskError, GPUPool, HangError, distributed_task, rank_info
from tests.conftest import started_here

HANG = 8


def rank_1_never_enters_the_all_reduce() -> None:
    import torch
    import torch.distributed as dist

    ones = torch.ones(4)
    dist.all_reduce(ones)  # both ranks: collective #1, joined
    if rank_info().rank == 0:
        dist.all_reduce(ones)  # collective #2: rank 1 never gets here
    else:
        time.sleep(600)


def test_the_hang_error_names_the_rank_that_never_joined_the_collective():
    task = distributed_task(rank_1_never_enters_the_all_reduce, pool=GPUPool(nodes=2), backend="gloo",
                            hang_timeout_seconds=HANG)
    started = time.monotonic()
    with pytest.raises(DistributedTaskError) as caught:
        task()
    assert time.monotonic() - started < 40
    members = {e.rank: e for e in caught.value.exceptions}
    assert sorted(members) == [0, 1] and all(isinstance(e, HangError) for e in members.values())
    said = str(members[0])
    # (its number counts the preflight's all-reduce on the same group too)
    assert re.search(r"flight recorder: collective #\d+ \(gloo:all_reduce\) of process group \S+ was entered "
                     r"by ranks \[0\]; ranks \[1\] never joined it", said), said
    assert "in `all_reduce`" in said  # the stack, as before
    assert started_here() == []


def test_with_no_hang_the_ranks_are_not_asked_for_their_flight_recorder():
    def fails() -> None:
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.ones(1))
        raise ValueError("plain failure")

    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(fails, pool=GPUPool(nodes=2), backend="gloo", hang_timeout_seconds=HANG)()
    said = [str(e) for e in caught.value.exceptions]
    assert said and all("plain failure" in e and "flight recorder" not in e for e in said), said
