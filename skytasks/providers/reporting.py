"""What providers tell people while nodes come and go: the observer behind every provider.

Providers never print. Each one is given a `PoolReporter` and calls it: `progress` while nodes come
up (an allocation pending with SLURM's reason, instances booting), `notice` for what happened to a
node (lost, replaced, going away), and `teardown_failed` when something it made cannot be
confirmed gone. The reporter writes every line to the `skytasks` logger (which prints to stderr
unless the application configured it), and inside a flow run also to the flow run's own log, a
progress artifact, and Prefect events an Automation can act on:

    skytasks.pool.teardown-failed   payload: resources (ids), detail    ERROR in the flow run's log
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Sequence

from skytasks.errors import PoolTeardownError

logger = logging.getLogger("skytasks")
_handler_lock = threading.Lock()


def console_logger() -> logging.Logger:
    """The `skytasks` logger, printing to stderr when nobody configured it (a library must not
    force output on an application that did)."""
    with _handler_lock:
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("skytasks: %(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
    return logger


def flow_run_id() -> str | None:
    """The flow run this process is in, if any (tags on what a pool makes)."""
    if "prefect.context" not in sys.modules:
        return None  # no Prefect, no run (and no import of Prefect just to find that out)
    try:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        return str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    except Exception:  # noqa: BLE001
        return None


class PoolReporter:
    """One pool's reporter. `key` names its progress artifact (the pool's own id)."""

    def __init__(self, pool_name: str, provider: str):
        self.pool_name, self.provider = pool_name, provider
        self.key = pool_name
        self._artifact = None
        self._last: tuple[int, str] | None = None
        self.lines: list[str] = []  # everything said, in order (tests and post-mortems read it)

    def progress(self, ready: int, total: int, detail: str) -> None:
        """Nodes coming up: `ready` of `total`, and what the rest are doing. Said on change only."""
        if (ready, detail) == self._last:
            return
        self._last = (ready, detail)
        self._say(logging.INFO, f"{self.key}: {ready}/{total} nodes ready - {detail}")
        if flow_run_id() is None:
            return
        try:
            from prefect.artifacts import create_progress_artifact, update_progress_artifact

            percent = 100.0 * ready / max(total, 1)
            if self._artifact is None:
                key = "".join(c if c.isalnum() else "-" for c in f"{self.key}-launch".lower())
                self._artifact = create_progress_artifact(percent, key=key,
                                                          description=f"nodes of {self.key} ready")
            else:
                update_progress_artifact(self._artifact, percent)
        except Exception:  # noqa: BLE001 - progress display never fails a launch
            pass

    def notice(self, line: str, level: int = logging.INFO) -> None:
        self._say(level, line)

    def teardown_failed(self, resources: Sequence[str], detail: str) -> PoolTeardownError:
        """Something the pool made may still exist (and cost money): an ERROR naming every
        resource, an event to page on, and the error the pool's exit raises."""
        ids = list(resources)
        text = (f"{self.key}: teardown could not confirm these gone: {', '.join(ids) or '(unknown)'} ({detail}); "
                f"`skytasks gc` finds them by their tags or job name")
        self._say(logging.ERROR, text)
        from skytasks.prefect_records.events import emit, pool_resource

        try:
            emit("skytasks.pool.teardown-failed", pool_resource(self.pool_name),
                 payload={"provider": self.provider, "pool_id": self.key, "resources": ids, "detail": detail})
        except Exception:  # noqa: BLE001 - the error below is raised whatever happens here
            pass
        return PoolTeardownError(text)

    def _say(self, level: int, line: str) -> None:
        self.lines.append(line)
        console_logger().log(level, line)
        if flow_run_id() is None:
            return
        try:
            from prefect import get_run_logger

            get_run_logger().log(level, line)
        except Exception:  # noqa: BLE001 - a display problem never fails the pool
            pass
