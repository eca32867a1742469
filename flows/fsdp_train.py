"""Example: a small transformer sharded with FSDP2 on a 2 x 2 local pool, checkpointed as it trains.

The same tiny character-level GPT as `ddp_train.py`, but every block is `fully_shard`ed over the
pool's 4 ranks (gloo on CPU; NCCL on GPUs), so each rank holds a quarter of every weight and of
the optimizer's state. Every `save_every` steps each rank saves its own shards with `Checkpointer`
(in the background: training goes on while they are written); a preemption notice saves at once.
An attempt that starts over (a lost node, a preemption, a retry) restores the newest committed
checkpoint, resharded to however many ranks it has now, and goes on from the step after it.

    python flows/fsdp_train.py           # 2 local nodes x 2 ranks, Prefect's embedded default server
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from prefect import flow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install needed

from flows.ddp_train import TEXT_PATH, build_model  # noqa: E402
from skytasks import Checkpointer, GPUPool, distributed_task, rank_info, report  # noqa: E402

# 2 nodes x 2 ranks; elastic: it goes on with 1 node if one is lost or preempted.
pool = GPUPool(provider="local", nodes=2, procs_per_node=2, min_nodes=1)
BLOCK = 32


def shard(model: Any) -> None:
    """FSDP2 over every rank: each block its own unit, then the rest."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    info = rank_info()
    mesh = init_device_mesh("cuda" if info.device.startswith("cuda") else "cpu", (info.world_size,))
    if info.device.startswith("cuda"):
        model.to(torch.device(info.device))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def batch(data: Any, step: int, rank: int, size: int = 8) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    starts = torch.randint(0, len(data) - BLOCK - 1, (size,), generator=g)
    x = torch.stack([data[s:s + BLOCK] for s in starts])
    y = torch.stack([data[s + 1:s + BLOCK + 1] for s in starts])
    return x, y


@distributed_task(pool=pool, name="fsdp-train")
def train(text: str, steps: int = 40, save_every: int = 5, checkpoint_dir: str = "checkpoints/fsdp",
          lr: float = 3e-3, disrupt: Callable[[int], None] | None = None) -> dict:
    """One rank of the training. `disrupt(step)`, if given, runs after each step (the tests lose a
    node or send a preemption notice from it)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    info = rank_info()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(0)
    model = build_model(len(chars), BLOCK)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    state: dict[str, Any] = {"model": model, "optim": opt, "losses": []}
    ckpt = Checkpointer(checkpoint_dir, keep=2)
    restored = ckpt.restore(state)  # in place, resharded to this attempt's ranks; None the first time
    start = 0 if restored is None else restored + 1
    if restored is not None:
        print(f"attempt {info.attempt}: resumed from step {restored} on {info.world_size} ranks")
    device = torch.device(info.device)
    for step in range(start, steps):
        x, y = (t.to(device) for t in batch(data, step, info.rank))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        state["losses"] = [*state["losses"], round(float(mean) / info.world_size, 5)]  # a new list: the
        report(step=step + 1, steps=steps, loss=state["losses"][-1])  # one being saved is never changed
        if disrupt is not None:
            disrupt(step)
        if (step + 1) % save_every == 0 or step == steps - 1:
            ckpt.save(state, step)  # returns once staged; the writing goes on in the background
        ckpt.save_if_preempted(state, step)  # a notice: save this step, wait for it, end the attempt
    return {"attempt": info.attempt, "world": info.world_size, "restored": restored, "start": start,
            "losses": state["losses"]}


@flow(name="fsdp-train", log_prints=True)
def fsdp_train(steps: int = 40, save_every: int = 5, checkpoint_dir: str = "checkpoints/fsdp") -> list[dict]:
    results = train(TEXT_PATH.read_text(), steps=steps, save_every=save_every, checkpoint_dir=checkpoint_dir)
    losses = results[0]["losses"]
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"the loss did not fall: {losses[0]} -> {losses[-1]}")
    return results


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    out = fsdp_train(steps=int(os.environ.get("SKYTASKS_EXAMPLE_STEPS", 40)))
    print(f"\nskytasks fsdp_train: {len(out)} rank(s), loss {out[0]['losses'][0]:.3f} -> {out[0]['losses'][-1]:.3f}")
