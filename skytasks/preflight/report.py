"""What a preflight found, as events: said on the console and the run's log, and in Prefect as
events (`skytasks.node.unhealthy`, `skytasks.pool.healthy`) and a table artifact of the flow run."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from skytasks.events.event import Event, counted
from skytasks.preflight.rules import Finding, measured


@dataclass(frozen=True)
class NodeUnhealthy(Finding, Event, level=logging.WARNING, prefect="skytasks.node.unhealthy",
                    payload=("node", "address", "check", "figure", "threshold", "unit")):
    """A node failed a check before any user code ran on it: its `Finding`, said as an event."""

    def text(self) -> str:
        return f"preflight: node {self.node} ({self.address}) is unhealthy: the {self.check} check{measured(self)}"


@dataclass(frozen=True)
class PoolHealthy(Event, prefect="skytasks.pool.healthy", payload=("nodes", "seconds")):
    """Every node of the pool passed its checks."""

    nodes: int
    seconds: float
    level: str = "basic"
    figures: str = ""  # "full": each figure's range over the nodes (rules.spread)

    def text(self) -> str:
        said = f"preflight ({self.level}): {counted(self.nodes, 'node')} healthy in {self.seconds:.2f}s"
        return f"{said} ({self.figures})" if self.figures else said


@dataclass(frozen=True)
class PreflightTable(Event, level=logging.DEBUG):
    """The figures of one start's preflight, a row per node and round (a round after a node was
    dropped or replaced checks the nodes again): the flow run's artifact `<task>-preflight`. Said at
    DEBUG: the table is the artifact's; the console gets the verdicts."""

    ARTIFACT = "preflight"
    level: str
    rows: tuple[dict[str, Any], ...]

    def table(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.rows]

    def text(self) -> str:
        # The first line is the artifact's description, all a card in Prefect's UI shows of it.
        rounds = max((int(r.get("round", 1)) for r in self.rows), default=1)
        last = [r for r in self.rows if int(r.get("round", 1)) == rounds]
        healthy = sum(r["verdict"] == "healthy" for r in last)
        lines = [f"preflight ({self.level}): {counted(len({r['node'] for r in self.rows}), 'node')} checked"
                 f"{f' in {rounds} rounds' if rounds > 1 else ''}; {healthy} of {len(last)} healthy"
                 f"{' in the last' if rounds > 1 else ''}. Figures by node:"]
        for row in self.rows:
            figures = ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("node", "address", "verdict")
                                and v is not None)
            figures = ", ".join(f for f in figures.split(", ") if not f.startswith("round "))
            lines.append(f"  round {row.get('round', 1)}, node {row['node']} ({row['address']}): "
                         f"{figures or 'no figures'}: {row['verdict']}")
        return "\n".join(lines)
