"""Which GPU each rank gets, and which backend the group can use: pure functions, no CUDA calls.

Stdlib only: the node agent uses `visible_gpus` to tell the controller what its node has, and the
controller decides everything else before a rank starts, so a layout NCCL would refuse ("Duplicate
GPU detected") is either moved to gloo (auto) or refused with the fields to change (explicit).

Like torchrun, `LOCAL_RANK` is the index of the rank's device among the GPUs its node sees: a local
node's `CUDA_VISIBLE_DEVICES` is narrowed to its own slice of the machine's GPUs, so local rank 1 of
node 1 on a 4-GPU machine with 2 nodes x 2 procs sees GPUs "2,3" and uses cuda:1 (physical GPU 3).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Sequence

from skytasks.errors import PoolConfigError


def visible_gpus(environ: Mapping[str, str] | None = None, nvidia_smi_lines: str | None = None) -> list[str]:
    """The GPU ids this process may use, as `CUDA_VISIBLE_DEVICES` would list them.

    A `CUDA_VISIBLE_DEVICES` that is set wins, even empty (`""` means CPU, as for CUDA itself).
    Otherwise `nvidia-smi -L` counts them without initialising CUDA here; no driver means none.
    """
    env = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = []
        for part in env["CUDA_VISIBLE_DEVICES"].split(","):
            part = part.strip()
            if not part or part == "-1" or (part.lstrip("-").isdigit() and int(part) < 0):
                break  # CUDA ignores everything from the first invalid entry on
            ids.append(part)
        return ids
    if nvidia_smi_lines is None:
        nvidia_smi_lines = _nvidia_smi_list()
    return [str(i) for i, _ in enumerate(line for line in nvidia_smi_lines.splitlines() if line.startswith("GPU "))]


def _nvidia_smi_list() -> str:
    if shutil.which("nvidia-smi") is None:
        return ""
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def split_local_gpus(gpus: Sequence[str], nodes: int, procs_per_node: int) -> list[list[str]]:
    """What each local node (all on this machine) sees as `CUDA_VISIBLE_DEVICES`.

    With a GPU for every rank, node n gets GPUs [n*P, (n+1)*P): each rank one of its own. With
    fewer, GPUs are dealt round-robin and ranks share them; `choose_backend` then says gloo.
    """
    if not gpus:
        return [[] for _ in range(nodes)]
    if len(gpus) >= nodes * procs_per_node:
        return [list(gpus[n * procs_per_node:(n + 1) * procs_per_node]) for n in range(nodes)]
    per_node = []
    for n in range(nodes):
        mine = [gpus[(n * procs_per_node + p) % len(gpus)] for p in range(procs_per_node)]
        per_node.append(list(dict.fromkeys(mine)))
    return per_node


@dataclass(frozen=True)
class RankDevice:
    rank: int
    node_rank: int
    local_rank: int
    index: int | None  # cuda:<index> among the node's visible GPUs; None: CPU
    gpu: str | None  # the id the node lists it under (its CUDA_VISIBLE_DEVICES entry)
    machine: str  # ranks on one machine with the same `gpu` share it

    @property
    def device(self) -> str:
        return "cpu" if self.index is None else f"cuda:{self.index}"


def place_ranks(node_gpus: Sequence[Sequence[str]], procs_per_node: int,
                machines: Sequence[str] | None = None) -> list[RankDevice]:
    """Every rank's device, in rank order. `node_gpus[n]` is what node n sees; `machines[n]` names
    the physical machine (local nodes share one; GPU ids are only comparable on one machine)."""
    machines = list(machines) if machines is not None else [f"node {n}" for n in range(len(node_gpus))]
    placed = []
    for node_rank, gpus in enumerate(node_gpus):
        for local in range(procs_per_node):
            index = local % len(gpus) if gpus else None
            placed.append(RankDevice(
                rank=node_rank * procs_per_node + local, node_rank=node_rank, local_rank=local, index=index,
                gpu=None if index is None else gpus[index], machine=machines[node_rank],
            ))
    return placed


@dataclass(frozen=True)
class BackendChoice:
    backend: str
    note: str | None = None  # said once in the call's logs (a fallback the user should know of)


def shared_gpus(placement: Sequence[RankDevice]) -> dict[tuple[str, str], list[int]]:
    """(machine, gpu) -> ranks, for every GPU that more than one rank would use."""
    users: dict[tuple[str, str], list[int]] = {}
    for r in placement:
        if r.gpu is not None:
            users.setdefault((r.machine, r.gpu), []).append(r.rank)
    return {k: v for k, v in users.items() if len(v) > 1}


def choose_backend(requested: str | None, placement: Sequence[RankDevice]) -> BackendChoice:
    """`None`: nccl when every rank has a GPU of its own, else gloo (saying why when GPUs exist).
    An explicit "nccl" on a layout NCCL refuses is a `PoolConfigError` naming what to change."""
    shared = shared_gpus(placement)
    without = [r.rank for r in placement if r.index is None]
    gpu_count = len({(r.machine, r.gpu) for r in placement if r.gpu is not None})
    if requested is not None and requested != "nccl":
        return BackendChoice(requested)
    if not shared and not without:
        return BackendChoice("nccl")
    if requested is None:
        if len(without) == len(placement):
            return BackendChoice("gloo")
        return BackendChoice("gloo", note="using gloo, not nccl: " + _why_not_nccl(shared, without, gpu_count))
    nodes = len({r.node_rank for r in placement})
    ppn = len(placement) // max(nodes, 1)
    raise PoolConfigError(
        f"backend: 'nccl' needs a GPU of its own for every rank, but nodes={nodes} x procs_per_node={ppn} "
        f"= {len(placement)} ranks would run on {gpu_count} GPU(s): {_why_not_nccl(shared, without, gpu_count)}. "
        f"Lower nodes/procs_per_node to at most one rank per GPU, give the nodes more GPUs, "
        f"or leave backend unset (gloo is chosen for shared GPUs)"
    )


def _why_not_nccl(shared: dict[tuple[str, str], list[int]], without: list[int], gpu_count: int) -> str:
    parts = [f"ranks {ranks} would share GPU {gpu} on {machine}"
             for (machine, gpu), ranks in sorted(shared.items(), key=lambda kv: kv[1])]
    if without:
        parts.append(f"ranks {without} have no GPU")
    return "; ".join(parts)


def device_environment(r: RankDevice, backend: str) -> dict[str, str]:
    """What a rank process reads to pick its device (`rank_info().device`) and backend."""
    return {"SKYTASKS_DEVICE": r.device, "SKYTASKS_BACKEND": backend}


def check_backend_before_launch(backend: str | None, *, on_this_machine: bool, gpus_from_config: bool, nodes: int,
                                procs_per_node: int, accelerators_per_node: int | None) -> None:
    """An explicit nccl that cannot work is refused before any node is brought up, from what is
    known beforehand: this machine's GPUs for nodes on this machine, `accelerators_per_node` for
    others (for a provider that launches what the configuration says, unset means no GPU).
    (Remote nodes are checked again against what their agents report, before ranks start.)"""
    if backend != "nccl":
        return
    if on_this_machine:
        slices = split_local_gpus(visible_gpus(), nodes, procs_per_node)
        choose_backend("nccl", place_ranks(slices, procs_per_node, ["this machine"] * nodes))
    elif accelerators_per_node is not None or gpus_from_config:
        per_node = [[str(i) for i in range(accelerators_per_node or 0)] for _ in range(nodes)]
        choose_backend("nccl", place_ranks(per_node, procs_per_node))
