"""provider="slurm": its settings (`SlurmSettings`: what the allocation asks for, where SLURM's
commands run), their validation, and its frozen part of the spec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from skytasks.providers.remote_fields import (IdleMinutes, KnownHosts, MaxLifetime, OptionalStr, ReadyTimeout,
                                              RemotePython, SSHPrivateKey, SSHUser, host_field, one_choice)

class SlurmSettings(BaseModel):
    """slurm: the nodes of a SLURM allocation the pool requests and cancels."""

    model_config = ConfigDict(title="slurm", extra="forbid")

    provider: Annotated[Literal["slurm"], one_choice("slurm")] = Field(
        "slurm", description="The provider these settings are for.")
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


READS = tuple(name for name in SlurmSettings.model_fields if name != "provider")  # the fields, named once


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
    max_lifetime_minutes: Optional[float]  # None: no --time, the partition's limit applies


def build(fields: Mapping[str, Any]) -> SlurmSpec:
    if fields["slurm_login"] and not fields["known_hosts"]:
        raise ValueError("known_hosts: slurm_login needs the login node's host key in known_hosts (text or a "
                         "path); host keys are never trusted blindly")
    gres = fields["slurm_gres"] or (f"gpu:{fields['accelerators_per_node']}" if fields["accelerator"] else None)
    return SlurmSpec(
        login=fields["slurm_login"], ssh_user=fields["ssh_user"], ssh_private_key=fields["ssh_private_key"],
        known_hosts=fields["known_hosts"], remote_python=fields["remote_python"], partition=fields["slurm_partition"],
        account=fields["slurm_account"], qos=fields["slurm_qos"], constraint=fields["slurm_constraint"], gres=gres,
        extra_args=tuple(fields["slurm_extra_args"]), ready_timeout_seconds=fields["ready_timeout_seconds"],
        idle_minutes=fields["idle_minutes"], max_lifetime_minutes=fields["max_lifetime_minutes"])
