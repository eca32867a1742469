"""Example: a tiny character-level GPT trained with DDP on a 2-node local pool.

After PyTorch's minGPT-DDP example, shrunk to run on 2 CPU cores in about a minute: it learns
Shakespeare's sonnets (public domain, shipped in flows/data/). Every rank runs ordinary DDP
code; skytasks sets up the process group and hands back each rank's metrics.

    python flows/ddp_train.py            # 2 local nodes, Prefect's embedded default server

Deployed (deployments/), its `pool` parameter is a GPU Pool block: the deployment's custom run form
in Prefect's UI offers a picker of the saved pools.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from pydantic import ValidatorFunctionWrapHandler, WrapValidator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install needed

from skytasks import Checkpointer, GPUPool, distributed_task, rank_info, report, stdout  # noqa: E402

TEXT_PATH = Path(__file__).resolve().parent / "data" / "sonnets.txt"

# Elastic: it runs on 2 nodes, and goes on with 1 if a node is lost or preempted (min_nodes).
pool = GPUPool(provider="local", nodes=2, min_nodes=1)


def build_model(vocab_size: int, block_size: int, n_embd: int = 64, n_head: int = 4, n_layer: int = 2):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
            self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
            mask = torch.triu(torch.ones(block_size, block_size, dtype=torch.bool), diagonal=1)
            self.register_buffer("mask", mask, persistent=False)

        def forward(self, x):
            t = x.size(1)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=self.mask[:t, :t], need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(vocab_size, n_embd)
            self.pos = nn.Parameter(torch.zeros(1, block_size, n_embd))
            self.blocks = nn.Sequential(*[Block() for _ in range(n_layer)])
            self.ln = nn.LayerNorm(n_embd)
            self.head = nn.Linear(n_embd, vocab_size)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[:, : idx.size(1)]
            return self.head(self.ln(self.blocks(x)))

    return TinyGPT()


@distributed_task(pool=pool, name="train", retries=1)  # a failed attempt resumes from its checkpoint
@stdout(only="head")
def train(text: str, epochs: int = 10, batch_size: int = 32, block_size: int = 48, samples: int = 1536,
          lr: float = 3e-3, checkpoint_dir: str = "checkpoints", run_id: str = "local",
          fail_once_at_epoch: int | None = None) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.set_num_threads(1)  # ranks share the machine's cores
    info = rank_info()
    device = torch.device(info.device)  # cuda:<i> when this rank has a GPU, else cpu
    torch.manual_seed(0)  # same init everywhere; DDP also broadcasts rank 0's weights

    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, len(data) - block_size - 1, (samples,), generator=g)
    xs = torch.stack([data[s : s + block_size] for s in starts])
    ys = torch.stack([data[s + 1 : s + block_size + 1] for s in starts])
    dataset = TensorDataset(xs, ys)
    sampler = DistributedSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    model = build_model(len(chars), block_size).to(device)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # Every epoch is checkpointed; a retried attempt goes on from the epoch after the newest one.
    ckpt = Checkpointer(Path(checkpoint_dir, "runs", run_id), keep=2)
    found = ckpt.load_latest()
    first_epoch, epoch_losses = 0, []
    if found is not None:
        done, state = found
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first_epoch, epoch_losses = done + 1, state["epoch_losses"]
        print(f"attempt {info.attempt}: resuming after epoch {done + 1} from its checkpoint, on {info.world_size} ranks")
    steps, seen, started = 0, 0, time.perf_counter()
    for epoch in range(first_epoch, epochs):
        sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += torch.stack([loss.detach() * len(x), torch.tensor(float(len(x)), device=device)])
            steps, seen = steps + 1, seen + len(x)
        dist.all_reduce(total)  # the mean loss over every rank's samples
        epoch_losses.append(round((total[0] / total[1]).item(), 4))
        print(f"epoch {epoch + 1}/{epochs}  loss {epoch_losses[-1]:.3f}  ({info.world_size} ranks, {device})")
        report(epoch=epoch + 1, epochs=epochs, loss=epoch_losses[-1])  # live metrics artifact (head only)
        state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch_losses": epoch_losses}
        ckpt.save(state, epoch)
        dist.barrier()  # the head's checkpoint of this epoch is complete before anyone goes on
        # A node of the pool has a preemption notice (spot, SLURM): end this attempt now, with this
        # epoch saved; the retry resumes on the nodes that are left, at the epoch after it.
        ckpt.save_if_preempted(state, epoch)
        if info.attempt == 1 and epoch + 1 == fail_once_at_epoch and info.rank == info.world_size - 1:
            raise RuntimeError(f"a failure on purpose after epoch {epoch + 1} (fail_once_at_epoch)")

    checkpoint = None
    if info.is_head:
        os.makedirs(checkpoint_dir, exist_ok=True)
        checkpoint = str(Path(checkpoint_dir, "tiny_gpt.pt").resolve())
        state = {k: v.cpu() for k, v in model.module.state_dict().items()}
        torch.save({"model": state, "chars": chars, "epoch_losses": epoch_losses}, checkpoint)
        print(f"saved {checkpoint}")
    dist.barrier()
    elapsed = time.perf_counter() - started
    return {
        "rank": info.rank,
        "node": info.node_rank,
        "device": info.device,
        "attempt": info.attempt,
        "world_size": info.world_size,
        "first_epoch": first_epoch + 1,
        "epoch_losses": epoch_losses,
        "steps": steps,
        "samples": seen,
        "seconds": round(elapsed, 2),
        "steps_per_second": round(steps / elapsed, 2),
        "param_checksum": round(sum(p.detach().double().sum().item() for p in model.parameters()), 6),
        "checkpoint": checkpoint,
    }


def summarize(results: list[dict]) -> str:
    lines = [f"{'rank':>4} {'node':>4} {'device':>7} {'steps':>5} {'samples':>7} {'steps/s':>7}  first→last loss      checkpoint"]
    for r in results:
        losses = r["epoch_losses"]
        lines.append(
            f"{r['rank']:>4} {r['node']:>4} {r.get('device', 'cpu'):>7} {r['steps']:>5} {r['samples']:>7} {r['steps_per_second']:>7}  "
            f"{losses[0]:.3f} → {losses[-1]:.3f}      {r['checkpoint'] or '-'}"
        )
    return "\n".join(lines)


def _or_a_saved_pools_name(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """From Python a saved pool's name still works (`ddp_train(pool="my-pool")`), and finds the pool
    a `with pool:` around the call keeps up; the run form's schema stays that of a GPU Pool block."""
    return value if isinstance(value, str) else handler(value)


