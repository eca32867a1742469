"""What a pool is, frozen: the typed configuration providers and the runtime are built from.

`GPUPool` (the Prefect block) validates its fields once and gives a `PoolSpec`; nothing behind it
reads the block. Each provider gets the common part and its own part (`ssh`, `aws` or `slurm`),
never another provider's fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pydantic import SecretStr


@dataclass(frozen=True)
class SSHSpec:
    """provider="ssh": machines you already have."""

    hosts: tuple[str, ...]
    ssh_user: Optional[str]
    ssh_private_key: Optional[SecretStr]
    known_hosts: Optional[str]
    remote_python: Optional[str]
    pip_packages: tuple[str, ...]
    ready_timeout_seconds: float


@dataclass(frozen=True)
class AWSSpec:
    """provider="aws": what is launched, how it is reached, and when it ends itself."""

    credentials: Any  # a prefect_aws.AwsCredentials block: it makes the boto3 clients
    accelerator: Optional[str]
    accelerators_per_node: Optional[int]
    instance_type: Optional[str]
    image_id: Optional[str]
    subnet_id: Optional[str]
    security_group_ids: tuple[str, ...]
    key_name: Optional[str]
    spot: bool
    root_volume_gb: int
    iam_instance_profile: Optional[str]
    tags: Mapping[str, str]
    ssh_ingress_cidr: Optional[str]
    ssh_user: Optional[str]
    ssh_private_key: Optional[SecretStr]
    remote_python: Optional[str]
    pip_packages: tuple[str, ...]
    torch_version: str
    torch_cuda: str
    torchvision: Optional[str]
    torchaudio: Optional[str]
    ready_timeout_seconds: float
    idle_minutes: float
    max_lifetime_minutes: float


@dataclass(frozen=True)
class SlurmSpec:
    """provider="slurm": what the allocation asks for, where SLURM's commands run, and when it ends."""

    login: Optional[str]  # "[user@]host[:port]" of a login node; None: SLURM's commands run here
    ssh_user: Optional[str]
    ssh_private_key: Optional[SecretStr]
    known_hosts: Optional[str]
    remote_python: Optional[str]
    partition: Optional[str]
    account: Optional[str]
    qos: Optional[str]
    constraint: Optional[str]
    gres: Optional[str]  # already defaulted from the accelerator
    extra_args: tuple[str, ...]
    ready_timeout_seconds: float
    idle_minutes: float
    max_lifetime_minutes: float


_PARTS = ("ssh", "aws", "slurm")  # the providers with a part of their own


@dataclass(frozen=True)
class PoolSpec:
    name: str  # the saved block's name, or "<provider>-pool": tags and events
    provider: str  # a name of skytasks.providers.PROVIDERS (the block checks it)
    nodes: int  # the most nodes the pool asks for
    procs_per_node: int
    accelerators_per_node: Optional[int]
    env: Mapping[str, str] = field(default_factory=dict)  # every rank's environment (AWS variables included)
    ssh: Optional[SSHSpec] = None
    aws: Optional[AWSSpec] = None
    slurm: Optional[SlurmSpec] = None
    # The fewest nodes the pool runs on (elastic when below `nodes`): it starts with what it can
    # get between the two, a retry goes on with what is left, and it grows back between calls.
    min_nodes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.min_nodes is None:
            object.__setattr__(self, "min_nodes", self.nodes)
        if not 1 <= self.min_nodes <= self.nodes:  # type: ignore[operator]
            raise ValueError(f"min_nodes: must be between 1 and nodes={self.nodes}, got {self.min_nodes}")
        wanted = self.provider if self.provider in _PARTS else None
        for part in _PARTS:
            if (getattr(self, part) is not None) != (part == wanted):
                raise ValueError(f"provider={self.provider!r}: the {part} part must be "
                                 f"{'set' if part == wanted else 'absent'}")

    @property
    def elastic(self) -> bool:
        return self.min_nodes != self.nodes

    @property
    def node_count(self) -> str:
        """The count as people read it: "2", or "2-4" for an elastic pool."""
        return f"{self.min_nodes}-{self.nodes}" if self.elastic else str(self.nodes)
