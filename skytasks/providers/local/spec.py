"""provider="local": the one field it reads beyond the pool's shape, and its frozen part of the spec.

`ready_timeout_seconds`: local processes start in milliseconds, so it bounds only how long a
process waits in line for a warm pool that another process holds (skytasks.controller.warm)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

READS = ("ready_timeout_seconds",)


@dataclass(frozen=True)
class LocalSpec:
    """provider="local": processes of this machine."""

    ready_timeout_seconds: float


def build(fields: Mapping[str, Any]) -> LocalSpec:
    return LocalSpec(ready_timeout_seconds=float(fields["ready_timeout_seconds"]))
