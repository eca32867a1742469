"""Failures as values, and the error a caller sees.

Like torch.distributed.elastic's ProcessFailure: each rank that failed becomes a `RankFailure`
(rank, node, what happened, when), and the caller gets one `DistributedTaskError` whose members
are the original exceptions of the ranks that failed first, root cause first. Ranks that were
stopped because of them are not members: they are the consequence, not the cause.
"""

from __future__ import annotations

import pickle
import signal
from dataclasses import dataclass
from typing import Any


class RemoteTraceback(Exception):
    """Carries a rank's formatted traceback as the __cause__ of the re-raised exception,
    the way concurrent.futures' ProcessPoolExecutor does."""

    def __init__(self, tb: str):
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


class RemoteRankError(Exception):
    """Stand-in for a rank's exception that could not be unpickled here."""

    def __init__(self, type_name: str, message: str, remote_traceback: str = ""):
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name
        self.remote_message = message
        self.remote_traceback = remote_traceback


class RankProcessDied(ChildProcessError):
    """A rank ended without raising: it exited non-zero or was killed by a signal."""

    def __init__(self, rank: int, returncode: int):
        self.rank, self.returncode = rank, returncode
        if returncode < 0:
            try:
                how = f"killed by signal {signal.Signals(-returncode).name}"
            except ValueError:
                how = f"killed by signal {-returncode}"
        else:
            how = f"exited with code {returncode}"
        super().__init__(f"rank {rank} {how} without raising an exception")


class CheckpointError(pickle.UnpicklingError):
    """`Checkpointer.load_latest()` refused a checkpoint: it holds something other than a state
    dict's tensors, numbers, strings and containers, which loading would have had to run code to
    build. `.type_name` is what it met (e.g. "posix.system"). A subclass of the error torch's own
    weights-only loading raises, so code that caught that still catches this."""

    def __init__(self, message: str, type_name: str = "", path: str = ""):
        super().__init__(message)
        self.type_name, self.path = type_name, path

    def __reduce__(self):
        return type(self), (str(self), self.type_name, self.path)


class PoolConfigError(ValueError):
    """Invalid pool or task configuration, reported before anything is launched."""


class PoolStartError(RuntimeError):
    """The pool's nodes could not be brought up; the message names the provider's node."""


class PoolGone(PoolStartError):
    """A provider's answer to `adopt`: its definite word that a warm pool's nodes are gone (a job
    SLURM no longer knows or that has ended, a 404 for the pool's owner object, every instance
    terminated). Any other failure to read the provider (a failed `squeue`, a timeout, a 5xx) is
    not this: the pool may still run, and it is asked again later, never taken for gone."""


class NodeGone(Exception):
    """A provider's answer to `reattach`: the node itself is gone (its instance terminated, its pod
    deleted, its job ended), so there is no agent to reach again and it is a lost node at once.
    The message says why, in the provider's words."""


class PoolTeardownError(RuntimeError):
    """Something the pool launched could not be confirmed gone; the message names it."""


@dataclass
class RankFailure:
    """One rank's failure, as a value."""

    rank: int
    node_rank: int
    node_addr: str
    exception: BaseException
    at: float  # controller clock when it was observed
    collateral: bool = False  # stopped or broken because another rank failed first
    kind: str = "rank failed"  # an EndReason (skytasks.controller.outcome): what kind of failure


class DistributedTaskError(ExceptionGroup):
    """Raised to the caller when ranks fail. Members: the first failures' original exceptions,
    each with `.skytasks_rank`, `.skytasks_node` and the remote traceback attached."""

    failures: list[Any]  # RankFailure values, root cause first

    def __new__(cls, message: str, exceptions, *, failures=()):
        self = super().__new__(cls, message, exceptions)
        self.failures = list(failures)
        return self

    def __init__(self, message: str, exceptions, *, failures=()):
        super().__init__(message, exceptions)

    def derive(self, excs):
        return DistributedTaskError(self.message, excs, failures=self.failures)


class ScriptFailed(ChildProcessError):
    """A `run_script` rank's script exited non-zero: its rank, exit code and the tail of its stderr."""

    def __init__(self, rank: int, exit_code: int, stderr_tail: str = "", recorded: str | None = None):
        self.rank, self.exit_code, self.stderr_tail, self.recorded = rank, exit_code, stderr_tail, recorded
        if exit_code < 0:
            try:
                how = f"was killed by signal {signal.Signals(-exit_code).name}"
            except ValueError:
                how = f"was killed by signal {-exit_code}"
        else:
            how = f"exited with code {exit_code}"
        text = f"rank {rank}: the script {how}"
        if recorded:
            text += f": {recorded}"
        if stderr_tail:
            text += "\n--- last lines of its stderr ---\n" + stderr_tail
        super().__init__(text)

    def __reduce__(self):
        return type(self), (self.rank, self.exit_code, self.stderr_tail, self.recorded)


class HangError(TimeoutError):
    """With `hang_timeout_seconds`: no rank wrote output, reported or finished for that long.
    Names the stuck rank and where it was; its whole stack is in `.stack` and its task-run log."""

    def __init__(self, rank: int, seconds: float, where: str = "", stack: str = "", ranks: tuple[int, ...] = ()):
        self.rank, self.seconds, self.where, self.stack = rank, seconds, where, stack
        self.ranks = tuple(ranks) or (rank,)  # every rank that stood in this same place
        if len(self.ranks) == 1:
            who, was = f"rank {rank}", f"rank {rank} was"
        else:
            from skytasks.stacks import rank_ranges

            who, was = f"{len(self.ranks):,} ranks ({rank_ranges(self.ranks)})", "they were"
        text = f"{who} hung: no rank wrote output, reported or finished for {seconds:g}s"
        super().__init__(text + (f"; {was} {where}" if where else "; its stack could not be read"))

    def __reduce__(self):
        return type(self), (self.rank, self.seconds, self.where, self.stack, self.ranks)
