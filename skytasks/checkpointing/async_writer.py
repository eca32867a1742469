"""The save in flight: DCP's writing in the background, then the commit, one at a time.

`dcp.async_save` stages the state to host memory (pinned on GPU) before it returns, and writes in
a thread (CPU) or a separate process (GPU, as PyTorch recommends: the writing never holds the
training process's GIL). After it, on one background thread of this process, the commit: each rank
publishes its files (S3: uploads them), every rank says whether its part is in place (a collective
on the checkpoint group), and the head writes the marker and prunes to `keep`. One thread for every
Checkpointer of the process: the checkpoint group's collectives never interleave.

A rank's function returning waits here for its saves (`wait_for_saves`, from the rank worker), and
so does a preemption notice, within its grace.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from skytasks.errors import CheckpointError

_committer: ThreadPoolExecutor | None = None
_lock = threading.Lock()
_pending: list[SaveInFlight] = []


class SaveInFlight:
    """One save: its step, where it goes, and the future of its commit (the committed info)."""

    def __init__(self, step: int, where: str, future: Future):
        self.step, self.where, self.future = step, where, future

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        try:
            return self.future.result(timeout)
        except CheckpointError:
            raise
        except TimeoutError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every failure of a save is a CheckpointError to its caller
            raise CheckpointError(f"the checkpoint of step {self.step} at {self.where} was not committed: "
                                  f"{type(exc).__name__}: {exc}", "", self.where) from exc
        finally:
            if self.future.done():
                with _lock:
                    if self in _pending:
                        _pending.remove(self)


def start_commit(step: int, where: str, work: Callable[[], dict[str, Any]]) -> SaveInFlight:
    """Run `work` (wait for the writing, then commit) on the committer thread."""
    global _committer
    with _lock:
        if _committer is None:
            _committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skytasks-checkpoint-commit")
        save = SaveInFlight(step, where, _committer.submit(work))
        _pending.append(save)
    return save


def saves_in_flight() -> list[SaveInFlight]:
    with _lock:
        return list(_pending)


def wait_for_saves(deadline: float | None = None) -> None:
    """Every save of this process still in flight, committed; raises the first one's
    CheckpointError. `deadline` (epoch seconds): a preemption's grace; past it, the saves left
    are given up (an uncommitted checkpoint is never restored) and a CheckpointError says so."""
    for save in saves_in_flight():
        timeout = None if deadline is None else max(0.0, deadline - time.time())
        try:
            save.wait(timeout)
        except TimeoutError:
            raise CheckpointError(f"the checkpoint of step {save.step} at {save.where} was not committed within "
                                  f"the preemption's grace; the previous committed one is what a resume gets",
                                  "", save.where) from None
