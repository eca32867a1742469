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
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    return _steps_per_second(model, torch.randn(64, 256), steps, warmup, sync=lambda: None)


def ddp_gpu_steps_per_second(steps: int = 300, warmup: int = 20) -> float:
    """The same measure on this rank's GPU (the GPU check, benchmarks/gpu_check.py): a wider MLP,
    so that a step is GPU work and not only launch overhead; synchronised before the clock stops."""
    import os

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)).cuda()
    return _steps_per_second(DDP(net, device_ids=[local]), torch.randn(256, 2048, device="cuda"), steps, warmup,
                             sync=torch.cuda.synchronize)


def _steps_per_second(model, x, steps: int, warmup: int, sync) -> float:
    import torch
    import torch.distributed as dist

    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            dist.barrier()
            started = time.perf_counter()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sync()
    dist.barrier()
    return steps / (time.perf_counter() - started)


def started_at() -> float:
    return time.time()


def payload_size(data) -> int:
    return len(data)
