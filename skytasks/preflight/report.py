"""What a preflight found, as events: said on the console and the run's log, and in Prefect as
events (`skytasks.node.unhealthy`, `skytasks.pool.healthy`) and a table artifact of the flow run."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from skytasks.events import Event
from skytasks.preflight.rules import measured


@dataclass(frozen=True)
class NodeUnhealthy(Event):
    """A node failed a check before any user code ran on it."""

    LEVEL = logging.WARNING
    PREFECT_EVENT = "skytasks.node.unhealthy"
    PAYLOAD = ("node", "address", "check", "figure", "threshold", "unit")
    node: int
    address: str
    check: str
    figure: Optional[float]
    threshold: Optional[float]
    unit: str
    detail: str = ""

    def text(self) -> str:
        return f"preflight: node {self.node} ({self.address}) is unhealthy: the {self.check} check{measured(self)}"


@dataclass(frozen=True)
class PoolHealthy(Event):
    """Every node of the pool passed its checks."""

    PREFECT_EVENT = "skytasks.pool.healthy"
    PAYLOAD = ("nodes", "seconds")
    nodes: int
    seconds: float
    level: str = "basic"

    def text(self) -> str:
        return f"preflight ({self.level}): {self.nodes} node{'s' * (self.nodes != 1)} healthy in {self.seconds:.2f}s"


@dataclass(frozen=True)
class PreflightTable(Event):
    """The figures of one start's preflight, a row per node and round (a round after a node was
    dropped or replaced checks the nodes again): the flow run's artifact `<task>-preflight`."""

    LEVEL = logging.DEBUG  # the table is the artifact's; the console gets the verdicts
    ARTIFACT = "preflight"
    level: str
    rows: tuple[dict[str, Any], ...]

    def table(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def text(self) -> str:
        lines = [f"preflight ({self.level}) figures:"]
        for row in self.rows:
            figures = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("node", "address", "verdict")
                                and v is not None)
            figures = ", ".join(f for f in figures.split(", ") if not f.startswith("round "))
            lines.append(f"  round {row.get('round', 1)}, node {row['node']} ({row['address']}): "
                         f"{figures or 'no figures'}: {row['verdict']}")
        return "\n".join(lines)
