"""Sharded checkpoints on real gloo ranks: FSDP2 state saved by every rank in DCP's format,
asynchronously, committed whole, restored on another world size, and never running code.

The pools are shared by the module's tests (`with pool:`), so ranks start once per pool; the
leak check runs when the module's pools are down instead of after each test.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from skytasks import CheckpointError, DistributedTaskError, GPUPool, distributed_task
from skytasks.checkpoint import Checkpointer
from skytasks.checkpointing.committed_event import CheckpointCommitted
from tests.harness.workloads import whole

# conftest's `pools` (four, two) stay up between this module's tests: its leak check runs once they are down.
POOLS_STAY_UP = True


# -- what the ranks run ------------------------------------------------------------------------

def build(seed: int):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def train(model, opt, steps: range) -> None:
    import torch
    import torch.distributed as dist

    for step in steps:
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def save_after_training(path: str, steps: int) -> dict:
    from skytasks import Checkpointer

    model, opt = build(0)
    train(model, opt, range(steps))
    ckpt = Checkpointer(path)
    ckpt.save({"model": model, "optim": opt, "seen": steps}, steps)
    ckpt.wait()
    return whole(model, opt)


def restore_into_fresh(path: str) -> tuple:
    import torch.distributed as dist

    from skytasks import Checkpointer

    model, opt = build(1)  # other values, the same shapes: what restore must overwrite
    state = {"model": model, "optim": opt, "seen": 0}
    step = Checkpointer(path).restore(state)
    return step, state["seen"], dist.get_world_size(), whole(model, opt)


def assert_same(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


# -- the tests ---------------------------------------------------------------------------------

def test_saved_by_4_ranks_restored_by_2_with_every_adam_moment_and_exported(pools, tmp_path):
    import torch
    from safetensors.torch import load_file

    from skytasks.events import listen

    where = str(tmp_path / "ckpt")
    with listen() as heard:
        saved = distributed_task(save_after_training, pool=pools["four"])(where, 3)
    assert all(len(s) == 4 + 8 + 4 and all(torch.equal(s[k], saved[0][k]) for k in s) for s in saved)
    committed = [e for e in heard if isinstance(e, CheckpointCommitted)]
    assert [(e.step, e.path) for e in committed] == [(3, os.path.join(where, "step-000000000003"))]
    assert committed[0].bytes > 0 and committed[0].blocked_seconds <= committed[0].seconds
    files = sorted(os.listdir(os.path.join(where, "step-000000000003")))
    assert files == [".metadata", "COMMITTED"] + [f"__{r}_0.distcp" for r in range(4)]  # every rank wrote its own

    restored = distributed_task(restore_into_fresh, pool=pools["two"])(where)
    for step, seen, world, values in restored:
        assert (step, seen, world) == (3, 3, 2)
        assert_same(values, saved[0])

    ckpt = Checkpointer(where)
    exported = load_file(ckpt.export(tmp_path / "model.safetensors"))
    for key, value in saved[0].items():
        if key.startswith("param "):
            assert torch.equal(exported[f"model.{key[len('param '):]}"], value)
    full = torch.load(ckpt.export(tmp_path / "all.pt"), weights_only=True)
    assert full["seen"] == 3 and torch.equal(full["model"]["0.weight"], saved[0]["param 0.weight"])
    assert torch.equal(full["optim"]["state"]["2.bias"]["exp_avg_sq"], saved[0]["exp_avg_sq 2.bias"])


def change_right_after_save(path: str) -> tuple:
    import torch

    from skytasks import Checkpointer

    model, opt = build(0)
    train(model, opt, range(2))
    before = whole(model, opt)
    ckpt = Checkpointer(path)
    ckpt.save({"model": model, "optim": opt}, 2)
    with torch.no_grad():  # at once, while the save is still being written
        for p in model.parameters():
            p.add_(1000.0)
        for moments in opt.state.values():
            moments["exp_avg"].add_(1000.0)
    ckpt.wait()
    fresh, fresh_opt = build(1)
    assert Checkpointer(path).restore({"model": fresh, "optim": fresh_opt}) == 2
    return before, whole(fresh, fresh_opt)


def test_what_the_state_becomes_after_an_async_save_returns_never_reaches_it(pools, tmp_path):
    for before, after in distributed_task(change_right_after_save, pool=pools["four"])(str(tmp_path)):
        assert_same(after, before)


def test_a_world_of_one_restores_over_its_group_and_the_console_says_each_commit_once(
        pools, tmp_path, capfd):
    import warnings

    from torch import nn

    where = str(tmp_path / "ckpt")
    saved = distributed_task(save_after_training, pool=pools["two"])(where, 2)
    [(step, seen, world, values)] = distributed_task(restore_into_fresh, pool=GPUPool(nodes=1))(where)
    assert (step, seen, world) == (2, 2, 1)
    assert_same(values, saved[0])
    with warnings.catch_warnings(record=True) as said:  # and in a script's own process, with no group
        warnings.simplefilter("always")
        for async_save in (False, True):  # an async save warns from DCP's own thread
            ckpt = Checkpointer(tmp_path / f"own-{async_save}", async_save=async_save)
            ckpt.save({"model": nn.Linear(2, 2)}, 1)
            ckpt.wait()
            assert ckpt.restore({"model": nn.Linear(2, 2)}) == 1
    seen_text = capfd.readouterr()
    assert "assuming the intent" not in seen_text.out + seen_text.err + " ".join(str(w.message) for w in said)
    # The console says each commit once, in its own words, not also as the raw report behind it.
    assert "[skytasks] checkpoint of step 2 committed at" in seen_text.err
    assert "report: checkpoint" not in seen_text.out + seen_text.err


def save_and_return(path: str) -> float:
    import time

    from skytasks import Checkpointer

    model, opt = build(0)
    Checkpointer(path).save({"model": model, "optim": opt}, 7)  # no wait(): the function just returns
    return time.time()


def test_a_function_that_returns_waits_for_its_save_in_flight(pools, tmp_path):
    returned = distributed_task(save_and_return, pool=pools["four"])(str(tmp_path))
    marker = tmp_path / "step-000000000007" / "COMMITTED"
    assert marker.is_file()  # committed before the call reported success
    assert marker.stat().st_mtime >= min(returned) - 0.01  # written after `save` returned, in the background
    assert Checkpointer(tmp_path).committed_steps() == [7]


def die_right_after_an_async_save(path: str) -> dict:
    import torch
    import torch.distributed as dist

    from skytasks import Checkpointer, rank_info

    model, opt = build(0)
    train(model, opt, range(1))
    ckpt = Checkpointer(path)
    state = {"model": model, "optim": opt}
    if rank_info().attempt == 1:
        for value in (1.0, 2.0):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(value)
            ckpt.save(state, int(value))
            if value == 1.0:
                ckpt.wait()
        if dist.get_rank() == 1:
            os._exit(3)  # the save of step 2 is in flight: staged, maybe partly written
        ckpt.wait()  # the others: stopped by the controller before or during this
    step = ckpt.restore(state)
    values = {float(v) for k, v in whole(model, opt).items() if k.startswith("param ") for v in v.flatten()}
    ckpt.save(state, 3)
    ckpt.wait()
    return {"attempt": rank_info().attempt, "step": step, "values": values, "folders": sorted(os.listdir(path))}


def test_a_rank_that_dies_after_an_async_save_leaves_one_committed_steps_values(pools, tmp_path):
    where = tmp_path / "ckpt"
    results = distributed_task(die_right_after_an_async_save, pool=pools["four"], retries=1)(str(where))
    for r in results:
        assert r["attempt"] == 2
        assert r["step"] in (1, 2)
        assert r["values"] == {float(r["step"])}  # exactly that step's, never a mix
    # The next save removed what the dead rank left uncommitted; keep=3 keeps the rest.
    assert results[0]["folders"] == [f"step-{s:012d}" for s in range(1, 4) if s == 3 or s <= results[0]["step"]]
    assert Checkpointer(where).committed_steps() == sorted({1, results[0]["step"], 3})


def save_a_sharded_state_dict(path: str) -> bool:
    """The issue's repro: a plain dict of FSDP2 shards, which the head alone would save."""
    from skytasks import Checkpointer

    model, _ = build(0)
    Checkpointer(path).save({"model": model.state_dict()}, 1)
    return True


