"""Bad input gets a clear error naming what is wrong, before anything is launched."""

from __future__ import annotations

import threading

import pytest

from skytasks import DistributedTaskError, GPUPool, PoolConfigError, distributed_task, rank_info
from tests.conftest import skytasks_processes


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"nodes": 0}, "nodes"),
        ({"provider": "gcp"}, "provider"),
        ({"procs_per_node": 0}, "procs_per_node"),
        ({"provider": "ssh"}, "hosts"),
        ({"provider": "ssh", "hosts": ["a", "b", "c"], "nodes": 2}, "hosts"),
        ({"hosts": ["user@host:99999"]}, "hosts"),
        ({"hosts": ["two words"]}, "hosts"),
        ({"ready_timeout_seconds": -1}, "ready_timeout_seconds"),
        ({"idle_minutes": 0}, "idle_minutes"),
        ({"max_lifetime_minutes": -5}, "max_lifetime_minutes"),
        ({"max_lifetime_minutes": 0}, "max_lifetime_minutes"),
        ({"accelerators_per_node": 0}, "accelerators_per_node"),
        ({"root_volume_gb": 1}, "root_volume_gb"),
        ({"provider": "aws", "ssh_ingress_cidr": "my laptop"}, "ssh_ingress_cidr"),
        ({"provider": "aws", "key_name": "mine"}, "ssh_private_key"),
        ({"provider": "aws", "hosts": ["a", "b"]}, "hosts"),
        ({"nodes": 2, "min_nodes": 3}, "min_nodes"),
        ({"min_nodes": 0}, "min_nodes"),
        ({"provider": "aws", "slurm_partition": "gpu"}, "slurm_partition"),
        ({"nodes": "two"}, "nodes"),
        ({"provider": "slurm", "instance_type": "p5.48xlarge"}, "instance_type"),
        ({"spot": True}, "spot"),
    ],
)
def test_invalid_pool_fields_are_a_pool_config_error_naming_the_field(fields, named):
    with pytest.raises(PoolConfigError) as caught:  # the contract's type, not pydantic's ValidationError
        GPUPool(**fields)
    assert str(caught.value).startswith(f"{named}:"), str(caught.value)


def test_valid_pools_fill_in_defaults():
    assert GPUPool(accelerator="A100").accelerators_per_node == 1
    # No lifetime cap by default, on every provider: idle_minutes is what ends an orphaned node.
    assert GPUPool().max_lifetime_minutes is None and GPUPool(provider="aws").max_lifetime_minutes is None
    assert GPUPool(provider="slurm", max_lifetime_minutes=None).max_lifetime_minutes is None
    from skytasks.providers.aws.spec import AWSSpec

    assert GPUPool(provider="aws", max_lifetime_minutes=240).spec().own(AWSSpec).max_lifetime_minutes == 240
    assert GPUPool(provider="ssh", nodes=2, hosts=["me@10.0.0.1:2222", "[::1]"]).hosts[0] == "me@10.0.0.1:2222"


@pytest.mark.parametrize(
    "options, named",
    [({"nodes": 0}, "nodes"), ({"procs_per_node": -1}, "procs_per_node"), ({"retries": -1}, "retries"),
     ({"timeout_seconds": 0}, "timeout_seconds"), ({"retry_delay_seconds": -1}, "retry_delay_seconds"),
     ({"backend": "carrier-pigeon"}, "backend")],
)
def test_invalid_task_options_are_refused_at_decoration(options, named):
    with pytest.raises(ValueError, match=named):
        distributed_task(lambda: None, **options)


def test_with_options_refuses_unknown_names():
    with pytest.raises(TypeError, match="nodez"):
        distributed_task(lambda: None).with_options(nodez=2)


def test_an_unpicklable_argument_is_refused_before_any_rank_starts():
    task = distributed_task(lambda lock: None, pool=GPUPool(nodes=2))
    with pytest.raises(TypeError, match="positional argument 0.*lock.*cannot be pickled"):
        task(threading.Lock())
    assert skytasks_processes() == []


def test_an_unpicklable_keyword_argument_is_named():
    task = distributed_task(lambda **kw: None, pool=GPUPool(nodes=2))
    with pytest.raises(TypeError, match="argument 'sync'"):
        task(sync=threading.Event()._cond)


def test_an_unpicklable_closure_is_refused_before_any_rank_starts():
    lock = threading.Lock()

    def uses_a_lock() -> None:
        with lock:
            pass

    with pytest.raises(TypeError, match="the function .*uses_a_lock.*cannot be pickled"):
        distributed_task(uses_a_lock, pool=GPUPool(nodes=2))()
    assert skytasks_processes() == []


def returns_a_lock():
    return threading.Lock()


def test_an_unpicklable_return_value_names_the_rank_and_the_type():
    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(returns_a_lock, pool=GPUPool(nodes=2), init_torch=False)()
    exc = caught.value.exceptions[0]
    assert isinstance(exc, TypeError)
    assert "rank 0 returned a value of type _thread.lock that cannot be pickled" in str(exc) or "rank 1 returned" in str(exc)


def test_rank_info_outside_a_rank_says_so():
    with pytest.raises(RuntimeError, match="outside a skytasks rank"):
        rank_info()


inner = distributed_task(lambda: 1, pool=GPUPool(nodes=1))


def calls_a_distributed_task():
    return inner()


def test_a_distributed_task_inside_a_rank_is_refused():
    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(calls_a_distributed_task, pool=GPUPool(nodes=2), init_torch=False)()
    exc = caught.value.exceptions[0]
    assert isinstance(exc, RuntimeError) and "nested fan-out" in str(exc)


def test_no_pool_anywhere_runs_on_a_local_pool_of_the_calls_shape_and_says_so(caplog):
    import logging

    from skytasks import rank_info

    @distributed_task(init_torch=False, nodes=1, procs_per_node=2)
    def where():
        return (rank_info().world_size, rank_info().num_nodes)

    with caplog.at_level(logging.INFO, logger="skytasks"):
        assert where() == [(2, 1), (2, 1)]
    assert "no pool given: a local pool of 1 nodes x 2 processes on this machine" in caplog.text


def test_a_paid_pool_is_never_reshaped_for_one_call():
    from skytasks import GPUPool

    pool = GPUPool(provider="slurm", nodes=2)

    @distributed_task(pool=pool, nodes=4)
    def wider():
        return 1

    with pytest.raises(ValueError, match=r"^nodes/procs_per_node: 'wider' asks for nodes=4, but its pool"):
        wider()
