"""Device placement and backend choice, as pure functions: no GPU needed, every layout checked.

The contract: every rank gets one distinct GPU when there are enough (LOCAL_RANK is its index among
the GPUs its node sees, as under torchrun); auto picks nccl only then, else gloo with a note naming
the ranks and the GPU; an explicit nccl that NCCL would refuse is a PoolConfigError naming
nodes/procs_per_node, the GPU count and what to change.
"""

from __future__ import annotations

import pytest

from skytasks.devices import (check_backend_before_launch, choose_backend, place_ranks, split_local_gpus,
                              visible_gpus)
from skytasks.errors import PoolConfigError

SMI = "\n".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:04d})" for i in range(8))

LOCAL = dict(on_this_machine=True, gpus_from_config=False)
SSH = dict(on_this_machine=False, gpus_from_config=False)
LAUNCHED = dict(on_this_machine=False, gpus_from_config=True)  # aws, slurm


def smi(n: int) -> str:
    return "\n".join(SMI.splitlines()[:n])


def test_visible_gpus_reads_the_users_cuda_visible_devices_first():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, smi(8)) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": " 1 , 0 "}, smi(8)) == ["1", "0"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-0003"}, smi(8)) == ["GPU-0003"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,-1,1"}, smi(8)) == ["0"]  # CUDA stops at -1


def test_empty_cuda_visible_devices_means_cpu_even_on_a_gpu_machine():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, smi(8)) == []
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}, smi(8)) == []


def test_visible_gpus_counts_nvidia_smi_lines_when_unset():
    assert visible_gpus({}, smi(4)) == ["0", "1", "2", "3"]
    assert visible_gpus({}, "") == []
    assert visible_gpus({}, "No devices were found") == []


def _local(gpus: list[str], nodes: int, ppn: int):
    slices = split_local_gpus(gpus, nodes, ppn)
    return slices, place_ranks(slices, ppn, ["this machine"] * nodes)


@pytest.mark.parametrize("gpu_count", [1, 2, 4, 8])
@pytest.mark.parametrize("nodes,ppn", [(1, 1), (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1),
                                       (3, 1), (1, 3), (3, 2)])
def test_local_mapping_gives_every_rank_its_own_gpu_when_there_are_enough(gpu_count, nodes, ppn):
    gpus = [str(i) for i in range(gpu_count)]
    slices, placed = _local(gpus, nodes, ppn)
    world = nodes * ppn
    assert [r.rank for r in placed] == list(range(world))
    assert all(r.rank == r.node_rank * ppn + r.local_rank for r in placed)
    physical = [r.gpu for r in placed]
    assert all(p in gpus for p in physical)
    if gpu_count >= world:
        assert len(set(physical)) == world  # distinct GPUs
        # LOCAL_RANK is the device index inside the node's CUDA_VISIBLE_DEVICES, as torchrun's
        assert all(r.index == r.local_rank and r.device == f"cuda:{r.local_rank}" for r in placed)
        assert all(len(s) == ppn for s in slices)
        assert choose_backend(None, placed).backend == "nccl"
        assert choose_backend("nccl", placed).backend == "nccl"
    else:
        assert len(set(physical)) == gpu_count  # every GPU used, some shared
        assert all(r.device.startswith("cuda:") for r in placed)
        choice = choose_backend(None, placed)
        assert choice.backend == "gloo" and "share GPU" in choice.note
        with pytest.raises(PoolConfigError, match=rf"nodes={nodes} x procs_per_node={ppn} = {world} ranks "
                                                 rf"would run on {gpu_count} GPU"):
            choose_backend("nccl", placed)
    for r in placed:  # the index always points into what the node sees
        assert slices[r.node_rank][r.index] == r.gpu