def test_a_plain_dict_of_shards_is_refused_naming_the_form_that_works(pools, tmp_path):
    with pytest.raises(DistributedTaskError) as raised:
        distributed_task(save_a_sharded_state_dict, pool=pools["two"])(str(tmp_path))
    errors = raised.value.exceptions
    assert errors and all(isinstance(e, CheckpointError) for e in errors)
    assert 'save({"model": model, "optim": optimizer, ...}, step)' in str(errors[0])
    assert "DTensor" in str(errors[0])
    assert not os.listdir(tmp_path)  # nothing written


# -- runs no code --------------------------------------------------------------------------------

class RunsACommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def plant_metadata(where: Path, marker: Path) -> None:
    """A committed-looking checkpoint whose `.metadata` runs a command when unpickled."""
    folder = where / "step-000000000005"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(RunsACommand(f"touch {marker}")))
    (folder / "COMMITTED").write_text("{}")


def restore_planted(path: str) -> int | None:
    from torch import nn

    from skytasks import Checkpointer

    return Checkpointer(path).restore({"model": nn.Linear(2, 2)})


def test_a_planted_metadata_pickle_is_refused_on_the_ranks_and_never_runs(pools, tmp_path):
    marker = tmp_path / "ran"
    plant_metadata(tmp_path / "ckpt", marker)
    with pytest.raises(DistributedTaskError) as raised:
        distributed_task(restore_planted, pool=pools["two"])(str(tmp_path / "ckpt"))
    errors = raised.value.exceptions
    assert errors and all(isinstance(e, CheckpointError) for e in errors)
    assert errors[0].type_name == f"{os.system.__module__}.system" and "trusted=True" in str(errors[0])
    assert not marker.exists()


