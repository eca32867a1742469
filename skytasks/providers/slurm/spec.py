"""provider="slurm": its settings (`SlurmSettings`: what the allocation asks for, where SLURM's
commands run), their validation; the model is also its part of the spec
(skytasks/providers/settings_model.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional

from pydantic import ConfigDict, Field, field_validator

from skytasks.providers.remote_fields import (IdleMinutes, KnownHosts, MaxLifetime, OptionalStr, ReadyTimeout,
                                              RemotePython, SSHPrivateKey, SSHUser, host_field)
from skytasks.providers.settings_model import ProviderSettingsModel, ProviderTag

if TYPE_CHECKING:
    from skytasks.pool_spec import PoolSpec


class SlurmSettings(ProviderSettingsModel):
    """slurm: the nodes of a SLURM allocation the pool requests and cancels."""

    model_config = ConfigDict(title="slurm")

    provider: ProviderTag[Literal["slurm"]] = "slurm"
    slurm_login: OptionalStr = Field(
        None, description='"[user@]host[:port]" of a login node where SLURM commands run over SSH; empty: here.')
    slurm_partition: OptionalStr = Field(None, description="The allocation's --partition.")
    slurm_account: OptionalStr = Field(None, description="The allocation's --account.")
    slurm_qos: OptionalStr = Field(None, description="The allocation's --qos.")
    slurm_constraint: OptionalStr = Field(None, description="The allocation's --constraint.")
    slurm_gres: OptionalStr = Field(
        None, description='GPUs per node as SLURM names them ("gpu:h100:8"); empty: gpu:<accelerators_per_node>.')
    slurm_extra_args: list[str] = Field(default_factory=list, description="Further sbatch arguments, as written.")
    ssh_user: SSHUser = None
    ssh_private_key: SSHPrivateKey = None
    known_hosts: KnownHosts = None
    remote_python: RemotePython = None
    ready_timeout_seconds: ReadyTimeout = Field(900, description="Seconds the allocation may stay pending.")
    idle_minutes: IdleMinutes = 15
    max_lifetime_minutes: MaxLifetime = Field(None, description="The allocation's --time; empty: the partition's limit.")

    @field_validator("slurm_login")
    @classmethod
    def _login_is_well_formed(cls, login: Optional[str]) -> Optional[str]:
        return None if login is None else host_field("slurm_login", login)

    @field_validator("slurm_extra_args")
    @classmethod
    def _extra_args_are_options(cls, args: list[str]) -> list[str]:
        for a in args:
            if not isinstance(a, str) or not a.startswith("-"):
                raise ValueError(f"slurm_extra_args: {a!r} is not an sbatch option (each item is one argument, "
                                 "such as '--exclusive' or '--mem=64G')")
        return args

    def check_pool(self, pool: PoolSpec) -> None:
        if self.slurm_login and not self.known_hosts:
            raise ValueError("known_hosts: slurm_login needs the login node's host key in known_hosts (text or a "
                             "path); host keys are never trusted blindly")

    def gres_for(self, pool: PoolSpec) -> Optional[str]:
        """The allocation's --gres: slurm_gres as given, else one GPU per accelerator the pool's
        nodes have, else none."""
        return self.slurm_gres or (f"gpu:{pool.accelerators_per_node}" if pool.accelerator else None)


SlurmSpec = SlurmSettings  # (its old name: the settings are the spec)
