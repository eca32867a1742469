"""The typed core, without rank processes: the protocol, the settings, the frozen pool spec, the
pool a thread gets by default, and packing calls from many threads at once."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import cloudpickle
import pytest

from skytasks import GPUPool, PoolConfigError
from skytasks.controller.packing import pack_call
from skytasks.controller.pool_runtime import active_pool
from skytasks.pool_spec import PoolSpec
from skytasks.protocol import Op
from skytasks.settings import settings

ROOT = Path(__file__).resolve().parent.parent


def _ops_in(paths: list[Path], *, sent: bool) -> set[str]:
    """String ops in `{"op": "..."}` literals (sent) or in `op == "..."` / `Op.X` uses."""
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if sent and isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and k.value == "op":
                        if isinstance(v, ast.Constant):
                            found.add(v.value)
                        elif isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "Op":
                            found.add(Op[v.attr].value)
    return found


def test_every_op_any_side_sends_is_in_the_protocol_and_every_protocol_op_is_sent():
    node_side = sorted((ROOT / "skytasks" / "node").glob("*.py")) + [ROOT / "skytasks" / "metrics.py"]
    controller_side = sorted((ROOT / "skytasks" / "controller").glob("*.py"))
    sent = _ops_in(node_side, sent=True) | _ops_in(controller_side, sent=True)
    assert sent <= {op.value for op in Op}, f"sent but not in skytasks.protocol.Op: {sent - {op.value for op in Op}}"
    assert {op.value for op in Op} <= sent, f"in the protocol but never sent: {({op.value for op in Op}) - sent}"
    for gone in ("spawned", "closed", "shutdown"):  # sent and never read, or read and never sent
        assert gone not in sent and gone not in {op.value for op in Op}


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
    local = GPUPool(nodes=3, procs_per_node=2, env={"A": "1"}).spec()
    assert (local.provider, local.nodes, local.procs_per_node, local.ssh, local.aws) == ("local", 3, 2, None, None)
    assert local.env["A"] == "1" and local.name == "local-pool"
    with pytest.raises(AttributeError):
        local.nodes = 4  # frozen
    ssh = GPUPool(provider="ssh", nodes=2, hosts=["a", "b:2222"], known_hosts="x").spec()
    assert ssh.ssh.hosts == ("a", "b:2222") and ssh.aws is None
    with pytest.raises(ValueError, match="provider='ssh': the ssh part must be set"):
        PoolSpec(name="x", provider="ssh", nodes=1, procs_per_node=1, accelerators_per_node=None)


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
