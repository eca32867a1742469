"""A teardown that Ctrl-C and SIGTERM cannot cut short: written once, for every provider that
owns something that costs money or holds a queue (EC2 instances, SLURM jobs)."""

from __future__ import annotations

import contextvars
import threading
from typing import Callable


def uninterruptible(teardown: Callable[[], BaseException | None], on_interrupt: Callable[[], None],
                    name: str) -> None:
    """Run `teardown` in a thread of its own and wait for it through interrupts: an interrupt must
    not abandon running instances or jobs half way. `on_interrupt` says why the caller still
    waits; the interrupt is raised once the teardown is done, else the error `teardown` returned.
    The caller's context goes along: inside a flow, what the teardown reports reaches the run."""
    box: dict[str, BaseException | None] = {}

    def run() -> None:
        box["error"] = teardown()

    worker = threading.Thread(target=contextvars.copy_context().run, args=(run,), name=name)
    worker.start()
    interrupted: BaseException | None = None
    while worker.is_alive():
        try:
            worker.join()
        except (KeyboardInterrupt, SystemExit) as exc:  # SystemExit: SIGTERM, see PoolRuntime
            interrupted = interrupted or exc
            on_interrupt()
    if interrupted is not None:
        raise interrupted
    if box.get("error") is not None:
        raise box["error"]  # type: ignore[misc]
