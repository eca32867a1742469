"""The typed core, without rank processes: the protocol, the settings, the frozen pool spec, the
pool a thread gets by default, and packing calls from many threads at once."""

from __future__ import annotations

import ast
import threading
import types
from pathlib import Path

import cloudpickle
import pytest
from pydantic import ValidationError

from skytasks import GPUPool, PoolConfigError
from skytasks.controller.packing import pack_call
from skytasks.controller.pool_runtime import active_pool
from skytasks.pool_spec import PoolSpec
from skytasks.protocol import Op
from skytasks.settings import settings

ROOT = Path(__file__).resolve().parent.parent


SAMPLES = {int: 3, str: "text", float: 1.5, bytes: b"\x00\x01", bool: True}


def _sample(hint) -> object:
    """A value of the field's type, as it crosses the wire."""
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.NotRequired, typing.Required):
        return _sample(args[0])
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in args if a is not type(None)))
    if origin is list:
        return [_sample(args[0])] if args else []
    if origin is dict:
        return {"key": _sample(args[1])} if args else {}
    return SAMPLES.get(hint, {"any": [1, "two", 3.0]})


@pytest.mark.parametrize("op", list(Op), ids=str)
def test_every_message_round_trips_the_wire_with_exactly_its_fields(op):
    import io
    import typing

    from skytasks.protocol import MESSAGES, check, message
    from skytasks.wire import encode, read_frame

    hints = typing.get_type_hints(MESSAGES[op])
    fields = {name: _sample(hint) for name, hint in hints.items()}
    sent = message(op, **fields)
    buf = io.BytesIO()
    for chunk in encode(sent):
        buf.write(bytes(chunk))
    buf.seek(0)
    received = read_frame(buf)
    assert received == {"op": op.value, **fields} and Op(received["op"]) is op
    check(received)  # what arrives is a well-formed message of its op
    required = MESSAGES[op].__required_keys__
    if required:
        with pytest.raises(ValueError, match=f"{op}: missing"):
            message(op, **{k: v for k, v in fields.items() if k != sorted(required)[0]})
    with pytest.raises(ValueError, match=f"{op}: unknown"):
        message(op, **fields, surprise=1)


def test_no_op_is_spelled_as_a_string_outside_the_protocol():
    words = {op.value for op in Op}
    for path in sorted((ROOT / "skytasks").rglob("*.py")):
        if path.name == "protocol.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    by_hand = isinstance(v, ast.Constant) or (isinstance(v, ast.Attribute) and ast.unparse(v).startswith("Op."))
                    assert not (isinstance(k, ast.Constant) and k.value == "op" and by_hand), \
                        f"{path}:{node.lineno}: a message built by hand, not with protocol.message()"
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in words
                                                     for c in node.comparators):
                left = ast.unparse(node.left)
                assert "op" not in left, f"{path}:{node.lineno}: {ast.unparse(node)} compares an op to a string"


def test_settings_are_read_from_skytasks_environment_names(monkeypatch):
    assert settings().init_timeout_seconds == 120.0
    monkeypatch.setenv("SKYTASKS_INIT_TIMEOUT_SECONDS", "7")
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_SECONDS", "3")
    monkeypatch.setenv("SKYTASKS_HEARTBEAT_TIMEOUT_SECONDS", "1")
    s = settings()
    assert s.init_timeout_seconds == 7.0 and s.heartbeat == (3.0, 6.0)  # the timeout is never under two beats
    monkeypatch.setenv("SKYTASKS_WORKDIR_LIMIT_MB", "-1")
    with pytest.raises(ValueError, match="workdir_limit_mb"):
        settings()


def test_the_block_gives_a_frozen_spec_with_only_its_providers_part():
    from skytasks.providers.aws.spec import AWSSpec
    from skytasks.providers.ssh.spec import SSHSpec

    local = GPUPool(nodes=3, procs_per_node=2, env={"A": "1"}).spec()
    from skytasks.providers.local.spec import LocalSpec

    assert (local.provider, local.nodes, local.procs_per_node) == ("local", 3, 2)
    assert local.own(LocalSpec).ready_timeout_seconds == 900  # a warm pool's wait in line, its only part
    assert local.env["A"] == "1" and local.name == "local-pool"
    with pytest.raises(AttributeError):
        local.nodes = 4  # frozen
    ssh = GPUPool(provider="ssh", nodes=2, hosts=["a", "b:2222"], known_hosts="x").spec()
    assert ssh.own(SSHSpec).hosts == ["a", "b:2222"] and ssh.own(SSHSpec).known_hosts == "x"
    with pytest.raises(ValidationError, match="frozen"):
        ssh.own(SSHSpec).hosts = []  # type: ignore[misc]  # the settings are the part, frozen as the spec is
    with pytest.raises(TypeError, match="provider='ssh': the pool's spec holds SSHSettings, not AWSSettings"):
        ssh.own(AWSSpec)
    with pytest.raises(ValueError, match="min_nodes: must be between 1 and nodes=1"):
        PoolSpec(name="x", provider="local", nodes=1, procs_per_node=1, accelerators_per_node=None, min_nodes=2)


