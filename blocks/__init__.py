"""skytasks' Prefect blocks, installed as `skytasks.blocks`: `prefect block register -m skytasks.blocks`."""

from skytasks.blocks.gpu_pool import GPUPool

__all__ = ["GPUPool"]
