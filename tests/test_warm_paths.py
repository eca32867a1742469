"""The paths that make calls cheap: light agents, warm ranks, large arguments sent once."""

from __future__ import annotations

import os

import numpy as np

from skytasks import GPUPool, distributed_task
from skytasks.controller.channel import bytes_sent
from tests.conftest import running


def rank_env() -> dict:
    return {"nccl_async": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), "pid": os.getpid()}


def test_agents_stay_light_and_ranks_keep_their_process_group_across_calls():
    pool = GPUPool(nodes=2)
    task = distributed_task(rank_env, pool=pool)
    with pool:
        first = task()
        agents = running("skytasks.node.agent")
        assert len(agents) == 2
        for agent in agents:  # the agent never loads torch: it starts in milliseconds
            maps = open(f"/proc/{agent.pid}/maps").read()
            assert "libtorch" not in maps and "torch/_C" not in maps
        second = task()
    assert [r["pid"] for r in first] == [r["pid"] for r in second]
    assert {r["nccl_async"] for r in first} == {"1"}


def checksum(data: np.ndarray, salt: int) -> float:
    return float(data[:1000].sum()) + salt


def test_a_large_argument_travels_once_per_node_and_not_again_while_warm():
    data = np.arange(4_000_000, dtype=np.float64)  # 32 MB
    pool = GPUPool(nodes=2, procs_per_node=2)
    task = distributed_task(checksum, pool=pool, init_torch=False)
    sent = []  # what each call wrote to the node streams (the controller's own counter)
    with pool:
        for value, expected in ((1, 1), (2, 2)):
            before = bytes_sent()
            assert task(data, value) == [float(data[:1000].sum()) + expected] * 4
            sent.append(bytes_sent() - before)
        data[0] = 1e9
        before = bytes_sent()
        assert task(data, 3) == [float(data[:1000].sum()) + 3] * 4  # changed: sent again
        sent.append(bytes_sent() - before)
    big = data.nbytes
    assert 2 * big <= sent[0] < 2.1 * big  # once per node (2 nodes: no relay tree), not once per rank (4)
    assert sent[1] < 0.01 * big  # the same data: not resent
    assert 2 * big <= sent[2] < 2.1 * big


def scale_in_place(data: np.ndarray) -> tuple[float, bool]:
    before = float(data[:1000].sum())
    data *= 2  # the function's own copy: the next call must see the bytes as sent
    return before, bool(data.flags.writeable)


def test_a_function_may_change_its_argument_in_place_and_the_next_call_gets_it_as_sent():
    data = np.arange(2_000_000, dtype=np.float64)  # 16 MB: held by the ranks between calls
    expected = float(data[:1000].sum())
    pool = GPUPool(nodes=2, procs_per_node=2)
    task = distributed_task(scale_in_place, pool=pool, init_torch=False)
    with pool:
        assert task(data) == [(expected, True)] * 4
        assert task(data) == [(expected, True)] * 4  # not resent, and not doubled by the first call
        assert task(data) == [(expected, True)] * 4
    assert float(data[:1000].sum()) == expected  # the caller's array is its own


def test_a_received_argument_is_shared_copy_on_write_and_released():
    from skytasks.serialization import dumps_out_of_band, loads_out_of_band, release, shared_buffer

    data = np.arange(1_000_000, dtype=np.float64)
    meta, views = dumps_out_of_band(data)
    held = shared_buffer(views[0].nbytes)
    assert held is not None
    memoryview(held).cast("B")[:] = views[0].cast("B")
    blob = (meta, [memoryview(held).toreadonly()])  # as pickle hands back a buffer sent read-only
    first = loads_out_of_band(blob, copy=True)
    first[:] = -1.0
    second = loads_out_of_band(blob, copy=True)
    assert np.array_equal(second, data) and not np.shares_memory(first, second)
    fd = held.fd
    release(blob)
    assert held.closed
    assert np.array_equal(second, data)  # a view a function still holds stays valid
    try:
        os.fstat(fd)
        still_open = True
    except OSError:
        still_open = False
    assert not still_open


def test_a_plain_result_is_written_as_plain_pickle_and_anything_else_still_travels_by_value():
    """A rank's result is pickled on every rank of every call: a plain value skips cloudpickle's
    Pickler (the same bytes either way); a function or a local class still goes by value."""
    import pickle

    import cloudpickle

    from skytasks.serialization import dumps, dumps_out_of_band, loads_out_of_band

    for value in (None, True, 7, 2**70, 0.5, 1j, "λ", b"\x00" * 100_000):
        meta, buffers = dumps_out_of_band(value)
        assert meta == pickle.dumps(value, protocol=5) == dumps(value) and buffers == []
        assert loads_out_of_band((meta, buffers), copy=False) == value

    class Local:
        def __init__(self):
            self.n = 3

    blob = dumps_out_of_band([Local(), lambda x: x + 1])
    obj, fn = cloudpickle.loads(blob[0])
    assert obj.n == 3 and fn(1) == 2
