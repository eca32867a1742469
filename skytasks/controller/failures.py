"""Failures as values, on the controller: a rank's exception rebuilt, collateral told from cause,
and the one `DistributedTaskError` a caller sees (root cause first)."""

from __future__ import annotations

from typing import Any

import cloudpickle

from skytasks.controller.outcome import EndReason
from skytasks.errors import DistributedTaskError, HangError, RankFailure, RemoteRankError, RemoteTraceback
from skytasks.stacks import rank_ranges


def rebuild_exception(msg: dict[str, Any]) -> BaseException:
    """The rank's own exception if it can be unpickled here, else a stand-in with its strings."""
    exc: BaseException | None = None
    if msg.get("exception") is not None:
        try:
            exc = cloudpickle.loads(msg["exception"])
        except Exception:  # noqa: BLE001 - e.g. its class only exists on the node
            exc = None
    if not isinstance(exc, Exception):  # also KeyboardInterrupt/SystemExit: not groupable
        exc = RemoteRankError(msg["type"], msg["message"], msg.get("traceback", ""))
    if msg.get("traceback"):
        exc.__cause__ = RemoteTraceback(msg["traceback"])
    return exc


def is_collateral(exc: BaseException) -> bool:
    """Errors a rank raises because a peer vanished under a collective."""
    names = {c.__name__ for c in type(exc).__mro__}
    if names & {"DistBackendError", "DistNetworkError", "DistStoreError"}:
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL"))


def echoes(failure: RankFailure) -> bool:
    """A rank's failure that only echoes a peer's vanishing. A node's loss never does, whatever
    its words ("lost the agent of node 1: [Errno 32] Broken pipe"): it is the cause the echoes are of."""
    return failure.kind != EndReason.NODE_LOST and is_collateral(failure.exception)


def failure_error(label: str, failures: list[RankFailure], aborted_at: float | None) -> DistributedTaskError:
    """The error a caller sees: members are the first failures' exceptions, root cause first."""
    # Root cause first: the earliest failure that is not merely a peer's collateral (a rank
    # that exits kills its peers' collectives, and their errors can reach us before its exit).
    ordered = sorted(failures, key=lambda f: f.at)
    real = [f for f in ordered if not echoes(f)]
    first = real[0] if real else ordered[0]
    cutoff = aborted_at or float("inf")
    members = [first] + [f for f in real if f is not first and f.at <= cutoff]
    for f in failures:
        f.collateral = f not in members
    stopped = [f.rank for f in failures if f.collateral]
    if first.rank < 0:  # the call's own clock, not a rank
        msg = f"{label}: {first.exception}"
    elif all(isinstance(f.exception, HangError) for f in members):
        hung = [f.rank for f in members]
        seconds = getattr(first.exception, "seconds", 0.0)
        members = _one_per_place(members)  # 1,024 hung ranks in one collective are one member
        msg = (f"{label}: the call hung: ranks {rank_ranges(hung)} made no progress for "
               f"{seconds:g}s (each rank's stack is in its log)")
    else:
        msg = f"{label}: {len(members)} rank(s) failed; root cause on rank {first.rank}"
    err = DistributedTaskError(msg, [f.exception for f in members],
                               failures=members + [f for f in ordered if f not in members])
    if stopped:
        who = f"rank {stopped[0]} failed afterwards because of it and is not a member" if len(stopped) == 1 else \
            f"ranks {rank_ranges(stopped)} failed afterwards because of it and are not members"
        err.add_note(f"[skytasks] {who}")
    return err


def _one_per_place(hangs: list[RankFailure]) -> list[RankFailure]:
    """Hung ranks that stand in the same place become one member naming them all (its stack is
    the first one's; every rank's own is in its log)."""
    places: dict[str, list[RankFailure]] = {}
    for f in hangs:
        places.setdefault(f.exception.where, []).append(f)  # type: ignore[attr-defined]
    out = []
    for group in sorted(places.values(), key=lambda g: (-len(g), g[0].rank)):
        first = group[0]
        if len(group) > 1:
            exc: HangError = first.exception  # type: ignore[assignment]
            merged = HangError(exc.rank, exc.seconds, exc.where, exc.stack, ranks=tuple(f.rank for f in group))
            merged.__notes__ = list(getattr(exc, "__notes__", []))
            merged.skytasks_rank, merged.skytasks_node = first.rank, first.node_rank  # type: ignore[attr-defined]
            first = RankFailure(first.rank, first.node_rank, first.node_addr, merged, first.at, kind=first.kind)
        out.append(first)
    return out