def test_a_pool_entered_in_one_thread_is_not_every_threads_default():
    pool = GPUPool(nodes=1)
    seen: dict[str, object] = {}
    with pool:
        assert active_pool() is pool
        t = threading.Thread(target=lambda: seen.update(other=active_pool()))  # no context copy
        t.start()
        t.join()
    assert seen["other"] is None and active_pool() is None


def helper_value(x: int) -> int:
    return x * 3


def test_calls_packed_in_many_threads_at_once_all_carry_this_module_by_value():
    """cloudpickle's by-value registration is process-wide; packing is serialised so no thread
    unregisters a module under another one's feet."""
    errors: list[BaseException] = []
    packed = []

    def pack(i: int) -> None:
        try:
            for _ in range(20):
                packed.append((i, pack_call(helper_value, (i,), {})))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=pack, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(packed) == 160
    for i, call in packed:
        fn, args, kwargs = cloudpickle.loads(call.head)
        assert fn.__module__ == __name__ and fn(*args) == 3 * i
        assert b"_make_function" in call.head  # by value: the code travels, not a module reference


def test_bad_pool_fields_name_the_field_before_anything_starts():
    with pytest.raises(ValueError, match="hosts: provider='ssh' needs one host per node"):
        GPUPool(provider="ssh", nodes=2)
    with pytest.raises(PoolConfigError, match="nodes: must be an integer"):
        from skytasks import distributed_task

        distributed_task(helper_value, nodes=0)


@pytest.mark.parametrize("env, expected", [
    # Outside SLURM nothing is added.
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1"}, {}),
    # Rank 3 of 2 nodes x 2: what `srun --ntasks-per-node=2` would give its fourth task.
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "RANK": "3", "WORLD_SIZE": "4",
      "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1", "SKYTASKS_NUM_NODES": "2"},
     {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
      "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NNODES": "2",
      "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
      "SLURM_GTIDS": "2,3"}),
    # One node of 8: the step's shape is the pool's.
    ({"SLURM_JOB_ID": "7", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
      "NODE_RANK": "0", "SKYTASKS_NUM_NODES": "1"},
     {"SLURM_PROCID": "5", "SLURM_LOCALID": "5", "SLURM_NODEID": "0", "SLURM_NTASKS": "8", "SLURM_NPROCS": "8",
      "SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "8", "SLURM_NNODES": "1", "SLURM_STEP_NUM_TASKS": "8",
      "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "8", "SLURM_GTIDS": "0,1,2,3,4,5,6,7"}),
])
def test_each_rank_in_a_slurm_step_gets_the_task_variables_of_its_own_place(env, expected):
    from skytasks.node.slurm_env import slurm_task_environment

    assert slurm_task_environment(env) == expected


def test_a_malformed_message_from_a_node_loses_that_node_naming_it_and_the_field():
    import io
    import queue

    from skytasks.controller.channel import NodeChannel
    from skytasks.providers import NodeLink
    from skytasks.wire import encode

    def frame(msg):
        return b"".join(bytes(c) for c in encode(msg))

    bad = {"op": "result", "group": 1, "rank": 0, "call": 7, "started": 0.0, "ended": 1.0}  # no value
    stream = io.BytesIO(frame({"op": "hello", "pid": 1, "python": "python3", "gpus": []}) + frame(bad))
    events: queue.Queue = queue.Queue()
    NodeChannel(NodeLink(3, "10.0.0.3", stream, io.BytesIO()), events).start()
    first, second = events.get(timeout=5), events.get(timeout=5)
    assert first[1]["op"] == "hello"  # a well-formed message passes
    node, lost = second
    assert node == 3 and lost["op"] == "lost"
    assert "node 3 (10.0.0.3) sent a malformed message: result: missing ['value']" in lost["reason"]
