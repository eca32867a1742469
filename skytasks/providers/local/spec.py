"""provider="local": the one field it reads beyond the pool's shape, and its frozen part of the spec.

`ready_timeout_seconds`: local processes start in milliseconds, so it bounds only how long a
process waits in line for a warm pool that another process holds (skytasks.controller.warm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field

from skytasks.providers.remote_fields import ReadyTimeout, one_choice


class LocalSettings(BaseModel):
    """local: processes on this machine."""

    model_config = ConfigDict(title="local", extra="forbid")

    provider: Annotated[Literal["local"], one_choice("local")] = Field(
        "local", description="The provider these settings are for.")
    ready_timeout_seconds: ReadyTimeout = Field(
        900, description="Seconds a process waits in line for a warm pool another process holds.")


READS = tuple(name for name in LocalSettings.model_fields if name != "provider")  # the fields, named once


@dataclass(frozen=True)
class LocalSpec:
    """provider="local": processes of this machine."""

    ready_timeout_seconds: float


def build(fields: Mapping[str, Any]) -> LocalSpec:
    return LocalSpec(ready_timeout_seconds=float(fields["ready_timeout_seconds"]))
