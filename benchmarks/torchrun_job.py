"""What a user would run under torchrun for the same work (benchmarks only)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist  # noqa: E402

import workloads  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")
    result = workloads.all_reduce_once() if sys.argv[1] == "all_reduce" else workloads.ddp_steps_per_second()
    if dist.get_rank() == 0:
        print(f"RESULT {result}", flush=True)
    dist.destroy_process_group()
