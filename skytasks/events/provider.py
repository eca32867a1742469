"""What a provider says of its nodes: a note, how many are up, a teardown it could not confirm."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from skytasks.events.event import Event


@dataclass(frozen=True)
class ProviderNote(Event):
    """A provider's word on its nodes (a launch short of capacity, a job's output line, ...)."""

    pool: str
    provider: str
    message: str
    level: int = logging.INFO

    def text(self) -> str:
        return self.message


@dataclass(frozen=True)
class ProviderProgress(Event):
    """Nodes coming up: `ready` of `total`, and what the rest are doing."""

    TEXT = "{pool}: {ready}/{total} nodes ready - {detail}"
    pool: str
    provider: str
    ready: int
    total: int
    detail: str


@dataclass(frozen=True)
class TeardownFailed(Event, level=logging.ERROR, prefect="skytasks.pool.teardown-failed",
                     payload=("provider", "pool_id", "resources", "detail")):
    pool: str
    provider: str
    pool_id: str
    resources: tuple[str, ...]
    detail: str

    def text(self) -> str:
        return (f"{self.pool_id}: teardown could not confirm these gone: {', '.join(self.resources) or '(unknown)'} "
                f"({self.detail}); `skytasks gc` finds them by their tags or job name")

    def payload(self) -> dict[str, Any]:
        return {"provider": self.provider, "pool_id": self.pool_id, "resources": list(self.resources),
                "detail": self.detail}


def level_of(event: Event) -> int:
    """An event's log level (a provider's note carries its own)."""
    return event.level if isinstance(event, ProviderNote) else event.LEVEL