def test_planted_metadata_and_values_are_refused_in_one_process_and_trusted_lifts_it(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn

    marker = tmp_path / "ran"
    plant_metadata(tmp_path / "meta", marker)
    with pytest.raises(CheckpointError, match="posix.system|nt.system"):
        Checkpointer(tmp_path / "meta").restore({"model": nn.Linear(2, 2)})
    with pytest.raises(CheckpointError):
        Checkpointer(tmp_path / "meta").export(tmp_path / "out.pt")
    assert not marker.exists()

    # A genuine checkpoint whose non-tensor value is hostile: DCP's own planner would unpickle it.
    values = tmp_path / "values" / "step-000000000001"
    dcp.save({"model": nn.Linear(2, 2).state_dict(), "epoch": RunsACommand(f"touch {marker}")},
             checkpoint_id=str(values), no_dist=True)
    (values / "COMMITTED").write_text("{}")
    state = {"model": nn.Linear(2, 2), "epoch": 0}
    with pytest.raises(CheckpointError, match="epoch"):
        Checkpointer(tmp_path / "values").restore(state)
    assert not marker.exists() and state["epoch"] == 0

    assert Checkpointer(tmp_path / "values", trusted=True).restore(state) == 1  # yours: it runs
    assert marker.exists()
    assert torch.is_tensor(state["model"].weight)


def test_an_uncommitted_checkpoint_is_never_restored_and_keep_counts_committed(tmp_path):
    import torch
    from torch import nn

    ckpt = Checkpointer(tmp_path, keep=2, async_save=False)
    model = nn.Linear(2, 2)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        ckpt.save({"model": model}, step)
    (tmp_path / "step-000000000004").mkdir()  # a save that never committed
    (tmp_path / "step-000000000004" / ".metadata").write_bytes(b"half")
    assert ckpt.committed_steps() == [2, 3] and ckpt.latest_step() == 3
    fresh = nn.Linear(2, 2)
    assert Checkpointer(tmp_path).restore({"model": fresh}) == 3
    assert torch.equal(fresh.weight, torch.full((2, 2), 3.0))
    ckpt.save({"model": model}, 5)
    assert sorted(os.listdir(tmp_path)) == ["step-000000000003", "step-000000000005"]


def test_a_sharded_checkpoint_s_files_and_exports_are_0600_whatever_the_umask(tmp_path):
    import stat

    from torch import nn

    old = os.umask(0)  # the most permissive: privacy must not depend on the user's umask
    try:
        ckpt = Checkpointer(tmp_path / "ckpt", async_save=False)
        ckpt.save({"model": nn.Linear(2, 2), "epoch": 3}, 1)
        exports = [ckpt.export(tmp_path / "out" / name) for name in ("model.pt", "model.safetensors")]
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(tmp_path / "out").st_mode) == 0o700  # the folder export made
    folder = tmp_path / "ckpt" / "step-000000000001"
    files = sorted(p.name for p in folder.iterdir())
    assert files == [".metadata", "COMMITTED", "__0_0.distcp"], files
    modes = {p: stat.S_IMODE(os.lstat(p).st_mode) for p in [*folder.iterdir(), *map(Path, exports)]}
    assert set(modes.values()) == {0o600}, {str(p): oct(m) for p, m in modes.items()}
    assert stat.S_IMODE(os.lstat(folder).st_mode) == 0o700


