"""`skytasks check --pool NAME --preflight`: bring the saved pool's nodes up, run the "full"
checks on all of them at once, print the table, and end them (whatever the pool's `preflight`)."""

from __future__ import annotations

import logging
from typing import Any

from skytasks.controller.rank_group import GroupSpec
from skytasks.errors import PoolStartError
from skytasks.events import Event, level_of
from skytasks.preflight.rules import Verdict
from skytasks.settings import settings


def run(pool: Any, out: Any) -> int:
    """0: every node healthy; 1: some are not (named); 2: the nodes did not come up."""
    from skytasks.preflight.check import measure, rules_of

    runtime = pool.runtime()
    try:
        session = runtime.start_session(preload=("torch",))
    except PoolStartError as exc:
        print(f"skytasks check: the pool did not come up: {exc}", file=out)
        return 2
    try:
        group = GroupSpec(None, True, settings().init_timeout_seconds)
        verdict = measure(session, rules_of(runtime.spec, "full"), group, Printer(out))
    finally:
        runtime.close_session(session)
    print(table(verdict), file=out)
    for finding in verdict.findings:
        print(f"UNHEALTHY {finding.text()}", file=out)
    print(f"skytasks check: preflight {'passed' if verdict.healthy else 'failed'} on {len(verdict.nodes)} nodes",
          file=out)
    return 0 if verdict.healthy else 1


def table(verdict: Verdict) -> str:
    """The verdict's rows as aligned text columns."""
    rows = verdict.rows()
    if not rows:
        return ""
    columns = [c for c in rows[0] if any(r[c] not in (None, "") for r in rows)]
    cells = [[str(c) for c in columns]] + [["-" if r[c] is None else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in cells)


class Printer:
    """The probe's observer for the command line: events worth a person's eye, printed."""

    def __init__(self, out: Any):
        self.out = out

    def on_event(self, event: Event) -> None:
        if level_of(event) >= logging.INFO:
            print(event.text(), file=self.out)

    def on_output(self, rank: int, stream: str, line: str) -> None:
        pass

    def on_log(self, rank: int, level: int, line: str) -> None:
        pass

    def on_rank_done(self, rank: int, outcome: Any) -> None:
        pass

    def on_report(self, rank: int, metrics: dict[str, Any]) -> None:
        pass

    def on_stacks(self, stacks: dict[int, str], why: str) -> None:
        pass

    def on_resources(self, rank: int, figures: dict[str, float]) -> None:
        pass
