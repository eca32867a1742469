"""skytasks' Prefect blocks. `prefect block register -m blocks` registers GPU Pool."""

from blocks.gpu_pool import GPUPool

__all__ = ["GPUPool"]
