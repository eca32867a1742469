"""The console observer: outside a flow, each rank's lines on this process's console."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from skytasks.controller.rank_group import RankOutcome
from skytasks.controller.runner import SHOW_RESOURCES
from skytasks.controller.usage import RankUsage
from skytasks.events import Event, announce, level_of
from skytasks.controller.stack_groups import stack_lines


class ConsoleObserver:
    """Lines prefixed `[rank R]`; the runner's notices prefixed `[skytasks]`; a rank's resource
    warnings always, its figures with `skytasks run --resources`."""

    def __init__(self) -> None:
        self._usage: dict[int, RankUsage] = {}

    def on_attempt_start(self, attempt: int, world_size: int) -> None:
        pass

    def on_attempt_end(self, attempt: int, error: BaseException | None) -> None:
        pass

    def on_call_end(self, error: BaseException | None) -> None:
        pass

    def on_output(self, rank: int, stream: str, line: str) -> None:
        print(f"[rank {rank}] {line}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)

    def on_log(self, rank: int, level: int, line: str) -> None:
        print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)

    def on_rank_done(self, rank: int, outcome: RankOutcome) -> None:
        pass

    def on_event(self, event: Event) -> None:
        announce(event)
        if level_of(event) >= logging.INFO:
            print(f"[skytasks] {event.text()}", file=sys.stderr, flush=True)

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        for line in stack_lines(stacks, why):  # ranks in one place share a line
            print(line, file=sys.stderr, flush=True)

    def on_resources(self, rank: int, figures: dict[str, float]) -> None:
        usage = self._usage.setdefault(rank, RankUsage(rank))
        for warning in usage.add(figures, time.monotonic()):
            print(f"[rank {rank}] WARNING {warning}", file=sys.stderr, flush=True)
        if SHOW_RESOURCES.get():
            print(f"[rank {rank}] uses {usage.line()}", file=sys.stderr, flush=True)

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        if "checkpoint_step" in metrics:
            from skytasks.checkpointing.committed_event import REPORT_KEYS, from_report

            if set(metrics) <= set(REPORT_KEYS) and from_report(metrics) is not None:
                return  # a head's commit: its event's line says it ("checkpoint of step 7 committed at ...")
        shown = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print(f"[rank {rank}] report: {shown}", flush=True)
