"""provider="aws": its settings (`AWSSettings`: what is launched, how it is reached, when it ends
itself), their validation; the model is also its part of the spec (skytasks/providers/settings_model.py).
The credentials stay among the pool's own fields (they are a prefect-aws block, and every provider's
ranks get them as AWS variables): the spec carries them as `PoolSpec.credentials`."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Literal, Optional

from pydantic import ConfigDict, Field, field_validator

from skytasks.providers.remote_fields import (IdleMinutes, MaxLifetime, OptionalStr, PipPackages, ReadyTimeout,
                                              RemotePython, SSHPrivateKey, SSHUser)
from skytasks.providers.settings_model import ProviderSettingsModel, ProviderTag

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec


class AWSSettings(ProviderSettingsModel):
    """aws: EC2 instances the pool launches and terminates."""

    model_config = ConfigDict(title="aws")

    provider: ProviderTag[Literal["aws"]] = "aws"
    instance_type: OptionalStr = Field(None, description="EC2 instance type; empty: follows from the accelerator.")
    image_id: OptionalStr = Field(None, description="AMI; empty: the region's Ubuntu (CPU) or Deep Learning base AMI (GPU).")
    subnet_id: OptionalStr = Field(None, description="Subnet; empty: a default subnet of the region.")
    security_group_ids: list[str] = Field(default_factory=list, description="Further security groups for the nodes.")
    key_name: OptionalStr = Field(None, description="Your own EC2 key pair (give its private key too); empty: one per pool.")
    spot: bool = Field(False, description="Spot instances (a reclaim is a preemption notice).")
    root_volume_gb: int = Field(100, ge=8, description="Root volume size in GB.")
    iam_instance_profile: OptionalStr = Field(None, description="Instance profile the nodes run with.")
    tags: dict[str, str] = Field(default_factory=dict, description="Tags on everything the pool launches.")
    ssh_ingress_cidr: OptionalStr = Field(
        None, description="Who may reach SSH on launched nodes; empty: this controller's public address.")
    ssh_user: SSHUser = None
    ssh_private_key: SSHPrivateKey = None
    remote_python: RemotePython = None
    pip_packages: PipPackages = Field(default_factory=list)
    torch_version: str = Field("latest", description='"latest", a bare version (pinned with ==) or a constraint.')
    torch_cuda: str = Field("cu128", description="CUDA wheel index suffix, used when the accelerator has CUDA.")
    torchvision: OptionalStr = Field(None, description="torchvision to install; empty: none.")
    torchaudio: OptionalStr = Field(None, description="torchaudio to install; empty: none.")
    ready_timeout_seconds: ReadyTimeout = 900
    idle_minutes: IdleMinutes = 15
    max_lifetime_minutes: MaxLifetime = None

    @field_validator("ssh_ingress_cidr")
    @classmethod
    def _cidr_is_a_network(cls, cidr: Optional[str]) -> Optional[str]:
        if cidr is not None:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                raise ValueError(f"ssh_ingress_cidr: {cidr!r} is not a network such as 203.0.113.7/32") from None
        return cidr

    def check_pool(self, pool: PoolSpec) -> None:
        if self.key_name and self.ssh_private_key is None:
            raise ValueError("ssh_private_key: key_name names your own key pair; give its private key too")


AWSSpec = AWSSettings  # (its old name: the settings are the spec)
