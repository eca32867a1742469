"""Workloads shared by torchrun and skytasks in the benchmarks, so both run the same code."""

from __future__ import annotations

import time


def all_reduce_once() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def ddp_steps_per_second(steps: int = 200, warmup: int = 10) -> float:
    """Steps per second of a small MLP under DDP, timed inside the rank (no startup)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            started = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.barrier()
    return steps / (time.perf_counter() - started)


def ddp_gpu_steps_per_second(steps: int = 300, warmup: int = 20) -> float:
    """The same measure on this rank's GPU (the GPU check, benchmarks/gpu_check.py): a wider MLP,
    so that a step is GPU work and not only launch overhead; synchronised before the clock stops."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = int(__import__("os").environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)).cuda()
    model = DDP(net, device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 2048, device="cuda")
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            dist.barrier()
            started = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    dist.barrier()
    return steps / (time.perf_counter() - started)


def started_at() -> float:
    return time.time()


def payload_size(data) -> int:
    return len(data)
