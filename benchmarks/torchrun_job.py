"""What a user would run under torchrun for the same work (benchmarks only)."""

import sys

import torch.distributed as dist

# Run by torchrun as a script: its own folder (benchmarks/) is first on sys.path.
import workloads

if __name__ == "__main__":
    kind = sys.argv[1]
    dist.init_process_group("nccl" if kind == "ddp_gpu" else "gloo")
    result = {"all_reduce": workloads.all_reduce_once, "ddp": workloads.ddp_steps_per_second,
              "ddp_gpu": workloads.ddp_gpu_steps_per_second}[kind]()
    if dist.get_rank() == 0:
        print(f"RESULT {result}", flush=True)
    dist.destroy_process_group()
