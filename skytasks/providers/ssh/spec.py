"""provider="ssh": its settings (`SSHSettings`: the hosts and how to log in), their validation; the
model is also its part of the spec (skytasks/providers/settings_model.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import ConfigDict, Field, field_validator

from skytasks.providers.remote_fields import (KnownHosts, PipPackages, ReadyTimeout, RemotePython, SSHPrivateKey,
                                              SSHUser, host_field)
from skytasks.providers.settings_model import ProviderSettingsModel, ProviderTag

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec


class SSHSettings(ProviderSettingsModel):
    """ssh: machines you already have, reached over SSH."""

    model_config = ConfigDict(title="ssh")

    provider: ProviderTag[Literal["ssh"]] = "ssh"
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

    def check_pool(self, pool: PoolSpec) -> None:
        if not self.hosts:
            raise ValueError("hosts: provider='ssh' needs one host per node, head first")
        if len(self.hosts) != pool.nodes:
            raise ValueError(f"hosts: {len(self.hosts)} host(s) given for nodes={pool.nodes}; give one per node")


SSHSpec = SSHSettings  # (its old name: the settings are the spec)
