"""What a call says along the way: an attempt restarted, ranks still running, output dropped, the
backend chosen, the workdir sent."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from skytasks.events.event import Event, Said


@dataclass(frozen=True)
class AttemptRestarted(Event, level=logging.WARNING, prefect="skytasks.attempt.restarted",
                       payload=("task", "attempt", "reason", "retries_left", "node_recoveries_left")):
    """An attempt failed and the whole group restarts: a retry (the code's failure) or a node
    recovery (a node lost or preempted), each from its own budget."""

    task: str
    attempt: int  # the attempt that failed
    reason: str  # the EndReason: "rank failed", "node lost", "preempted", ...
    cause: str  # the root cause, as repr
    charged: str  # "retries" or "node_recoveries"
    retries_left: int
    node_recoveries_left: int
    delay: float

    def text(self) -> str:
        if self.charged == "node_recoveries":
            budget = (f"a node recovery, not a retry ({self.node_recoveries_left} node "
                      f"recover{'y' if self.node_recoveries_left == 1 else 'ies'} left)")
        else:
            budget = f"{self.retries_left} retr{'y' if self.retries_left == 1 else 'ies'} left"
        return (f"{self.task}: attempt {self.attempt} failed ({self.cause}); {self.reason}; {budget}; "
                f"restarting the ranks in {self.delay:g}s")


@dataclass(frozen=True)
class RanksStillRunning(Said, level=logging.WARNING):
    """Some ranks returned and others still run: a warning, never a failure."""


@dataclass(frozen=True)
class LinesDropped(Event, level=logging.WARNING, prefect="skytasks.call.lines-dropped", payload=("total", "ranks")):
    """The record fell behind the ranks' output: lines past the controller's backlog were dropped,
    counted per rank, so the ranks never wait and the controller's memory stays bounded."""

    counts: tuple[tuple[int, int], ...]  # (rank, lines dropped), most first
    backlog: int  # the most lines the controller holds waiting

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)

    def payload(self) -> dict[str, Any]:
        return {"total": self.total, "ranks": len(self.counts)}

    def text(self) -> str:
        shown = "; ".join(f"rank {r}: {n:,}" for r, n in self.counts[:5])
        more = f"; and {len(self.counts) - 5} more ranks" if len(self.counts) > 5 else ""
        return (f"{self.total:,} output lines dropped: the record fell behind the ranks ({shown}{more}); the "
                f"controller holds at most {self.backlog:,} waiting lines (SKYTASKS_LINE_BACKLOG)")


@dataclass(frozen=True)
class BackendChosen(Said):
    """A backend fallback the user should know of (skytasks.devices)."""

@dataclass(frozen=True)
class WorkdirSynced(Said):
    """What `workdir=` sent to the nodes."""
