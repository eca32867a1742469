"""The preflight's probe: what each rank runs, before any user code, as an ordinary call.

It runs in the very ranks the first user call then reuses (the same forks, the same process
group), so "basic" costs one round trip and one small all-reduce, not another start. Every
figure is measured on all nodes at once. Returns plain numbers (`rules.RankFigures`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

COMPUTE_SECONDS = 0.25  # each rank multiplies matrices for this long (a slow node is measured, not waited for)
CPU_MATRIX, GPU_MATRIX = 256, 4096
CPU_BYTES, GPU_BYTES = 4 << 20, 256 << 20  # what each bandwidth all-reduce moves
ROUNDS = 3  # all-reduces timed per link, after one to warm it
DCGM_SECONDS = 120


def probe(level: str, gpu: bool) -> dict[str, Any]:
    """This rank's figures: its GPU as the pool promised it, one small all-reduce over every rank,
    and for "full" its compute, its node's bandwidth and its links to each other node."""
    rank, node_rank = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
    figures: dict[str, Any] = {"rank": rank, "node_rank": node_rank}
    dist = sys.modules.get("torch.distributed")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    if gpu:
        figures.update(_gpu_facts())
    if grouped:
        figures["allreduce_seconds"] = _small_all_reduce(dist)
    if level != "full":
        return figures
    import torch

    on_gpu = gpu and torch.cuda.is_available()
    figures["compute"], figures["compute_unit"] = _compute(torch, on_gpu)
    if grouped:
        local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // per_node
        intra = _intra_node(torch, dist, node_rank, nodes, per_node, on_gpu)
        if intra is not None and local == 0:
            figures["intra_gbps"] = intra
        figures["pair_gbps"] = _pairs(torch, dist, node_rank, local, nodes, per_node, on_gpu)
    if on_gpu and int(os.environ["LOCAL_RANK"]) == 0 and shutil.which("dcgmi"):
        figures["dcgm"] = _dcgm()
    return figures


def _gpu_facts() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpus": 0, "cuda": False}
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return {"gpus": torch.cuda.device_count(), "cuda": True, "product": torch.cuda.get_device_name(device),
            "free_share": free / total if total else None}


def _device(torch: Any, on_gpu: bool) -> Any:
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")


def _small_all_reduce(dist: Any) -> float:
    import torch

    on_gpu = "nccl" in str(dist.get_backend())  # a GPU pool's group is "cpu:gloo,cuda:nccl"
    one = torch.ones(1, device=_device(torch, on_gpu))
    started = time.perf_counter()
    dist.all_reduce(one)
    if on_gpu:
        torch.cuda.synchronize()
    if int(one.item()) != dist.get_world_size():
        raise RuntimeError(f"the preflight all-reduce summed to {one.item()}, not {dist.get_world_size()}")
    return time.perf_counter() - started


def _compute(torch: Any, on_gpu: bool) -> tuple[float, str]:
    """Matmul throughput for COMPUTE_SECONDS of this rank's time: TFLOPS on GPU, GFLOPS on CPU."""
    size = GPU_MATRIX if on_gpu else CPU_MATRIX
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(size, size, device=_device(torch, on_gpu), dtype=dtype)
    b = torch.randn(size, size, device=_device(torch, on_gpu), dtype=dtype)
    a @ b  # warm: kernels chosen, memory touched
    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)  # a rank per core: ranks of a node oversubscribing its cores measure the scheduler
    done, started = 0, time.perf_counter()
    while True:
        a @ b
        done += 1
        if on_gpu:
            torch.cuda.synchronize()
        if time.perf_counter() - started >= COMPUTE_SECONDS:
            break
    flops = 2 * size ** 3 * done / (time.perf_counter() - started)
    torch.set_num_threads(threads)
    return (flops / 1e12, "TFLOPS") if on_gpu else (flops / 1e9, "GFLOPS")


def _timed_all_reduce(torch: Any, dist: Any, group: Any, on_gpu: bool) -> float:
    """GB/s of an all-reduce over `group` (its bus bandwidth: algbw x 2(n-1)/n, as nccl-tests)."""
    nbytes = GPU_BYTES if on_gpu else CPU_BYTES
    data = torch.ones(nbytes // 4, device=_device(torch, on_gpu))
    dist.all_reduce(data, group=group)
    if on_gpu:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(ROUNDS):
        dist.all_reduce(data, group=group)
    if on_gpu:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / ROUNDS
    n = dist.get_world_size(group)
    return nbytes * 2 * (n - 1) / n / seconds / 1e9


def _intra_node(torch: Any, dist: Any, node_rank: int, nodes: int, per_node: int, on_gpu: bool) -> float | None:
    """Every node's ranks all-reduce among themselves, all nodes at once."""
    if per_node < 2:
        return None
    groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]  # every rank makes each
    try:
        return _timed_all_reduce(torch, dist, groups[node_rank], on_gpu)
    finally:
        _destroy(dist, groups)


def _destroy(dist: Any, groups: Any) -> None:
    """The probe's own groups end with it: the user's code finds only the pool's group."""
    dist.barrier()
    for group in groups:
        if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


def pair_rounds(nodes: int) -> list[list[tuple[int, int]]]:
    """Every pair of nodes once, in rounds of disjoint pairs (the circle method): a round's pairs
    run at once, so every node is busy in every round (but one, when their number is odd)."""
    seats = list(range(nodes)) + ([-1] if nodes % 2 else [])  # -1: the seat of the node that rests
    rounds = []
    for _ in range(len(seats) - 1):
        pairs = [(seats[i], seats[-1 - i]) for i in range(len(seats) // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if a >= 0 and b >= 0])
        seats = [seats[0], seats[-1], *seats[1:-1]]
    return rounds


def _pairs(torch: Any, dist: Any, node_rank: int, local: int, nodes: int, per_node: int,
           on_gpu: bool) -> dict[int, float]:
    """Between each pair of nodes, their first ranks all-reduce; what this node saw with each other."""
    seen: dict[int, float] = {}
    for pairs in pair_rounds(nodes):
        groups = {p: dist.new_group([p[0] * per_node, p[1] * per_node]) for p in pairs}  # every rank makes each
        mine = next((p for p in pairs if node_rank in p), None)
        if mine is not None and local == 0:
            seen[mine[1] if mine[0] == node_rank else mine[0]] = _timed_all_reduce(torch, dist, groups[mine], on_gpu)
        _destroy(dist, groups.values())  # one round at a time: a round's links are measured without the next's
    return seen


def _dcgm() -> str:
    """DCGM's quick diagnostic (`dcgmi diag -r 1`, about 30 s): "pass", or what it said."""
    try:
        done = subprocess.run(["dcgmi", "diag", "-r", "1"], capture_output=True, text=True, timeout=DCGM_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"dcgmi diag -r 1 did not finish: {exc}"
    failed = [line.strip() for line in done.stdout.splitlines() if "Fail" in line]
    if done.returncode != 0 or failed:
        return "dcgmi diag -r 1: " + ("; ".join(failed) or done.stderr.strip() or f"exit {done.returncode}")
    return "pass"
