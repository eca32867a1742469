"""The GPU path, as far as a CPU machine can prove it: devices reach the ranks, explicit nccl is
refused before launch, GPU failures keep their type, and an agent starts from wherever the
controller runs. (The same code on a GPU machine: see docs/gpus.md.)"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from skytasks import DistributedTaskError, GPUPool, distributed_task, rank_info
from skytasks.errors import PoolConfigError
from tests.conftest import started_here

ROOT = Path(__file__).resolve().parent.parent


def device_report() -> dict:
    import torch
    import torch.distributed as dist

    info = rank_info()
    return {"device": info.device, "env": os.environ.get("SKYTASKS_DEVICE"), "backend": dist.get_backend(),
            "tensor_on": str(torch.ones(1, device=info.device).device)}


def cpu_only(monkeypatch) -> None:
    """What a CPU machine sees, on any machine: an empty CUDA_VISIBLE_DEVICES means no GPU (on the
    GPU machine these tests then say the same; benchmarks/gpu_check.py proves the GPU side there)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def test_every_rank_is_told_its_device_and_the_chosen_backend(monkeypatch):
    cpu_only(monkeypatch)
    results = distributed_task(device_report, pool=GPUPool(nodes=2, procs_per_node=2))()
    assert [r["device"] for r in results] == ["cpu"] * 4
    assert {r["env"] for r in results} == {"cpu"}
    assert {r["backend"] for r in results} == {"gloo"}
    assert {r["tensor_on"] for r in results} == {"cpu"}


def test_explicit_nccl_on_ranks_without_a_gpu_is_refused_before_anything_starts(monkeypatch):
    cpu_only(monkeypatch)
    task = distributed_task(device_report, pool=GPUPool(nodes=2), backend="nccl")
    with pytest.raises(PoolConfigError) as err:
        task()
    assert "nodes=2 x procs_per_node=1" in str(err.value) and "have no GPU" in str(err.value)
    assert started_here() == []  # no agent was ever started


def test_explicit_nccl_on_a_shared_gpu_is_refused_naming_the_layout(monkeypatch):
    # The controller sees one GPU (as on a 1-GPU machine): two local nodes would share it.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    task = distributed_task(device_report, pool=GPUPool(nodes=2), backend="nccl")
    with pytest.raises(PoolConfigError, match=r"ranks \[0, 1\] would share GPU 0 on this machine"):
        task()
    assert started_here() == []


def raise_gpu_oom() -> None:
    import torch

    if rank_info().rank == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    import time

    time.sleep(60)


def test_gpu_out_of_memory_keeps_its_type_and_names_rank_node_and_device(monkeypatch):
    import torch

    cpu_only(monkeypatch)  # torch's own OOM, raised by hand: gpu_check.py makes a real one on a GPU

    with pytest.raises(DistributedTaskError) as caught:
        distributed_task(raise_gpu_oom, pool=GPUPool(nodes=2))()
    (oom,) = caught.value.exceptions
    assert isinstance(oom, torch.OutOfMemoryError) and "Tried to allocate" in str(oom)
    assert "[skytasks] rank 1 failed (node 1, 127.0.0.1, device cpu)" in oom.__notes__


def test_rank_info_device_defaults_to_cpu_outside_a_placement(monkeypatch):
    from skytasks.rank import rank_environment

    env = rank_environment(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                           peers=("127.0.0.1",), head_port=1234, accelerators=0)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert rank_info().device == "cpu"
    monkeypatch.setenv("SKYTASKS_DEVICE", "cuda:3")
    assert rank_info().device == "cuda:3"


def test_agent_starts_when_skytasks_is_importable_only_through_the_controllers_sys_path(tmp_path):
    """A controller that imports skytasks from a checkout via sys.path, run from elsewhere: its
    agents and ranks must find skytasks too. The interpreter here has the test environment's
    packages but not the editable skytasks install."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    # A plain path entry: the parent environment's .pth files (the editable install) stay unread.
    # The test environment's packages, and those PYTHONPATH adds (as on the GPU machine).
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "skytasks").exists()]
    (site / "parent.pth").write_text("\n".join([sysconfig.get_paths()["purelib"], *extra]) + "\n")
    checkout = tmp_path / "checkout"
    (checkout / "skytasks").mkdir(parents=True)
    for f in (ROOT / "skytasks").rglob("*.py"):
        dest = checkout / "skytasks" / f.relative_to(ROOT / "skytasks")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.read_bytes())
    (checkout / "skytasks" / "blocks").mkdir()  # where an install puts the repository's blocks/
    for f in (ROOT / "blocks").glob("*.py"):
        (checkout / "skytasks" / "blocks" / f.name).write_bytes(f.read_bytes())
    script = tmp_path / "elsewhere" / "controller.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(checkout)!r})
        import skytasks
        assert skytasks.__file__.startswith({str(checkout)!r}), skytasks.__file__
        from skytasks import GPUPool
        from skytasks import distributed_task, rank_info

        def where():
            import skytasks
            return (rank_info().rank, skytasks.__file__)

        print(distributed_task(where, pool=GPUPool(nodes=2), init_torch=False)())
    """))
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import skytasks"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert probe.returncode != 0, "the test interpreter must not see the installed skytasks"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(venv / "bin" / "python"), str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(0, '{checkout}/skytasks/__init__.py')" in proc.stdout
    assert f"(1, '{checkout}/skytasks/__init__.py')" in proc.stdout


def placement() -> dict:
    import torch.distributed as dist

    return {"device": rank_info().device, "backend": dist.get_backend(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_ranks_that_would_share_a_gpu_run_gloo_and_the_call_says_so_once(monkeypatch, capsys):
    """As on a 1-GPU machine (the controller is told GPU 0 is visible; this machine has no CUDA, so
    the ranks only carry the placement): two nodes share GPU 0, so auto picks gloo, once said."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    pool = GPUPool(nodes=2)
    task = distributed_task(placement, pool=pool)
    with pool:
        first = task()
        second = task()  # the same warm group: not said again
    assert first == second == [{"device": "cuda:0", "backend": "gloo", "visible": "0"}] * 2
    err = capsys.readouterr().err
    assert err.count("using gloo, not nccl: ranks [0, 1] would share GPU 0 on this machine") == 1, err


def test_with_a_gpu_each_local_nodes_see_their_own_slice(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    results = distributed_task(placement, pool=GPUPool(nodes=2, procs_per_node=2), backend="gloo")()
    assert [r["visible"] for r in results] == ["2,3", "2,3", "5,7", "5,7"]
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]  # = LOCAL_RANK
