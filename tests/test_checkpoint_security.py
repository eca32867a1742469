"""A checkpoint runs no code: whoever can write the checkpoint store (a directory, a bucket) cannot
run code in the ranks by planting a step file. Loading is weights-only unless `trusted=True`, the
head sends the other ranks the file's bytes (each loads them itself), and what is written is the
owner's alone (directories 0700, files 0600)."""

from __future__ import annotations

import io
import os
import stat
import uuid

import pytest

from skytasks import CheckpointError, DistributedTaskError, GPUPool, distributed_task
from skytasks.checkpoint import Checkpointer
from tests.conftest import moto_bucket

SYSTEM = f"{os.system.__module__}.system"  # how a pickle names os.system: posix.system on Linux


class RunsACommand:
    """What a hostile step file holds: unpickling it runs `command` in a shell."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class NotAStateDict:
    """A harmless class of the user's own, which weights-only loading does not know either."""


def hostile_bytes(marker) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save({"model": RunsACommand(f"touch {marker}")}, buf)
    return buf.getvalue()


def load_on_every_rank(path: str) -> dict:
    from skytasks import CheckpointError, Checkpointer, rank_info

    try:
        found = Checkpointer(path).load_latest()
    except CheckpointError as exc:
        return {"rank": rank_info().rank, "refused": exc.type_name, "message": str(exc)}
    return {"rank": rank_info().rank, "loaded": repr(found)}


def load_and_raise(path: str):
    from skytasks import Checkpointer

    return Checkpointer(path).load_latest()