# A GPU Pool block parameter: Prefect's custom run form shows a picker of the saved GPU Pools (and
# an "Add" button), and sends the one picked as a reference that the flow run loads.
SavedPool = Annotated[GPUPool | None, WrapValidator(_or_a_saved_pools_name)]


@flow(name="ddp-train", log_prints=True)
def ddp_train(epochs: int = 10, nodes: int = 2, samples: int = 1536, fail_once_at_epoch: int | None = None,
              pool: SavedPool = None, checkpoint_dir: str = "checkpoints") -> list[dict]:
    """`pool`: a saved GPU Pool to train on (its own nodes); None: a local pool of `nodes`."""
    from prefect.runtime import flow_run

    text = TEXT_PATH.read_text()
    task = train.with_options(pool=pool) if pool is not None else train.with_options(nodes=nodes)
    results = task(text, epochs=epochs, samples=samples, run_id=flow_run.get_id(), checkpoint_dir=checkpoint_dir,
                   fail_once_at_epoch=fail_once_at_epoch)
    losses = results[0]["epoch_losses"]
    get_run_logger().info("per-rank summary:\n%s", summarize(results))
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"the loss did not fall: {losses}")
    if math.isnan(losses[-1]):
        raise RuntimeError("the loss is NaN")
    return results


if __name__ == "__main__":
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Small settings for quick checks (the tests use them); the defaults train for about a minute.
    out = ddp_train(
        epochs=int(os.environ.get("SKYTASKS_EXAMPLE_EPOCHS", 10)),
        samples=int(os.environ.get("SKYTASKS_EXAMPLE_SAMPLES", 1536)),
    )
    # The per-rank table is in the flow's logs (above, and in the UI); one line here.
    print(f"\nskytasks ddp_train: {len(out)} rank(s), loss {out[0]['epoch_losses'][0]:.3f} → "
          f"{out[0]['epoch_losses'][-1]:.3f} on {', '.join(sorted({r['device'] for r in out}))}")
