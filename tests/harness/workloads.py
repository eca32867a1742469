"""Users' training code, unchanged, that the tests and `benchmarks/gpu_check.py` run on real
ranks (a Lightning Trainer, a Hugging Face Trainer), and what the sharded checkpoint tests
compare. They travel to the ranks by value (skytasks ships the project's own modules), so
nothing here needs to be importable on a node."""

from __future__ import annotations

import os

SLURM_VARIABLES = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
                   "SLURM_NNODES", "SLURM_GTIDS")


def resume(ckpt_dir: str) -> tuple:
    """A rank's `Checkpointer` on `ckpt_dir`, the newest checkpoint it finds ((step, state), or
    None), and the step to go on from."""
    from skytasks.checkpoint import Checkpointer

    ckpt = Checkpointer(ckpt_dir)
    found = ckpt.load_latest()
    return ckpt, found, 0 if found is None else found[0] + 1


def regression_module() -> type:
    """A LightningModule as users write one: a linear layer, MSE, SGD. A function, so that a
    torchrun script can carry its source (`inspect.getsource`) and lightning is imported only
    where it runs."""
    import lightning as L
    import torch

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regression


def lightning_fit(root: str, devices: int = 1, num_nodes: int = 2) -> dict:
    """A Lightning Trainer with DDP on `num_nodes` nodes of `devices` processes each: where it
    thinks it runs (its cluster environment, ranks, the SLURM variables it was given) and the
    weights it trained."""
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(int(os.environ["RANK"]))  # different data per rank: only DDP keeps weights equal
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=devices, num_nodes=num_nodes, max_epochs=2,
                        default_root_dir=root, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = regression_module()()
    trainer.fit(model, DataLoader(data, batch_size=16))
    env = trainer.strategy.cluster_environment
    return dict(env=type(env).__name__, global_rank=trainer.global_rank, world_size=trainer.world_size,
                node_rank=trainer.node_rank, local_rank=trainer.local_rank,
                weights=[round(v, 6) for v in model.layer.weight.detach().flatten().tolist()],
                slurm={k: os.environ.get(k) for k in SLURM_VARIABLES})


def hf_train(steps: int, use_cpu: bool = True) -> dict:
    """A Hugging Face Trainer on a tiny BERT made from its config (no download), `steps` steps:
    its world, rank and device, the loss, and a sum of its first weights."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=2))
    data = [{"input_ids": torch.randint(0, 100, (16,)), "labels": torch.tensor(i % 2)} for i in range(64)]
    args = TrainingArguments(output_dir="/tmp/skytasks-hf", per_device_train_batch_size=4, max_steps=steps,
                             report_to=[], logging_steps=1, save_strategy="no", use_cpu=use_cpu)
    out = Trainer(model=model, args=args, train_dataset=data).train()
    first = next(model.parameters())
    return {"world": args.world_size, "rank": args.process_index, "device": str(args.device),
            "loss": round(out.training_loss, 4), "weights": round(float(first.detach().sum()), 5),
            "param_device": str(first.device), "forked": os.environ.get("SKYTASKS_CTRL_FD") == "3"}


def whole(model, opt) -> dict:
    """Every parameter and every Adam moment, gathered whole (the same on every rank)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    out = {f"param {k}": v.full_tensor().clone() for k, v in model.state_dict().items()}
    for fqn, moments in get_optimizer_state_dict(model, opt)["state"].items():
        for name, value in moments.items():
            out[f"{name} {fqn}"] = value.full_tensor().clone() if hasattr(value, "full_tensor") else value.clone()
    return out