def same(a, b) -> bool:
    """Equal in structure, types and every tensor's dtype and values."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def train_save_and_reload(path: str) -> dict:
    """One Adam step of a Linear model, saved on the head, loaded back on every rank."""
    import torch
    import torch.distributed as dist

    from skytasks import Checkpointer, rank_info

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    ckpt = Checkpointer(path)
    ckpt.save(state, 3)
    dist.barrier()  # the head's file is whole before anyone reads it
    step, loaded = ckpt.load_latest()
    fresh = torch.nn.Linear(4, 2)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["opt"])
    return {"rank": rank_info().rank, "step": step, "same": same(loaded, state),
            "model_same": same(fresh.state_dict(), model.state_dict()),
            "opt_same": same(fresh_opt.state_dict(), opt.state_dict()),
            "adam_steps": float(loaded["opt"]["state"][0]["step"]),
            "weights": [round(v, 6) for v in loaded["model"]["weight"].flatten().tolist()]}


def assert_refused_everywhere(results: list[dict], where: str) -> None:
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:  # rank 1 too: it was sent bytes, and its own load refused them
        assert r.get("refused") == SYSTEM, r
        assert where in r["message"] and "Checkpointer(..., trusted=True)" in r["message"], r["message"]
        assert "wrote yourself" in r["message"]


def test_a_step_file_that_would_run_a_command_is_refused_on_a_2_node_pool(tmp_path):
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    store = tmp_path / "ckpt"
    Checkpointer(store).save({"w": 1}, 1)
    (store / "step-000000000007.pt").write_bytes(hostile_bytes(marker))  # the store's writer is hostile
    pool = GPUPool(nodes=2)
    with pool:
        results = distributed_task(load_on_every_rank, pool=pool)(str(store))
        assert_refused_everywhere(results, f"{store}/step-000000000007.pt")
        with pytest.raises(DistributedTaskError) as caught:  # uncaught in the rank: the caller sees it
            distributed_task(load_and_raise, pool=pool)(str(store))
    first = caught.value.exceptions[0]
    assert isinstance(first, CheckpointError) and first.type_name == SYSTEM
    assert not marker.exists()
    # The file really is hostile: unpickled fully, as trusted=True does, it runs the command.
    assert Checkpointer(store, trusted=True).load_latest()[0] == 7
    assert marker.exists()


def test_a_models_and_optimizers_state_dict_still_loads_on_every_rank(tmp_path):
    results = distributed_task(train_save_and_reload, pool=GPUPool(nodes=2))(str(tmp_path / "ckpt"))
    for r in results:
        assert (r["step"], r["same"], r["model_same"], r["opt_same"], r["adam_steps"]) == (3, True, True, True, 1.0), r
    assert results[0]["weights"] == results[1]["weights"]


@pytest.fixture(scope="module")
def bucket(moto):
    return moto_bucket(moto, "secure-ckpts")


def test_an_s3_checkpoint_is_refused_when_hostile_and_loads_when_real(bucket, tmp_path):
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    bucket["client"].put_object(Bucket="secure-ckpts", Key="planted/step-000000000005.pt", Body=hostile_bytes(marker))
    pool = GPUPool(nodes=2, aws_credentials=bucket["creds"])
    with pool:
        refused = distributed_task(load_on_every_rank, pool=pool)("s3://secure-ckpts/planted")
        real = distributed_task(train_save_and_reload, pool=pool)("s3://secure-ckpts/real")
    assert_refused_everywhere(refused, "s3://secure-ckpts/planted/step-000000000005.pt")
    assert not marker.exists()
    for r in real:
        assert (r["step"], r["same"], r["model_same"], r["opt_same"]) == (3, True, True, True), r
    keys = [o["Key"] for o in bucket["client"].list_objects_v2(Bucket="secure-ckpts", Prefix="real/")["Contents"]]
    assert keys == ["real/step-000000000003.pt"]


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_directories_made_are_0700_and_files_0600_whatever_the_umask(tmp_path):
    import torch

    os.chmod(tmp_path, 0o755)
    where = tmp_path / "runs" / "a" / "ckpt"
    old = os.umask(0)  # the most permissive: privacy must not depend on the user's umask
    try:
        Checkpointer(where).save({"w": torch.ones(2)}, 1)
        Checkpointer(where).save({"w": torch.ones(2)}, 2)
    finally:
        os.umask(old)
    assert [mode(d) for d in (tmp_path / "runs", tmp_path / "runs" / "a", where)] == [0o700] * 3
    assert mode(tmp_path) == 0o755  # a directory that was there keeps its owner's mode
    assert sorted(p.name for p in where.iterdir()) == ["step-000000000001.pt", "step-000000000002.pt"]
    assert all(mode(p) == 0o600 for p in where.iterdir())


def test_a_link_planted_at_the_temporary_name_is_never_written_through(tmp_path):
    import torch

    victim = tmp_path / "victim"
    victim.write_text("untouched")
    store = tmp_path / "ckpt"
    store.mkdir()
    (store / f".step-000000000004.pt.{os.getpid()}.partial").symlink_to(victim)
    Checkpointer(store).save({"w": torch.arange(3)}, 4)
    assert victim.read_text() == "untouched"
    assert [p.name for p in store.iterdir()] == ["step-000000000004.pt"]
    assert mode(store / "step-000000000004.pt") == 0o600
    assert Checkpointer(store).load_latest()[1]["w"].tolist() == [0, 1, 2]


def test_what_the_error_names_for_each_kind_of_refusal(tmp_path):
    import pickle

    import torch

    plain = tmp_path / "plain"
    with pytest.warns(UserWarning, match=rf"step 1 holds {NotAStateDict.__module__}\.NotAStateDict, which load_latest"):
        Checkpointer(plain).save({"extra": NotAStateDict()}, 1)  # saved, and told at once
    assert Checkpointer(plain).steps() == [1]
    with pytest.raises(CheckpointError) as caught:
        Checkpointer(plain).load_latest()
    assert caught.value.type_name == f"{NotAStateDict.__module__}.NotAStateDict"
    assert f"holds {caught.value.type_name}," in str(caught.value)
    assert isinstance(Checkpointer(plain, trusted=True).load_latest()[1]["extra"], NotAStateDict)
    # A bare pickle, not torch's format: refused in the unpickler's own words.
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "step-000000000001.pt").write_bytes(pickle.dumps(RunsACommand("true"), protocol=4))
    with pytest.raises(CheckpointError, match=r"trusted=True") as caught:
        Checkpointer(raw).load_latest()
    assert caught.value.type_name and caught.value.path == f"{raw}/step-000000000001.pt"
    # Crossing from a rank to the caller keeps what it said.
    again = pickle.loads(pickle.dumps(caught.value))
    assert (str(again), again.type_name, again.path) == (str(caught.value), caught.value.type_name, caught.value.path)
    assert isinstance(again, pickle.UnpicklingError)  # code that caught torch's own error still catches it
    # Tensors, numbers, strings and their containers load as they were.
    data = {"t": torch.arange(4), "n": 3, "x": 0.5, "s": "abc", "b": b"\x00", "l": [1, (2, 3)], "none": None}
    ok = tmp_path / "ok"
    Checkpointer(ok).save(data, 9)
    assert same(Checkpointer(ok).load_latest()[1], data)
    with pytest.raises(ValueError, match="^trusted:"):
        Checkpointer(ok, trusted="yes")
    assert repr(Checkpointer(ok, trusted=True)).endswith("trusted=True)") and "trusted" not in repr(Checkpointer(ok))


def test_saving_a_real_training_state_warns_of_nothing(tmp_path):
    import warnings

    import torch

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
             "rng": torch.get_rng_state(), "losses": [0.5, 0.25], "half": torch.ones(2, dtype=torch.bfloat16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Checkpointer(tmp_path).save(state, 1)
        assert same(Checkpointer(tmp_path).load_latest()[1], state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # trusted: the user said so, no warning
        Checkpointer(tmp_path / "mine", trusted=True).save({"extra": NotAStateDict()}, 1)