@pytest.mark.parametrize("world", range(1, 9))
def test_users_cuda_visible_devices_2_3(world):
    gpus = visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"}, smi(8))
    slices, placed = _local(gpus, world, 1)  # one rank per node, `world` nodes
    if world <= 2:
        assert [r.gpu for r in placed] == ["2", "3"][:world]
        assert slices == [["2"], ["3"]][:world] and all(r.device == "cuda:0" for r in placed)
        assert choose_backend(None, placed).backend == "nccl"
    else:
        assert {r.gpu for r in placed} == {"2", "3"}  # never a GPU the user hid
        assert choose_backend(None, placed).backend == "gloo"
    one_node = place_ranks(split_local_gpus(gpus, 1, world), world, ["this machine"])
    assert {r.gpu for r in one_node} <= {"2", "3"}
    assert [r.device for r in one_node][:2] == ["cuda:0", "cuda:1"][:world]


def test_cpu_only_is_gloo_without_a_note_and_nccl_is_refused():
    slices, placed = _local([], 2, 2)
    assert slices == [[], []] and {r.device for r in placed} == {"cpu"}
    assert choose_backend(None, placed).backend == "gloo"
    assert choose_backend(None, placed).note is None
    with pytest.raises(PoolConfigError, match=r"ranks \[0, 1, 2, 3\] have no GPU"):
        choose_backend("nccl", placed)


def test_shared_gpu_note_names_the_ranks_and_the_gpu():
    _, placed = _local(["0"], 2, 1)
    choice = choose_backend(None, placed)
    assert choice.backend == "gloo"
    assert choice.note == "using gloo, not nccl: ranks [0, 1] would share GPU 0 on this machine"


def test_explicit_nccl_refusal_says_what_to_change():
    _, placed = _local(["0"], 2, 1)
    with pytest.raises(PoolConfigError) as err:
        choose_backend("nccl", placed)
    text = str(err.value)
    assert text.startswith("backend: 'nccl'")
    for needle in ("nodes=2", "procs_per_node=1", "1 GPU", "ranks [0, 1] would share GPU 0",
                   "Lower nodes/procs_per_node", "leave backend unset"):
        assert needle in text


def test_remote_nodes_are_separate_machines_so_the_same_gpu_id_is_not_shared():
    placed = place_ranks([["0"], ["0"]], 1, ["10.0.0.1", "10.0.0.2"])
    assert choose_backend(None, placed).backend == "nccl"
    placed = place_ranks([["0", "1"], ["0", "1"]], 4, ["a", "b"])  # procs_per_node over the GPU count
    assert choose_backend(None, placed).backend == "gloo"


def test_a_node_without_gpus_among_gpu_nodes_means_gloo():
    placed = place_ranks([["0"], []], 1, ["a", "b"])
    choice = choose_backend(None, placed)
    assert choice.backend == "gloo" and "ranks [1] have no GPU" in choice.note


def test_other_explicit_backends_pass_through():
    _, placed = _local(["0"], 2, 1)
    assert choose_backend("gloo", placed).backend == "gloo" and choose_backend("gloo", placed).note is None


def test_preflight_refuses_nccl_before_launch(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(PoolConfigError, match="procs_per_node=1"):
        check_backend_before_launch("nccl", **LOCAL, nodes=2, procs_per_node=1, accelerators_per_node=None)
    check_backend_before_launch("nccl", **LOCAL, nodes=1, procs_per_node=1, accelerators_per_node=None)  # one rank on one GPU is fine
    check_backend_before_launch(None, **LOCAL, nodes=4, procs_per_node=4, accelerators_per_node=None)  # auto never refuses
    with pytest.raises(PoolConfigError, match="procs_per_node=8"):
        check_backend_before_launch("nccl", **SSH, nodes=2, procs_per_node=8, accelerators_per_node=4)
    with pytest.raises(PoolConfigError, match="have no GPU"):
        check_backend_before_launch("nccl", **LAUNCHED, nodes=2, procs_per_node=1, accelerators_per_node=None)  # a CPU instance type
    check_backend_before_launch("nccl", **SSH, nodes=2, procs_per_node=8, accelerators_per_node=None)  # unknown until the agents report
