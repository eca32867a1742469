"""`skytasks.checkpoint.committed`: the head tells its call that a checkpoint counts.

The head's commit sends one report on the rank's channel (a row of the call's live metrics
artifact: the newest checkpoint, its step, size and timings); the controller turns a report that
carries `checkpoint_step` into this event too, related to the pool, the flow run and the task run
like the call's other events (`skytasks.controller.call_run`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skytasks.events import Event

REPORT_KEYS = ("checkpoint", "checkpoint_step", "checkpoint_bytes", "checkpoint_blocked_seconds",
               "checkpoint_seconds")


@dataclass(frozen=True)
class CheckpointCommitted(Event, prefect="skytasks.checkpoint.committed"):
    step: int
    bytes: int
    blocked_seconds: float  # how long `save` held the training loop (staging, with async_save)
    seconds: float  # from `save` to the marker
    path: str

    def text(self) -> str:
        return (f"checkpoint of step {self.step} committed at {self.path} ({size(self.bytes)}; training blocked "
                f"{self.blocked_seconds:.2f}s, committed after {self.seconds:.2f}s)")


def size(nbytes: int) -> str:
    """512 bytes, 10.3 kB, 340 MB, 1.5 GB, 2.5 TB: three figures at most, in decimal units."""
    if nbytes < 1000:
        return f"{nbytes} bytes"
    for unit, scale in (("kB", 1e3), ("MB", 1e6), ("GB", 1e9), ("TB", 1e12)):
        value = nbytes / scale
        if float(f"{value:.3g}") < 1000:
            return f"{value:.3g} {unit}"
    return f"{value:.0f} TB"


def from_report(metrics: dict[str, Any]) -> CheckpointCommitted | None:
    """The event a head's commit report stands for; None for any other report."""
    if "checkpoint_step" not in metrics:
        return None
    try:
        return CheckpointCommitted(int(metrics["checkpoint_step"]), int(metrics.get("checkpoint_bytes", 0)),
                                   float(metrics.get("checkpoint_blocked_seconds", 0.0)),
                                   float(metrics.get("checkpoint_seconds", 0.0)), str(metrics.get("checkpoint", "")))
    except (TypeError, ValueError):
        return None  # a user's own report that happens to use the name: a row, not an event


def tell_the_call(info: dict[str, Any]) -> None:
    """From the head's commit: the report (inside a rank; nothing elsewhere)."""
    from skytasks import metrics
    from skytasks.protocol import Op, message

    if metrics._channel is None:
        return
    row = {"checkpoint": info["path"], "checkpoint_step": info["step"], "checkpoint_bytes": info["bytes"],
           "checkpoint_blocked_seconds": info["blocked_seconds"], "checkpoint_seconds": info["seconds"]}
    try:
        metrics._channel.send(message(Op.REPORT, metrics=row))
    except Exception:  # noqa: BLE001 - the checkpoint is committed; a lost report never fails it
        pass
