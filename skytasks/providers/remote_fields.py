"""The block fields that more than one provider reads: how to log in to a node, which Python runs
there, and how long a node may take to come up or sit idle. Each provider's `reads` says which
of them it takes; set on a pool whose provider does not, one is a PoolConfigError naming it."""

from __future__ import annotations

import re
from typing import Optional

from pydantic import BaseModel, Field, SecretStr

HOST_PATTERN = re.compile(r"^(?:(?P<user>[A-Za-z0-9._-]+)@)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(?P<port>\d{1,5}))?$")


class RemoteFields(BaseModel):
    ssh_user: Optional[str] = None
    ssh_private_key: Optional[SecretStr] = Field(None, description="Private key (PEM/OpenSSH text) for ssh and aws.")
    known_hosts: Optional[str] = Field(None, description="known_hosts text or path; host keys are always checked.")
    remote_python: Optional[str] = Field(
        None, description='Python on the nodes: ssh default "python3"; aws default the venv its bootstrap builds.')
    pip_packages: list[str] = Field(default_factory=list, description="Extra packages installed on launched nodes.")
    ready_timeout_seconds: float = Field(900, gt=0)
    idle_minutes: float = Field(15, gt=0)
    max_lifetime_minutes: float = Field(720, gt=0)


def host_field(field: str, text: str) -> str:
    """`[user@]host[:port]`, stripped, or a ValueError naming the field."""
    m = HOST_PATTERN.match(text.strip())
    if not m or (m["port"] and not 0 < int(m["port"]) < 65536):
        raise ValueError(f"{field}: {text!r} is not of the form [user@]host[:port]")
    return text.strip()
