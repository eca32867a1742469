"""Sharded checkpoints, side by side in one run on a 2 x 2 local pool (FSDP2, gloo on CPU):

- how long an async `save` holds the training loop, against a synchronous save of the same state;
- how long `restore` takes (4 ranks' shards into 4 fresh ranks);
- a training loop's throughput with an async save every N steps, against none.

    .venv/bin/python benchmarks/sharded_checkpoint.py [--quick]

Prints the figures and merges them into benchmarks/results.json under "sharded_checkpoint".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from skytasks import GPUPool, distributed_task  # noqa: E402


def build(width: int, depth: int):
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def step(model, opt, width: int) -> None:
    import torch

    model(torch.randn(16, width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def measure(root: str, width: int, depth: int, repeats: int, steps: int, every: int) -> dict:
    import torch.distributed as dist

    from skytasks import Checkpointer

    model, opt = build(width, depth)
    step(model, opt, width)  # Adam's moments exist: the state is 3x the parameters
    state = {"model": model, "optim": opt}
    sync, blocked, total = [], [], []
    for i in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        Checkpointer(f"{root}/sync", async_save=False).save(state, i)
        sync.append(time.perf_counter() - started)
        dist.barrier()
        ckpt = Checkpointer(f"{root}/async")
        started = time.perf_counter()
        ckpt.save(state, i)
        blocked.append(time.perf_counter() - started)
        ckpt.wait()
        total.append(time.perf_counter() - started)
    restores = []
    for _ in range(repeats):
        fresh, fresh_opt = build(width, depth)
        dist.barrier()
        started = time.perf_counter()
        Checkpointer(f"{root}/async").restore({"model": fresh, "optim": fresh_opt})
        restores.append(time.perf_counter() - started)

    def loop(saving: bool) -> float:
        ckpt = Checkpointer(f"{root}/loop")
        dist.barrier()
        started = time.perf_counter()
        for s in range(steps):
            step(model, opt, width)
            if saving and (s + 1) % every == 0:
                ckpt.save(state, s)
        ckpt.wait()
        dist.barrier()
        return steps / (time.perf_counter() - started)

    loop(False)  # warm-up: the first steps allocate what the later ones reuse
    # Interleaved, medians: on a shared machine what else runs drifts over a run.
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for saving in (False, True):
            rates[saving].append(loop(saving))
    plain_rate, saving_rate = statistics.median(rates[False]), statistics.median(rates[True])
    params = sum(p.numel() for p in model.parameters())
    return {
        "state_mb": round(params * 4 * 3 / 1e6, 1),  # parameters and Adam's two moments, fp32
        "sync_save_s": round(statistics.median(sync), 3),
        "async_blocked_s": round(statistics.median(blocked), 3),
        "async_committed_s": round(statistics.median(total), 3),
        "blocked_over_sync": round(statistics.median(blocked) / statistics.median(sync), 3),
        "restore_s": round(statistics.median(restores), 3),
        "steps_per_s_no_saves": round(plain_rate, 2),
        "steps_per_s_save_every_n": round(saving_rate, 2),
        "save_every": every,
        "throughput_kept": round(saving_rate / plain_rate, 3),
    }


def sharded_checkpoint(quick: bool) -> dict:
    width, depth = (1024, 4) if quick else (1536, 8)
    repeats, steps, every = (2, 20, 5) if quick else (3, 40, 10)
    with tempfile.TemporaryDirectory() as root:
        task = distributed_task(measure, pool=GPUPool(nodes=2, procs_per_node=2), name="sharded-checkpoint-bench")
        figures = task(root, width, depth, repeats, steps, every)[0]
    return {"ranks": 4, "device": "cpu (gloo)", **figures}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer repeats")
    args = parser.parse_args()
    f = sharded_checkpoint(args.quick)
    print(f"\nsharded checkpoints, FSDP2 on 2 nodes x 2 ranks (CPU, gloo), {f['state_mb']} MB of state:")
    print(f"   synchronous save {f['sync_save_s']:.3f}s   async save blocks {f['async_blocked_s']:.3f}s "
          f"({f['blocked_over_sync']:.2f}x), committed after {f['async_committed_s']:.3f}s   restore {f['restore_s']:.3f}s")
    print(f"   training {f['steps_per_s_no_saves']:.2f} steps/s without saves, {f['steps_per_s_save_every_n']:.2f} with "
          f"an async save every {f['save_every']} ({f['throughput_kept']:.0%})")
    out = HERE / "results.json"
    merged = json.loads(out.read_text()) if out.exists() else {}
    out.write_text(json.dumps({**merged, "sharded_checkpoint": f}, indent=2))
    print(f"updated {out}")


if __name__ == "__main__":
    main()
