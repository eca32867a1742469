"""skytasks' Prefect blocks, installed as `skytasks.blocks`: `prefect block register -m skytasks.blocks`.

A pool's provider settings (`GPUPool(settings=SSHSettings(hosts=[...]))`, or as shorthand the flat
keywords `GPUPool(provider="ssh", hosts=[...])`) are pydantic models, not blocks of their own."""

from skytasks.blocks.gpu_pool import GPUPool
from skytasks.providers.local.spec import LocalSettings
from skytasks.providers.aws.spec import AWSSettings
from skytasks.providers.kubernetes.spec import KubernetesSettings
from skytasks.providers.slurm.spec import SlurmSettings
from skytasks.providers.ssh.spec import SSHSettings

__all__ = ["GPUPool", "LocalSettings", "SSHSettings", "AWSSettings", "SlurmSettings", "KubernetesSettings"]