def test_old_torch_refuses_to_load_naming_its_version(tmp_path, monkeypatch):
    import torch
    from torch import nn

    from skytasks.checkpointing.torch_gate import refusal_for_torch

    assert refusal_for_torch("2.6.0") is None and refusal_for_torch("2.13.0+cpu") is None
    assert refusal_for_torch("3.0.0a0+git1234") is None
    assert "2.5.1+cu124" in refusal_for_torch("2.5.1+cu124") and "CVE-2025-32434" in refusal_for_torch("2.5.1")
    assert refusal_for_torch("nightly") is not None

    ckpt = Checkpointer(tmp_path, async_save=False)
    ckpt.save({"model": nn.Linear(2, 2)}, 1)
    ckpt.save({"w": torch.zeros(2)}, 1)
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    for load in (lambda c: c.restore({"model": nn.Linear(2, 2)}), lambda c: c.load_latest()):
        with pytest.raises(CheckpointError, match=r"PyTorch is 2\.5\.1.*CVE-2025-32434"):
            load(Checkpointer(tmp_path))
        assert load(Checkpointer(tmp_path, trusted=True)) is not None


# -- S3 ------------------------------------------------------------------------------------------

def save_then_restore_on_s3(url: str) -> tuple:
    from skytasks import Checkpointer

    model, opt = build(0)
    train(model, opt, range(2))
    Checkpointer(url).save({"model": model, "optim": opt}, 2)  # the call's end waits for the commit
    saved = whole(model, opt)
    fresh, fresh_opt = build(1)
    step = Checkpointer(url).restore({"model": fresh, "optim": fresh_opt})
    return step, saved, whole(fresh, fresh_opt)


def test_s3_each_rank_uploads_its_own_shards_and_the_marker_comes_last(moto, tmp_path, monkeypatch):
    import torch

    client = moto["creds"].get_client("s3")
    client.create_bucket(Bucket="sharded")
    pool = GPUPool(nodes=1, procs_per_node=2, aws_credentials=moto["creds"])
    for step, saved, restored in distributed_task(save_then_restore_on_s3, pool=pool)("s3://sharded/runs/a"):
        assert step == 2
        assert_same(restored, saved)
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="sharded", Prefix="runs/a/")["Contents"])
    assert keys == [f"runs/a/step-000000000002/{n}" for n in (".metadata", "COMMITTED", "__0_0.distcp", "__1_0.distcp")]

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_ENDPOINT_URL", moto["endpoint"])):
        monkeypatch.setenv(name, value)
    ckpt = Checkpointer("s3://sharded/runs/a")
    assert ckpt.committed_steps() == [2]
    full = torch.load(ckpt.export(tmp_path / "a.pt"), weights_only=True)
    assert torch.equal(full["model"]["2.weight"], saved["param 2.weight"])


def test_a_commit_says_its_size_in_the_unit_that_reads_best():
    from skytasks.checkpointing.committed_event import size

    assert [size(n) for n in (512, 10_328, 999_999, 123_456_789, 1_500_000_000, 2_500_000_000_000)] == [
        "512 bytes", "10.3 kB", "1 MB", "123 MB", "1.5 GB", "2.5 TB"]
    said = CheckpointCommitted(7, 10_328, 0.01, 0.08, "/ckpt/step-000000000007").text()
    assert "(10.3 kB; training blocked 0.01s, committed after 0.08s)" in said  # not "0.0 MB"


def test_the_console_leaves_out_a_commits_row_but_never_a_users_own_report(capsys):
    from skytasks.controller.console import ConsoleObserver

    console = ConsoleObserver()
    console.on_report(0, {"checkpoint": "/c/step-000000000007", "checkpoint_step": 7, "checkpoint_bytes": 10,
                          "checkpoint_blocked_seconds": 0.01, "checkpoint_seconds": 0.08})
    console.on_report(0, {"checkpoint_step": 7, "loss": 0.5})  # the user's own, that uses the name
    out = capsys.readouterr().out
    assert out.splitlines() == ["[rank 0] report: checkpoint_step=7  loss=0.5"], out
