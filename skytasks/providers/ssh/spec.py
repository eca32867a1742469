"""provider="ssh": its settings (`SSHSettings`: the hosts and how to log in), their validation, and its
frozen part of the spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from skytasks.providers.remote_fields import (KnownHosts, PipPackages, ReadyTimeout, RemotePython, SSHPrivateKey,
                                              SSHUser, host_field, one_choice)

class SSHSettings(BaseModel):
    """ssh: machines you already have, reached over SSH."""

    model_config = ConfigDict(title="ssh", extra="forbid")

    provider: Annotated[Literal["ssh"], one_choice("ssh")] = Field("ssh", description="The provider these settings are for.")
    hosts: list[str] = Field(default_factory=list, description='"[user@]host[:port]" per node, head first.')
    ssh_user: SSHUser = None
    ssh_private_key: SSHPrivateKey = None
    known_hosts: KnownHosts = None
    remote_python: RemotePython = None
    pip_packages: PipPackages = Field(default_factory=list)
    ready_timeout_seconds: ReadyTimeout = 900

    @field_validator("hosts")
    @classmethod
    def _hosts_are_well_formed(cls, hosts: list[str]) -> list[str]:
        return [host_field("hosts", h) for h in hosts]


READS = tuple(name for name in SSHSettings.model_fields if name != "provider")  # the fields, named once


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


def build(fields: Mapping[str, Any]) -> SSHSpec:
    hosts = fields["hosts"]
    if not hosts:
        raise ValueError("hosts: provider='ssh' needs one host per node, head first")
    if len(hosts) != fields["nodes"]:
        raise ValueError(f"hosts: {len(hosts)} host(s) given for nodes={fields['nodes']}; give one per node")
    return SSHSpec(hosts=tuple(hosts), ssh_user=fields["ssh_user"], ssh_private_key=fields["ssh_private_key"],
                   known_hosts=fields["known_hosts"], remote_python=fields["remote_python"],
                   pip_packages=tuple(fields["pip_packages"]), ready_timeout_seconds=fields["ready_timeout_seconds"])
